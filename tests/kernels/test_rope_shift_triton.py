"""The Triton RoPE-shift kernel against the torch path. Runs under TRITON_INTERPRET=1 on
CPU (scripts/test.sh sets it for this folder) and natively on a CUDA machine.

The two paths form the angle and its cos/sin in float64 and rotate in float32, so they
agree to float32 rounding; the rotated dims are checked to one ulp of the pool's dtype
(two for float32), counted at each head row's largest element.
Measured under the interpreter: float32 and float16 bit-identical, bfloat16 within one
ulp, because the interpreter's float32 -> bfloat16 cast truncates (its ``cast_impl``
passes no rounding mode) where torch and a compiled kernel round to nearest even; on a
GPU a fused multiply-add may also move a float32 last bit. Pass-through dims, V and
every row outside the destinations are compared bit for bit."""

from __future__ import annotations

import math
import os

import pytest
import torch

from pcr_sglang.transfer import rope_shift
from pcr_sglang.transfer.rope_shift import RopeSpec, replace_layer

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
pytest.importorskip("triton")
DEVICE = "cpu" if INTERPRET else "cuda"
# The delta-0 row holds an inf; numpy (the interpreter) warns about the inf * 0 of the
# rotation the kernel then discards.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

POOL, TOKENS, HEADS = 37, 6, 3  # odd sizes: masked heads, slots scattered over the pool


def _spec(head_dim: int, rotary_dim: int, neox: bool, base: float = 10000.0) -> RopeSpec:
    return RopeSpec(head_dim, rotary_dim, neox, tuple(base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)))


def _case(dtype, head_dim, v_head_dim, seed, pad=0):
    """A pool (optionally a view with padded head and token strides), scattered unsorted
    source and destination slots, and deltas of both signs up to 1e5 (the first 0, on a
    row holding an inf)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL, HEADS, head_dim + pad, generator=g).to(dtype)[..., :head_dim]
    v = torch.randn(POOL, HEADS, v_head_dim + pad, generator=g).to(dtype)[..., :v_head_dim]
    slots = torch.randperm(POOL, generator=g)
    src, dst = slots[:TOKENS], slots[TOKENS : 2 * TOKENS]
    deltas = torch.randint(-100_000, 100_000, (TOKENS,), generator=g)
    deltas[0] = 0
    k[src[0], 0, 0] = float("inf")  # delta 0 must keep it (a rotation by 0 would make a nan)
    return k, v, src, dst, deltas


_MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _run_both(spec, k, v, src, dst, deltas):
    want_k, want_v = k.clone(), v.clone()
    replace_layer(want_k, want_v, src, dst, deltas, spec, use_triton=False)
    got_k, got_v = k.to(DEVICE), v.to(DEVICE)
    replace_layer(got_k, got_v, src.to(DEVICE), dst.to(DEVICE), deltas.to(DEVICE), spec, use_triton=True)
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return got_k.cpu(), got_v.cpu(), want_k, want_v


def _check(spec, k, v, src, dst, deltas):
    got_k, got_v, want_k, want_v = _run_both(spec, k, v, src, dst, deltas)
    assert torch.equal(got_v, want_v)  # V, and every row outside dst, bit for bit
    rot = spec.rotary_dim
    assert torch.equal(got_k[..., rot:], want_k[..., rot:])
    keep = torch.ones(POOL, dtype=torch.bool)
    keep[dst] = False
    assert torch.equal(got_k[keep], want_k[keep])
    assert torch.equal(got_k[dst[0]], k[src[0]])  # delta 0: the source row's bits
    # The rotated dims of the moved rows: within one ulp (float32: two) of each head row's
    # largest element. Relative to the row, not the element: where x1*cos and x2*sin
    # nearly cancel, a fused multiply-add changes many ulps of the tiny result.
    a, b = got_k[dst[1:]][..., :rot].double(), want_k[dst[1:]][..., :rot].double()
    row_max = b.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(k.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(row_max)) - _MANTISSA[k.dtype])
    assert float(((a - b).abs() / ulp).max()) <= (2.0 if k.dtype == torch.float32 else 1.0)
    assert not torch.equal(got_k[dst[1:]], k[src[1:]])  # and it did rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rotary_dim,v_head_dim", [(32, 32, 32), (32, 16, 24)], ids=["full", "partial-v24"])
def test_triton_matches_torch(dtype, neox, head_dim, rotary_dim, v_head_dim):
    spec = _spec(head_dim, rotary_dim, neox)
    _check(spec, *_case(dtype, head_dim, v_head_dim, seed=head_dim + rotary_dim + int(neox)))


def test_strided_views_and_several_head_blocks(monkeypatch):
    """Buffers that are views with padded strides, int32 slot lists, and a head block
    smaller than the number of heads (two programs per token along heads)."""
    monkeypatch.setattr(rope_shift, "_MAX_BLOCK_ELEMS", 64)
    spec = _spec(24, 12, False, base=500000.0)
    k, v, src, dst, deltas = _case(torch.bfloat16, 24, 20, seed=5, pad=8)
    assert not k.is_contiguous()
    _check(spec, k, v, src.int(), dst.int(), deltas)


def test_empty_lists_launch_nothing():
    spec = _spec(16, 16, True)
    k, v, _, _, _ = _case(torch.float16, 16, 16, seed=0)
    k, v = k.to(DEVICE), v.to(DEVICE)
    before = k.clone(), v.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    replace_layer(k, v, empty, empty, empty, spec, use_triton=True)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_angles_are_formed_in_float64():
    """At delta 1e5 a float32 angle is off by ~4e-3 rad; the kernel's is not."""
    spec = _spec(16, 16, True)
    k = torch.zeros(2, 1, 16)
    k[0, 0, 0] = 1.0  # pair 0 (inv_freq 1): the rotated row is (cos d, ..., sin d, ...)
    v = torch.zeros(2, 1, 16)
    got_k, _, _, _ = _run_both(spec, k, v, torch.tensor([0]), torch.tensor([1]), torch.tensor([100_003]))
    assert abs(float(got_k[1, 0, 0]) - math.cos(100_003)) < 1e-7
    assert abs(float(got_k[1, 0, 8]) - math.sin(100_003)) < 1e-7
