"""Recompute modes' forward pieces (pcr_sglang.reuse.rows), no server.

The attention check is an invariance: keys carry their RoPE already, so a request whose
row holds its positions in another order (kept reused tokens, then the recomputed ones,
then the rest) must get, for each query, exactly what the same query gets over the row in
position order, once each query sees the keys at positions up to its own. The negative
control runs the permuted row through SGLang's own (bottom-right causal) mask, which must
give other outputs, so the comparison can tell a wrong mask.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pcr_sglang.reuse.forward_plan import ForwardPlan, ForwardPlans
from pcr_sglang.reuse.plan import RowOrder
from pcr_sglang.reuse.rows import (
    permute_extend_inputs,
    position_causal_sdpa_extend,
    triton_position_mask,
)
from tests.unit.reuse.test_torch_native_extend import BATCH, TOLERANCES, make_batch, reference_padded, run_backend

HEAD_DIM = 16


class Batch(SimpleNamespace):
    """A stand-in for SGLang's ``ScheduleBatch`` (weakly referenceable, as it is)."""


def _plans_with(backend, plan):
    """``backend``'s KV pool with ``plan`` as its current forward's."""
    backend.token_to_kv_pool = pool = torch.nn.Module()  # any object SGLang's pool could be
    plans = ForwardPlans().attach(pool)
    plans.current = plan
    return plans


def _bound(rows):
    """A plan bound to a forward: batch index -> (request-pool row, positions)."""
    return ForwardPlan(rows={i: p for i, (_, p) in rows.items()}, bound=dict(rows))


def _native(b, rows, scaling=0.3):
    output = torch.full_like(b.query, float("nan"))
    return position_causal_sdpa_extend(
        rows,
        b.query,
        output,
        b.k_cache,
        b.v_cache,
        b.req_to_token,
        b.req_pool_indices,
        b.seq_lens,
        b.prefix_lens,
        b.extend_lens,
        scaling,
        b.query.shape[1] != b.k_cache.shape[1],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_in_position_order_are_a_plain_causal_extend(dtype):
    """Requests without a permuted row (every other request of a batch that has one)."""
    b = make_batch(BATCH, 6, 2, dtype)
    torch.testing.assert_close(_native(b, {}), reference_padded(b, 0.3, True, None), **TOLERANCES[dtype])


ROW = RowOrder(8, tuple([p for p in range(8, 30) if p not in (8, 9, 10, 20, 21)] + [8, 9, 10, 20, 21]))
SEQ = 40


def _natural_and_permuted(dtype, num_heads=4, num_kv_heads=2, seed=0):
    """The same request twice: its row in position order (an extend of positions 8..39),
    and permuted by ``ROW`` (an extend of the recomputed positions, then 30..39)."""
    gen = torch.Generator().manual_seed(seed)
    slot_of = torch.randperm(SEQ + 7, generator=gen)[:SEQ]  # position -> slot, scattered
    k_cache = torch.randn(SEQ + 7, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(SEQ + 7, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
    query_at = torch.randn(SEQ, num_heads, HEAD_DIM, generator=gen).to(dtype)  # position -> query
    order = ROW.positions_of_slots(0, SEQ)
    prefix = ROW.start + len(ROW.positions) - 5
    queries = order[prefix:]  # the recomputed positions, then the rest

    def batch(positions, prefix_len):
        req_to_token = torch.zeros((2, SEQ + 3), dtype=torch.int64)
        req_to_token[1, :SEQ] = slot_of[torch.tensor(positions)]
        return SimpleNamespace(
            query=query_at[torch.tensor(positions[prefix_len:])].clone(),
            k_cache=k_cache,
            v_cache=v_cache,
            req_to_token=req_to_token,
            req_pool_indices=torch.tensor([1]),
            seq_lens=torch.tensor([SEQ]),
            prefix_lens=torch.tensor([prefix_len]),
            extend_lens=torch.tensor([SEQ - prefix_len]),
        )

    natural = batch(list(range(SEQ)), 8)
    permuted = batch(order, prefix)
    return natural, permuted, torch.tensor(order), queries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_permuted_row_attends_exactly_as_in_position_order(dtype):
    natural, permuted, order, queries = _natural_and_permuted(dtype)
    expected = _native(natural, {})[torch.tensor(queries) - 8]
    got = _native(permuted, {0: order})
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])
    # Negative control: SGLang's mask (row index = position) sees the wrong keys.
    wrong = run_backend(permuted, 0.3, True, None)
    assert not torch.allclose(wrong, expected, rtol=1e-2, atol=1e-2)


def test_the_backend_hook_routes_only_forwards_with_rows(monkeypatch):
    """``forward_hooks.native_extend`` binds SGLang's arguments by name for the permuted
    loop, leaves a forward without rows to SGLang, and refuses rows of another batch."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from pcr_sglang.sglang_adapter import forward_hooks

    natural, permuted, order, queries = _natural_and_permuted(torch.float32)
    backend = object.__new__(TorchNativeAttnBackend)
    original = TorchNativeAttnBackend._run_sdpa_forward_extend

    def run():
        output = torch.full_like(permuted.query, float("nan"))
        forward_hooks.native_extend(
            original,
            backend,
            permuted.query,
            output,
            permuted.k_cache,
            permuted.v_cache,
            permuted.req_to_token,
            permuted.req_pool_indices,
            permuted.seq_lens,
            permuted.prefix_lens,
            permuted.extend_lens,
            scaling=0.3,
            enable_gqa=True,
            causal=True,
        )
        return output

    plans = _plans_with(backend, _bound({0: (1, order)}))  # request-pool row 1, as in the batch
    torch.testing.assert_close(run(), _native(natural, {})[torch.tensor(queries) - 8], **TOLERANCES[torch.float32])
    plans.current = None
    torch.testing.assert_close(run(), run_backend(permuted, 0.3, True, None), **TOLERANCES[torch.float32])
    plans.current = _bound({0: (2, order)})  # bound for another batch
    with pytest.raises(RuntimeError, match="not in this forward"):
        run()


def test_extend_inputs_are_the_tokens_of_the_slots_positions():
    fill = list(range(100, 100 + SEQ))  # token at position p: 100 + p
    prefix = ROW.end - 5
    plain = SimpleNamespace(rid="plain", get_fill_ids=lambda: list(range(7)))
    recompute = SimpleNamespace(rid="r", get_fill_ids=lambda: fill)
    ids = torch.zeros(3 + SEQ - prefix, dtype=torch.int64)
    ids[:3] = torch.tensor([4, 5, 6])
    batch = SimpleNamespace(
        reqs=[plain, recompute],
        prefix_lens=[4, prefix],
        extend_lens=[3, SEQ - prefix],
        prefill_input_ids_cpu=ids,
        input_ids=None,
    )
    rows = permute_extend_inputs(batch, {"r": ROW}.get)
    assert ids[:3].tolist() == [4, 5, 6]  # untouched
    assert ids[3:].tolist() == [100 + p for p in (8, 9, 10, 20, 21, *range(30, 40))]
    assert list(rows) == [1] and rows[1].tolist() == ROW.positions_of_slots(0, SEQ)
    # A later chunk past the permuted part is a plain extend: nothing to carry.
    later = SimpleNamespace(
        reqs=[recompute],
        prefix_lens=[ROW.end],
        extend_lens=[5],
        prefill_input_ids_cpu=torch.zeros(5, dtype=torch.int64),
        input_ids=None,
    )
    assert permute_extend_inputs(later, {"r": ROW}.get) is None


def test_positions_are_the_true_ones_and_are_published_for_the_forward():
    mode = SimpleNamespace(is_extend=lambda: True)
    prefix = ROW.end - 5
    forward = SimpleNamespace(
        positions=torch.arange(100, dtype=torch.int32)[: 3 + SEQ - prefix].clone(),
        forward_mode=mode,
        extend_prefix_lens_cpu=[4, prefix],
        extend_seq_lens_cpu=[3, SEQ - prefix],
    )
    forward.positions[:3] = torch.tensor([4, 5, 6], dtype=torch.int32)
    order = torch.tensor(ROW.positions_of_slots(0, SEQ))
    reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=7)), SimpleNamespace(kv=SimpleNamespace(req_pool_idx=3))]
    plans = ForwardPlans()
    batch = Batch(reqs=reqs)
    plans.prepared(batch, {1: order})
    plan = plans.bind(forward, batch)
    assert plans.current is plan
    assert forward.positions.tolist() == [4, 5, 6, 8, 9, 10, 20, 21, *range(30, 40)]
    assert forward.positions.dtype == torch.int32
    published = plan.for_attention(torch.tensor([7, 3]))
    assert list(published) == [1] and published[1].tolist() == order.tolist()
    with pytest.raises(RuntimeError, match="not in this forward"):
        plan.for_attention(torch.tensor([7, 4]))
    # The next forward without permuted rows (a decode, another batch) has no plan.
    plans.bind(forward, Batch(reqs=reqs))
    assert plans.current is None
    decode = SimpleNamespace(positions=forward.positions, forward_mode=SimpleNamespace(is_extend=lambda: False))
    assert plans.bind(decode, batch) is None and plans.current is None  # the same batch, now decoding
    plans.prepared(batch, None)  # prepared again without permuted rows: its plan is gone
    assert plans.bind(forward, batch) is None


def test_triton_mask_is_position_causal_per_request_in_row_order():
    order = torch.tensor([0, 1, 3, 2])  # row slot 2 holds position 3, slot 3 position 2
    mask, indptr = triton_position_mask({1: order}, seq_lens=[3, 4], prefix_lens=[1, 2], device=torch.device("cpu"))
    assert indptr.tolist() == [0, 2 * 3, 2 * 3 + 2 * 4]
    plain = mask[:6].reshape(2, 3).tolist()
    assert plain == [[True, True, False], [True, True, True]]  # bottom-right causal
    permuted = mask[6:].reshape(2, 4).tolist()
    assert permuted == [
        [True, True, True, True],  # the query at position 3 sees every position
        [True, True, False, True],
    ]  # the one at position 2 not position 3 (in slot 2)


def test_the_triton_hooks_set_the_mask_for_a_forward_with_rows_and_only_then(monkeypatch):
    """``forward_hooks.triton_metadata`` puts the position mask in the backend's forward
    metadata for a forward with a plan, and ``triton_extend_kernel`` then asks the kernel to
    mask the prefix too; a forward without rows keeps SGLang's metadata and kernel call."""
    from pcr_sglang.sglang_adapter import forward_hooks as plugin

    order = torch.tensor([0, 1, 3, 2])

    def init_forward_metadata(backend, forward_batch):
        backend.forward_metadata = SimpleNamespace(custom_mask=None, mask_indptr=None)

    def kernel(backend, *args, **kwargs):
        return kwargs

    mode = SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: False)
    forward = SimpleNamespace(
        forward_mode=mode,
        req_pool_indices_cpu=torch.tensor([5, 9]),
        seq_lens_cpu=torch.tensor([3, 4]),
        extend_prefix_lens_cpu=[1, 2],
        seq_lens=torch.tensor([3, 4]),
    )
    backend = SimpleNamespace()
    plans = _plans_with(backend, _bound({1: (9, order)}))
    plans.current.prefix_lens, plans.current.extend_lens = [1, 2], [2, 2]
    plugin.triton_metadata(init_forward_metadata, backend, forward)
    mask, indptr = triton_position_mask({1: order}, [3, 4], [1, 2], torch.device("cpu"))
    assert torch.equal(backend.forward_metadata.custom_mask, mask)
    assert torch.equal(backend.forward_metadata.mask_indptr, indptr)
    assert plugin.triton_extend_kernel(kernel, backend, "layer")["skip_prefix_custom_mask"] is False

    plans.current = None
    plugin.triton_metadata(init_forward_metadata, backend, forward)
    assert backend.forward_metadata.custom_mask is None
    assert "skip_prefix_custom_mask" not in plugin.triton_extend_kernel(kernel, backend, "layer")


def test_a_plan_is_bound_only_where_the_backends_find_it_and_only_to_its_own_requests():
    """The attention backends find the plan through the model runner's KV pool: a forward
    whose runner holds another pool is refused, never left to plain causal attention. And
    a batch whose request changed its request-pool row since the plan was made is refused,
    never given another request's positions."""
    from pcr_sglang.sglang_adapter import forward_hooks

    mode = SimpleNamespace(is_extend=lambda: True)
    prefix = ROW.end - 5
    order = torch.tensor(ROW.positions_of_slots(0, SEQ))
    reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=7)), SimpleNamespace(kv=SimpleNamespace(req_pool_idx=3))]

    def forward():
        return SimpleNamespace(
            positions=torch.zeros(3 + SEQ - prefix, dtype=torch.int32),
            forward_mode=mode,
            extend_prefix_lens_cpu=[4, prefix],
            extend_seq_lens_cpu=[3, SEQ - prefix],
        )

    pool = torch.nn.Module()
    plans = ForwardPlans().attach(pool)
    batch = Batch(reqs=reqs, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool))
    plans.prepared(batch, {1: order})
    forward_hooks.bind_forward_plan(forward(), None, batch, SimpleNamespace(token_to_kv_pool=pool))
    assert plans.current is not None and list(plans.current.bound) == [1]
    with pytest.raises(RuntimeError, match="not the one the batch's plan was made for"):
        forward_hooks.bind_forward_plan(forward(), None, batch, SimpleNamespace(token_to_kv_pool=torch.nn.Module()))
    assert plans.current is None

    reqs[1].kv.req_pool_idx = 9  # the request moved rows after its plan was made
    with pytest.raises(RuntimeError, match="planned with row 3"):
        plans.bind(forward(), batch)
