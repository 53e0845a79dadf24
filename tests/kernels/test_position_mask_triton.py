"""SGLang's Triton extend attention kernel with the recompute modes' position-causal mask
(``permuted_rows.triton_position_mask``, ``skip_prefix_custom_mask=False``) against the
torch_native path (``position_causal_sdpa_extend``), on a batch mixing a permuted row with
plain ones. Runs under TRITON_INTERPRET=1 on CPU (scripts/test.sh sets it for this folder)
and natively on a CUDA machine.

The negative control runs the same kernel with its default ``skip_prefix_custom_mask=True``
(the prefix unmasked, as every other SGLang extend): the permuted row's outputs must then
differ, so the comparison can tell that the prefix part of the mask is applied.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
pytest.importorskip("triton")
# The kernel under test is SGLang's: a machine without SGLang (the GPU check's) skips it.
pytest.importorskip(
    "sglang.kernels.ops.attention.extend_attention", reason="SGLang's Triton extend attention kernel is not installed"
)
DEVICE = "cpu" if INTERPRET else "cuda"

from pcr_sglang.reuse.plan import RowOrder  # noqa: E402
from pcr_sglang.reuse.rows import position_causal_sdpa_extend, triton_position_mask  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 16
# (prefix, extend) per request, and request 1's permuted row. SMALL: slots 5..24 hold the
# kept positions, then the recomputed ones (5, 6, 14, 15) are the extend's first four tokens.
SMALL = (
    [(3, 5), (21, 9), (0, 6)],
    RowOrder(5, tuple([p for p in range(5, 25) if p not in (5, 6, 14, 15)] + [5, 6, 14, 15])),
)
# Several key and query tiles: a prefix past 128 keys and an extend past 64 queries, the
# permuted part spanning tile edges (recomputed positions 40..47 and 150..181 moved last).
_RECOMPUTED = [*range(40, 48), *range(150, 182)]
LARGE = (
    [(70, 10), (190, 72), (0, 9)],
    RowOrder(20, tuple([p for p in range(20, 222) if p not in _RECOMPUTED] + _RECOMPUTED)),
)


def _kernel(
    q, k_ext, v_ext, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, mask, mask_indptr, max_extend, skip_prefix_mask
):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    out = torch.empty_like(q)
    extend_attention_fwd(
        q,
        k_ext,
        v_ext,
        out,
        k_pool,
        v_pool,
        qo_indptr,
        kv_indptr,
        kv_indices,
        mask,
        True,
        mask_indptr,
        max_extend,
        1.0,
        1.0,
        sm_scale=DIM**-0.5,
        skip_prefix_custom_mask=skip_prefix_mask,
    )
    return out


@pytest.mark.parametrize("LENGTHS, ROW", [SMALL, LARGE], ids=["one-tile", "several-tiles"])
def test_triton_extend_with_the_position_mask_equals_the_torch_path(LENGTHS, ROW):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [p + e for p, e in LENGTHS]
    slots = torch.randperm(sum(seq_lens) + 5, generator=gen)
    k_pool = torch.randn(len(slots) + 5, KV_HEADS, DIM, generator=gen)
    v_pool = torch.randn(len(slots) + 5, KV_HEADS, DIM, generator=gen)
    req_to_token = torch.zeros((len(LENGTHS), max(seq_lens)), dtype=torch.int64)
    start = 0
    for i, n in enumerate(seq_lens):
        req_to_token[i, :n] = slots[start : start + n]
        start += n
    total = sum(e for _, e in LENGTHS)
    q = torch.randn(total, HEADS, DIM, generator=gen)
    rows = {1: torch.tensor(ROW.positions_of_slots(0, seq_lens[1]))}

    expected = position_causal_sdpa_extend(
        rows,
        q,
        torch.empty_like(q),
        k_pool,
        v_pool,
        req_to_token,
        torch.arange(len(LENGTHS)),
        torch.tensor(seq_lens),
        torch.tensor([p for p, _ in LENGTHS]),
        torch.tensor([e for _, e in LENGTHS]),
        DIM**-0.5,
        True,
    )

    # The Triton call: prefix KV by index from the pool, the extend's own K/V passed in.
    kv_indices = torch.cat([req_to_token[i, :p] for i, (p, _) in enumerate(LENGTHS)])
    ext_slots = torch.cat([req_to_token[i, p : p + e] for i, (p, e) in enumerate(LENGTHS)])
    kv_indptr = torch.tensor([0] + [p for p, _ in LENGTHS]).cumsum(0)
    qo_indptr = torch.tensor([0] + [e for _, e in LENGTHS]).cumsum(0)
    mask, mask_indptr = triton_position_mask(rows, seq_lens, [p for p, _ in LENGTHS], torch.device("cpu"))
    args = [
        t.to(DEVICE)
        for t in (
            q,
            k_pool[ext_slots],
            v_pool[ext_slots],
            k_pool,
            v_pool,
            qo_indptr.to(torch.int32),
            kv_indptr.to(torch.int32),
            kv_indices,
            mask,
            mask_indptr,
        )
    ]
    max_extend = max(e for _, e in LENGTHS)
    got = _kernel(*args, max_extend, skip_prefix_mask=False).cpu()
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)

    unmasked_prefix = _kernel(*args, max_extend, skip_prefix_mask=True).cpu()
    permuted = slice(LENGTHS[0][1], LENGTHS[0][1] + LENGTHS[1][1])
    assert not torch.allclose(unmasked_prefix[permuted], expected[permuted], rtol=1e-3, atol=1e-3)
