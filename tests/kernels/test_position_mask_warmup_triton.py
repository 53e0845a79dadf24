"""The startup warm-up of SGLang's masked extend (``reuse/mask_warmup.py``) running SGLang's
real kernel: under TRITON_INTERPRET=1 on CPU (scripts/test.sh sets it for this folder),
natively on a CUDA machine. Its launches carry the custom mask and the flag PCR's serving
hook passes, leave the KV pool as it was, and compute the masked attention a torch reference
does; on a GPU, a serving-shaped permuted launch afterwards compiles nothing (timed)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
pytest.importorskip("triton")
# The kernel is SGLang's: a machine without SGLang (the GPU check's) skips it.
extend_module = pytest.importorskip(
    "sglang.kernels.ops.attention.extend_attention", reason="SGLang's Triton extend attention kernel is not installed"
)
DEVICE = "cpu" if INTERPRET else "cuda"

from pcr_sglang.reuse import mask_warmup  # noqa: E402
from pcr_sglang.reuse.forward_plan import ForwardPlan, ForwardPlans  # noqa: E402
from pcr_sglang.reuse.rows import triton_position_mask  # noqa: E402
from pcr_sglang.sglang_adapter import forward_hooks  # noqa: E402

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 16 if INTERPRET else 64, 64
DTYPE = torch.float32 if INTERPRET else torch.bfloat16
TOLERANCE = 1e-4 if INTERPRET else 2e-2


class Pool:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.k = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(DTYPE).to(DEVICE)
        self.v = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(DTYPE).to(DEVICE)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v


class TritonAttnBackend:  # what the warm-up reads of SGLang's (named alike: it is found by name)
    def __init__(self) -> None:
        self.token_to_kv_pool = Pool()
        self.kv_indptr = torch.zeros(17, dtype=torch.int32, device=DEVICE)
        self.qo_indptr = torch.zeros(17, dtype=torch.int64, device=DEVICE)
        self.page_size, self.dcp_size, self.enable_deterministic, self.dllm_attention = 1, 1, False, None
        self.extend_attention_fwd = extend_module.extend_attention_fwd


def _model() -> torch.nn.Module:
    from sglang.srt.layers.radix_attention import RadixAttention

    return torch.nn.ModuleList([RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=0)])


def _serving_skip_prefix_flag() -> Any:
    """What PCR's hook passes the kernel in a forward whose plan set the position mask."""
    backend = SimpleNamespace(token_to_kv_pool=torch.nn.Module())
    plans = ForwardPlans().attach(backend.token_to_kv_pool)
    plans.current = ForwardPlan(rows={}, position_mask=True)
    return forward_hooks.triton_extend_kernel(lambda b, *a, **kw: kw, backend, "layer")["skip_prefix_custom_mask"]


def _reference(args: tuple[Any, ...], scale: float) -> torch.Tensor:
    """Each request's queries over its keys (prefix from the pool by index, then its extend),
    masked by the custom mask itself, in float64."""
    q, k, v, _, k_pool, v_pool, qo, kv_indptr, kv_indices, mask, _, mask_indptr = args[:12]
    out = torch.empty(q.shape[0], HEADS, DIM, dtype=torch.float64)
    for i in range(qo.numel() - 1):
        a, b = int(qo[i]), int(qo[i + 1])
        slots = kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])]
        keys = torch.cat([k_pool[slots], k[a:b]]).double().repeat_interleave(HEADS // KV_HEADS, 1)
        values = torch.cat([v_pool[slots], v[a:b]]).double().repeat_interleave(HEADS // KV_HEADS, 1)
        seen = mask[int(mask_indptr[i]) : int(mask_indptr[i + 1])].view(b - a, keys.shape[0]).cpu()
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double().cpu(), keys.cpu()) * scale
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", weights, values.cpu())
    return out


def test_the_warm_up_runs_sglangs_kernel_masked_as_serving_and_writes_no_kv():
    backend = TritonAttnBackend()
    worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, dtype=DTYPE))
    pool = backend.token_to_kv_pool
    before = (pool.k.clone(), pool.v.clone())
    calls = []
    gen = torch.Generator().manual_seed(2)

    def extend(*args: Any, **kwargs: Any) -> None:
        for scratch in args[:3]:  # the warm-up's own zeros: random, for a comparison that can fail
            scratch.copy_(torch.randn(scratch.shape, generator=gen).to(scratch.dtype))
        extend_module.extend_attention_fwd(*args, **kwargs)
        calls.append((args, kwargs))

    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    report = mask_warmup.warm_up_position_mask(
        worker, _model(), fill_gaps=True, on_cuda=True, extend=extend, synchronize=sync
    )
    assert report is not None and len(calls) == len(mask_warmup.BATCH_SIZES)
    serving_flag = _serving_skip_prefix_flag()
    for args, kwargs in calls:
        mask, mask_indptr = args[9], args[11]
        batch = args[6].numel() - 1
        expected_mask, _ = triton_position_mask(
            {0: torch.tensor([0, 2, 1])}, [3] * batch, [1] * batch, torch.device("cpu")
        )
        assert mask.dtype == torch.bool and torch.equal(mask.cpu(), expected_mask)  # the form serving builds
        assert mask_indptr.dtype == torch.int64 and args[10] is True
        assert kwargs["skip_prefix_custom_mask"] is serving_flag is False
        torch.testing.assert_close(args[3].double().cpu(), _reference(args, DIM**-0.5), rtol=TOLERANCE, atol=TOLERANCE)
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])


@pytest.mark.skipif(INTERPRET, reason="compiled kernels exist only on a GPU (the interpreter compiles nothing)")
def test_after_the_warm_up_a_permuted_serving_launch_compiles_nothing():
    """A serving-shaped launch (3 requests of other lengths, a permuted row, q a view of a
    fused qkv projection, indices from the pinned ring) hits what the warm-up compiled;
    its time is printed (the first permuted forward's kernel, after startup)."""
    backend = TritonAttnBackend()
    worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, dtype=DTYPE))
    report = mask_warmup.warm_up_position_mask(worker, _model(), fill_gaps=True)
    assert report is not None
    print(f"warm-up: {len(report.launches)} launches, {report.seconds:.2f} s")

    def compiled() -> int:
        return sum(len(caches[0]) for caches in extend_module._fwd_kernel.device_caches.values())

    before = compiled()
    prefix, extend = [40, 7, 130], [33, 5, 70]
    seq = [p + e for p, e in zip(prefix, extend)]
    order = list(range(seq[1]))
    order[2], order[-1] = order[-1], order[2]
    mask, mask_indptr = triton_position_mask({1: torch.tensor(order, device=DEVICE)}, seq, prefix, torch.device(DEVICE))
    qkv = torch.randn(sum(extend), (HEADS + 2 * KV_HEADS) * DIM, device=DEVICE, dtype=DTYPE)
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    pool = backend.token_to_kv_pool
    torch.cuda.synchronize()
    start = time.perf_counter()
    extend_module.extend_attention_fwd(
        q.view(-1, HEADS, DIM),
        k.reshape(-1, KV_HEADS, DIM).contiguous(),
        v.reshape(-1, KV_HEADS, DIM).contiguous(),
        torch.empty(sum(extend), HEADS, DIM, device=DEVICE, dtype=DTYPE),
        pool.k,
        pool.v,
        torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], device=DEVICE),
        torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32),
        torch.arange(sum(prefix), device=DEVICE) % SLOTS,
        mask,
        True,
        mask_indptr,
        max(extend),
        1.0,
        1.0,
        DIM**-0.5,
        skip_prefix_custom_mask=_serving_skip_prefix_flag(),
    )
    torch.cuda.synchronize()
    print(f"first permuted extend after the warm-up: {(time.perf_counter() - start) * 1e3:.1f} ms")
    assert compiled() == before
