"""SGLang's torch_native extend attention with our patch 03 (extend rows only) against the
padded computation it replaces, on random inputs.

The reference below is written here, not copied: for each request it builds the whole
square query (random rows for the cached prefix, the real extend rows after them), runs
SDPA with ``is_causal`` (or an explicit window mask) over the sequence's keys, and keeps
rows ``prefix_len:``. Patch 03 must give the same extend rows while computing only those.

Tolerances: in float32 the two computations differ only in how SDPA's CPU kernel blocks
its reductions (the patched path runs a different query length and an explicit mask), a
few float32 ulps, so ``rtol = atol = 1e-6`` (about 8 ulps at 1.0; outputs are averages of
unit-normal values, |x| < 4). In bfloat16 both accumulate in float32 and round once to
bfloat16; a float32 difference at a rounding boundary flips the last bit, one bfloat16
ulp, at most 2^-7 of the value: ``rtol = 2^-7`` admits exactly that, ``atol = 1e-5`` only
covers values near zero. (assert_close's bfloat16 default is rtol 1.6e-2.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from sglang.srt.layers.attention import torch_native_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention

PADDED_ENV = "SGLANG_TORCH_NATIVE_PADDED_EXTEND"
TOLERANCES = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}
# (prefix_len, extend_len) per request of one batch: no prefix (extend == seq), a single
# extend token after a long prefix, short and long extends after prefixes of several sizes.
BATCH = [(0, 23), (70, 1), (17, 9), (64, 64), (5, 1), (0, 1), (130, 40)]
HEAD_DIM = 16


@dataclass
class ExtendBatch:
    """One extend batch the way SGLang hands it to the backend: a token-slot KV cache,
    the request-to-slot table, and per-request lengths."""

    query: torch.Tensor  # [sum(extend), num_heads, head_dim]
    k_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # [max_reqs, max_context]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor


def make_batch(
    lengths: list[tuple[int, int]], num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int = 0
) -> ExtendBatch:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in lengths]
    num_slots = sum(seq_lens) + 11
    max_context = max(seq_lens) + 5
    # Scattered slots and request rows, as after a server has run a while.
    slots = torch.randperm(num_slots, generator=gen)
    rows = torch.randperm(len(lengths) + 3, generator=gen)[: len(lengths)]
    req_to_token = torch.zeros((len(lengths) + 3, max_context), dtype=torch.int64)
    start = 0
    for row, seq_len in zip(rows.tolist(), seq_lens):
        req_to_token[row, :seq_len] = slots[start : start + seq_len]
        start += seq_len
    total_extend = sum(e for _, e in lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return ExtendBatch(
        query=randn(total_extend, num_heads, HEAD_DIM),
        k_cache=randn(num_slots, num_kv_heads, HEAD_DIM),
        v_cache=randn(num_slots, num_kv_heads, HEAD_DIM),
        req_to_token=req_to_token,
        req_pool_indices=rows,
        seq_lens=torch.tensor(seq_lens),
        prefix_lens=torch.tensor([p for p, _ in lengths]),
        extend_lens=torch.tensor([e for _, e in lengths]),
    )


def reference_padded(b: ExtendBatch, scaling: float, causal: bool, window: Optional[int]) -> torch.Tensor:
    """Every row of each request's square computed, the prefix rows dropped."""
    num_heads, num_kv_heads = b.query.shape[1], b.k_cache.shape[1]
    gen = torch.Generator().manual_seed(99)
    out, start = [], 0
    for i in range(len(b.seq_lens)):
        prefix, extend, seq = int(b.prefix_lens[i]), int(b.extend_lens[i]), int(b.seq_lens[i])
        slots = b.req_to_token[b.req_pool_indices[i], :seq]
        # Whatever the cached rows' queries were, they must not matter: random ones here.
        cached_rows = torch.randn(prefix, num_heads, HEAD_DIM, generator=gen).to(b.query.dtype)
        q = torch.cat([cached_rows, b.query[start : start + extend]]).transpose(0, 1)
        k = b.k_cache[slots].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = b.v_cache[slots].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
        # A batch dimension of 1, as SGLang passes: SDPA picks its CPU flash kernel only
        # for 4-D inputs (3-D ones take the math path, which rounds bfloat16 differently).
        q, k, v = q[None], k[None], v[None]
        if window is None:
            o = scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling)
        else:
            pos = torch.arange(seq)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - window)
            o = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        out.append(o[0].transpose(0, 1)[prefix:])
        start += extend
    return torch.cat(out)


def run_backend(b: ExtendBatch, scaling: float, causal: bool, window: Optional[int]) -> torch.Tensor:
    """The installed (patched) backend's extend forward on the batch."""
    backend = object.__new__(TorchNativeAttnBackend)  # the method needs no model runner
    output = torch.full_like(b.query, float("nan"))
    backend._run_sdpa_forward_extend(
        b.query,
        output,
        b.k_cache,
        b.v_cache,
        b.req_to_token,
        b.req_pool_indices,
        b.seq_lens,
        b.prefix_lens,
        b.extend_lens,
        scaling=scaling,
        enable_gqa=b.query.shape[1] != b.k_cache.shape[1],
        causal=causal,
        sliding_window_size=window,
    )
    return output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize(
    "causal,window", [(True, None), (True, 8), (False, None)], ids=["causal", "sliding-window", "non-causal"]
)
def test_extend_rows_equal_padded_reference(monkeypatch, dtype, num_heads, num_kv_heads, causal, window):
    monkeypatch.delenv(PADDED_ENV, raising=False)
    b = make_batch(BATCH, num_heads, num_kv_heads, dtype)
    expected = reference_padded(b, scaling=0.3, causal=causal, window=window)
    torch.testing.assert_close(run_backend(b, 0.3, causal, window), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_escape_hatch_equals_reference(monkeypatch, dtype):
    """SGLANG_TORCH_NATIVE_PADDED_EXTEND=1, the servers' comparison baseline, is the
    original computation."""
    monkeypatch.setenv(PADDED_ENV, "1")
    b = make_batch(BATCH, 6, 2, dtype, seed=1)
    expected = reference_padded(b, scaling=0.25, causal=True, window=None)
    torch.testing.assert_close(run_backend(b, 0.25, True, None), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("padded", [False, True])
def test_only_extend_rows_are_computed(monkeypatch, padded):
    """The point of the patch: SDPA sees extend_len query rows per request (seq_len with
    the escape hatch), so a fully cached prompt costs one row, not the whole square."""
    if padded:
        monkeypatch.setenv(PADDED_ENV, "1")
    else:
        monkeypatch.delenv(PADDED_ENV, raising=False)
    rows = []

    def recording_sdpa(query, key, value, **kwargs):
        rows.append(query.shape[-2])
        return scaled_dot_product_attention(query, key, value, **kwargs)

    monkeypatch.setattr(torch_native_backend, "scaled_dot_product_attention", recording_sdpa)
    run_backend(make_batch(BATCH, 6, 2, torch.float32), 0.3, True, None)
    assert rows == [p + e if padded else e for p, e in BATCH]
