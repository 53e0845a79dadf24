"""Document reuse inside its reserved scratch (issue 42 item 4): a request whose blend probe
(``--pcr-blend-probe-mb``) or whose permuted row's position mask (``--pcr-position-mask-mb``)
could need more than reserved is recomputed at admission, before anything is loaded,
allocated, copied or run, and counted; a request within both is served as before. The
mask's bound holds for any chunking of the extend. Nothing here ran on a GPU."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pcr_sglang.reuse import rows as permuted_rows
from pcr_sglang.reuse.blend_select import BlendProbe
from pcr_sglang.reuse.bounds import DocSpan, Recompute
from pcr_sglang.reuse.doc_copy import to_device
from pcr_sglang.reuse.doc_stats import DocReuseStats
from pcr_sglang.reuse.placement import DocReuse, _Planned
from pcr_sglang.reuse.plan import CopySegment, ReusePlan
from tests.unit.reuse.test_doc_reuse_setup import _stand_in_model

# Positions 4..7 exact (delta 0), 8..13 re-placed; the request is 20 tokens long.
PLAN = ReusePlan((CopySegment(0, 4, 8, 4), CopySegment(1, 8, 14, 4)), 4, 14, 8, recompute_count=2, selector="deviation")
IN_ORDER = ReusePlan((CopySegment(0, 4, 8, 0), CopySegment(1, 8, 14, 0)), 4, 14, 14)
TOTAL = 20


def _fail(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} reached for a request over its budget")

    return fail


def _docs(probe_bytes=None, mask_bytes=None, plan=PLAN):
    """A DocReuse holding one planned request, its chains on the device; locking or copying
    fails the test (admission locks, loads and allocates only for a ``DocLoad`` it is given)."""
    model, pools = _stand_in_model(5)
    docs = object.__new__(DocReuse)
    docs.stats = DocReuseStats()
    docs.probe = BlendProbe(model, pools, scratch_bytes=probe_bytes)
    docs.mask_bytes = mask_bytes
    docs._warned_budget = False
    docs.state = SimpleNamespace(lock=_fail("lock"), unlock=_fail("unlock"))
    docs.copier = SimpleNamespace(place=_fail("a copy"), copy=_fail("a copy"))
    entry = _Planned((DocSpan(0, 4, 8), DocSpan(1, 8, 14)), Recompute("blend"), plan=plan)
    entry.chains = {doc: [SimpleNamespace(on_device=True, on_host=False)] for doc in (0, 1)}  # loadable
    docs.engine = None
    docs._requests = {"r": entry}
    req = SimpleNamespace(rid="r", origin_input_ids=list(range(100, 100 + TOTAL)), output_ids=[])
    return docs, entry, req


def _probe_need():
    model, pools = _stand_in_model(5)
    return BlendProbe(model, pools).scratch_estimate(PLAN.tokens, PLAN.start, 0)


def _load(docs, req):
    """What admission is asked to provide: nothing (no chain to load, no slots, no fence)."""
    return docs.load(req)


def test_a_request_whose_probe_could_exceed_its_budget_is_recomputed_before_anything_runs():
    docs, entry, req = _docs(probe_bytes=_probe_need() - 1)
    assert _load(docs, req) is None
    assert entry.plan is None and docs.stats.probe_over_budget == 1 and docs.stats.load_failures == 0
    docs, entry, req = _docs(probe_bytes=_probe_need())
    assert docs._over_budget(req, PLAN) is None


def test_a_request_whose_position_mask_could_exceed_its_budget_is_recomputed_before_anything_runs():
    need = permuted_rows.row_mask_bound(PLAN.start + PLAN.prefix_tokens, TOTAL)
    assert need == (TOTAL - 4 - 8) * TOTAL  # the extend starts after the exact prefix and the 8 kept tokens
    docs, entry, req = _docs(mask_bytes=need - 1)
    assert _load(docs, req) is None
    assert entry.plan is None and docs.stats.mask_over_budget == 1 and docs.stats.load_failures == 0
    docs, entry, req = _docs(mask_bytes=need)
    assert docs._over_budget(req, PLAN) is None


def test_an_in_order_row_needs_neither_mask_nor_probe():
    docs, entry, req = _docs(probe_bytes=1, mask_bytes=1, plan=IN_ORDER)
    assert docs._over_budget(req, IN_ORDER) is None
    assert docs.stats.probe_over_budget == docs.stats.mask_over_budget == 0


@pytest.mark.parametrize("seed", range(20))
def test_the_mask_bound_holds_for_any_chunking_of_the_extend(seed):
    rng = random.Random(seed)
    total = rng.randrange(2, 400)
    cached = rng.randrange(0, total)
    bound = permuted_rows.row_mask_bound(cached, total)
    prefix = cached
    while prefix < total:  # SGLang's chunked prefill cuts the extend anywhere
        extend = rng.randrange(1, total - prefix + 1)
        assert permuted_rows.position_mask_bytes([prefix], [extend]) <= bound
        prefix += extend


def test_admission_indices_cross_through_the_pinned_ring_keeping_their_shape(monkeypatch):
    """On CUDA the admission's index tensors go through the pinned ring allocated once, not
    a ``pin_memory()`` per admission, and keep their shape."""
    seen = []
    monkeypatch.setattr(
        permuted_rows,
        "_staging",
        lambda device: SimpleNamespace(to_device=lambda values: seen.append(values.shape) or values.reshape(-1)),
    )
    index = torch.arange(12).reshape(3, 4)
    out = to_device(index, torch.device("cuda", 0))
    assert seen == [torch.Size([3, 4])] and out.shape == (3, 4) and torch.equal(out, index)


# ---------------------------------------------------------------- reserved from SGLang's KV pool
def _config(mode, probe_mb=1024, mask_mb=256):
    from pcr_sglang.config import PCRConfig

    return PCRConfig(doc_reuse=mode, blend_probe_mb=probe_mb, position_mask_mb=mask_mb)


def test_the_scratch_reserved_is_what_the_mode_can_take():
    from pcr_sglang.reuse.scratch import ScratchReserve, scratch_reserve

    assert scratch_reserve(_config("off")) == scratch_reserve(_config("reorder")) == ScratchReserve()
    assert scratch_reserve(_config("concat")) == scratch_reserve(_config("lego")) == ScratchReserve(0, 256 << 20)
    assert scratch_reserve(_config("blend", 100, 20)) == ScratchReserve(100 << 20, 20 << 20)


def test_on_cuda_the_kv_pool_is_sized_without_the_reserve_and_a_pool_left_empty_is_refused():
    from pcr_sglang.reuse.scratch import ScratchReserve, reserve_from_kv_pool

    reserve = ScratchReserve(1 << 30, 256 << 20)
    assert reserve_from_kv_pool(10 << 30, reserve, "cuda") == (10 << 30) - (1 << 30) - (256 << 20)
    assert reserve_from_kv_pool(10 << 30, reserve, "cpu") == 10 << 30  # sized from host memory: not PCR's GPU
    assert reserve_from_kv_pool(10 << 30, ScratchReserve(), "cuda") == 10 << 30
    with pytest.raises(ValueError, match="--pcr-blend-probe-mb 1024, --pcr-position-mask-mb 256.*--mem-fraction"):
        reserve_from_kv_pool(reserve.total, reserve, "cuda")


def test_the_plugin_takes_the_reserve_where_sglang_sizes_its_kv_pool(monkeypatch, tmp_path):
    """Registered on SGLang's own sizing method (it exists in the pinned SGLang), for a PCR
    server only, from the server's flags."""
    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import prepare_server_args

    from pcr_sglang import plugin

    if not plugin._registered:
        plugin.register()
    assert hasattr(KVCacheConfigurator, plugin.KV_POOL_BUDGET.rsplit(".", 1)[1])
    assert any(
        kind is HookType.AFTER and hook is plugin._reserve_doc_scratch
        for kind, hook, _ in HookRegistry._hooks.get(plugin.KV_POOL_BUDGET, [])
    )
    cuda = SimpleNamespace(device="cuda")
    base = ["--model-path", str(tmp_path), "--skip-server-warmup"]
    for argv, left in (
        (
            ["--enable-pcr", "--pcr-doc-reuse", "blend", "--pcr-blend-probe-mb", "64", "--pcr-position-mask-mb", "32"],
            (1 << 30) - (96 << 20),
        ),
        (["--enable-pcr"], 1 << 30),  # no document reuse: nothing reserved
        ([], 1 << 30),
    ):  # not a PCR server
        monkeypatch.setattr(runtime_context, "get_server_args", lambda a=argv: prepare_server_args(base + a))
        assert plugin._reserve_doc_scratch(1 << 30, cuda, 0) == left, argv


def test_a_batchs_position_mask_is_one_tensor_of_exactly_its_bytes():
    """The mask is written in place into one tensor of ``position_mask_bytes``: no
    per-request masks concatenated afterwards (which would take twice the bytes)."""
    from tests.unit.transfer.cuda_recorder import HostTraffic, RecordingCuda

    order = torch.tensor([0, 1, 5, 4, 3, 2, 6, 7])
    traffic = HostTraffic(RecordingCuda())
    with traffic:
        mask, indptr = permuted_rows.triton_position_mask({1: order}, [7, 8], [4, 2], torch.device("cpu"))
    assert mask.dtype == torch.bool and mask.numel() == permuted_rows.position_mask_bytes([4, 2], [3, 6])
    assert [name for _, name in traffic.allocations if name in ("cat", "stack")] == []
    assert indptr.tolist() == [0, 3 * 7, 3 * 7 + 6 * 8]
    assert mask[21:].view(6, 8)[0].tolist() == [True, True, True, True, True, True, False, False]  # position 5
