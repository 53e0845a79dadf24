"""The RoPE position shift against SGLang's own rotary modules, on CPU.

For each allowed variant the REAL SGLang module (``get_rope``) rotates random q, k at
positions ``p`` with its ``forward_native``; :func:`replace_layer` then moves K by ``d``
inside a small pool, and the result is compared with the module applied at ``p + d``.

Two references, because SGLang's own table is not exact: its ``cos_sin_cache`` forms
``t * inv_freq`` in float32, so at position ~1e5 the angle is off by up to half an ulp of
1e5 (~4e-3 rad), and the module's K at ``p + d`` is itself up to ~3e-3 (max-normalised) away
from exact RoPE there. So besides "the module as it is", each variant also uses *the same
module* with its table replaced by the float64-accurate ``mscale * cos/sin(t * inv_freq)``;
``test_spec_reproduces_sglang_table`` first checks that table against the module's own,
row for row within float32 angle rounding, so the reference is the module's math.
Measured (seeded, n=64 tokens x 2 heads, p < 2048, d in [-p, 1e5]), every variant:

* float32: an exactly rotated K, moved by d, against the exact module at p + d:
  0.98e-7 .. 1.2e-7 (max |error| / max |K|); the module's own K at p, moved, against exact
  RoPE at p + d: 7e-6 .. 2.9e-5 (that is the module's rounding at p); against the
  module's own table at p + d: 3.5e-4 .. 3.1e-3, equal to that table's own error there.
* bfloat16 (on CPU the module casts its table to bf16 and rotates in bf16): against the
  module at p + d, 2.0 ulps of each head row's largest element (6.5e-3 .. 8.1e-3
  max-normalised; the module itself is 1.2 .. 1.6 ulps from exact there); an exactly
  rotated K rounded to bf16, moved, against exact RoPE at p + d: 0.92 .. 1.31 ulps (one
  rounding in, a rotation mixing two rounded inputs, one rounding out).

The tolerances fail when the shift uses the mscaled table (YaRN, DeepSeek: x1.139), the
other pairing, or linear scaling unfolded (``test_pairing_matters``,
``test_shifting_with_the_mscaled_table_would_be_caught``,
``test_spec_reproduces_sglang_table``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.rotary_embedding.base import LinearScalingRotaryEmbedding, RotaryEmbedding
from sglang.srt.layers.rotary_embedding.mrope import MRotaryEmbedding, YaRNScalingMRotaryEmbedding
from sglang.srt.layers.rotary_embedding.rope_variant import (
    DynamicNTKAlphaRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    Gemma4RotaryEmbedding,
    Phi3LongRoPEScaledRotaryEmbedding,
)
from sglang.srt.layers.rotary_embedding.yarn import YaRNScalingRotaryEmbedding

from pcr_sglang.reuse.model_rope import UnsupportedRope, model_rope_spec, rope_spec_of
from pcr_sglang.transfer.rope_shift import RopeSpec, check_slots, replace_layer, shift_keys_torch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
DEEPSEEK = {
    "rope_type": "deepseek_yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32768,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
}
# get_rope arguments; every table covers p + d < 110_000.
VARIANTS = {
    "default-1e4": dict(head_size=64, rotary_dim=64, max_position=110_000, base=10000),
    "default-5e5": dict(head_size=64, rotary_dim=64, max_position=110_000, base=500000),
    "linear-4": dict(
        head_size=64, rotary_dim=64, max_position=32768, base=10000, rope_scaling={"rope_type": "linear", "factor": 4.0}
    ),
    "llama3.1": dict(head_size=64, rotary_dim=64, max_position=131072, base=500000, rope_scaling=LLAMA31),
    "yarn-4": dict(head_size=64, rotary_dim=64, max_position=131072, base=10000, rope_scaling=YARN),
    "partial-half": dict(head_size=64, rotary_dim=64, max_position=110_000, base=10000, partial_rotary_factor=0.5),
    "gptj": dict(head_size=64, rotary_dim=64, max_position=110_000, base=10000, is_neox_style=False),
    "deepseek-yarn-gptj": dict(
        head_size=64, rotary_dim=64, max_position=131072, base=10000, is_neox_style=False, rope_scaling=DEEPSEEK
    ),
}
N, HEADS, POOL = 64, 2, 160
MAX_P, MAX_D = 2048, 100_000


def _rope(name: str, dtype: torch.dtype):
    return get_rope(dtype=dtype, **VARIANTS[name])


def _exact_table(spec: RopeSpec, mscale: float, rows: int) -> torch.Tensor:
    """``mscale * [cos, sin](t * inv_freq)`` in float64: the module's table without its
    float32 rounding of the angle."""
    t = torch.arange(rows, dtype=torch.float64)[:, None]
    angle = t * torch.tensor(spec.inv_freq, dtype=torch.float64)[None, :]
    return torch.cat((angle.cos(), angle.sin()), dim=-1) * mscale


def _mscale(rope) -> float:
    return float(getattr(rope, "mscale", 1.0))


def _exact_module(rope, spec: RopeSpec):
    """A copy of the real module whose table is exact (the shared get_rope instance is
    left alone)."""
    exact = copy.deepcopy(rope)
    exact.cos_sin_cache = _exact_table(spec, _mscale(rope), rope.cos_sin_cache.shape[0]).float()
    return exact


def _keys_at(rope, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    q = torch.zeros(k.shape[0], 1, k.shape[-1], dtype=k.dtype)
    _, out = rope.forward_native(positions, q, k.clone())
    return out.reshape(k.shape)


def _case(seed: int = 0, max_p: int = MAX_P, max_d: int = MAX_D):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, max_p, (N,), generator=g)
    d = torch.randint(-max_p, max_d, (N,), generator=g)
    d[:3] = torch.tensor([0, -1, max_d])
    d = torch.maximum(d, -p)  # p + d >= 0: negative deltas move a token earlier
    slots = torch.randperm(POOL, generator=g)
    return g, p, d, slots[:N], slots[N : 2 * N]


def _shift_in_pool(k_at_p: torch.Tensor, d: torch.Tensor, spec: RopeSpec, src, dst, g, v_head_dim: int = 48):
    """Put ``k_at_p`` in a random pool at ``src`` and re-place it at ``dst``; return the
    pool's K at dst, its V at dst and its V at src."""
    k_pool = torch.randn(POOL, HEADS, spec.head_dim, generator=g).to(k_at_p.dtype)
    v_pool = torch.randn(POOL, HEADS, v_head_dim, generator=g).to(k_at_p.dtype)
    k_pool[src] = k_at_p
    replace_layer(k_pool, v_pool, src, dst, d, spec)
    return k_pool[dst], v_pool[dst], v_pool[src]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def _bf16_ulps(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error of a head row, in bf16 ulps of that row's largest element."""
    a, ref = a.double(), ref.double()
    row_max = ref.abs().amax(dim=-1).clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(row_max)) - 7)
    return float(((a - ref).abs().amax(dim=-1) / ulp).max())


@pytest.mark.parametrize("name", VARIANTS)
def test_spec_reproduces_sglang_table(name):
    """The spec's frequencies rebuild the module's whole float32 table, row for row,
    within float32 rounding of ``t * inv_freq`` (fails for a linear factor not folded in,
    a wrong frequency or a wrong mscale)."""
    rope = _rope(name, torch.float32)
    spec = rope_spec_of(rope)
    assert spec.rotary_dim == rope.rotary_dim and spec.head_dim == rope.head_size
    table = rope.cos_sin_cache.double()
    exact = _exact_table(spec, _mscale(rope), table.shape[0])
    t = torch.arange(table.shape[0], dtype=torch.float64)[:, None]
    bound = _mscale(rope) * (4 * 2.0**-24 * t * max(spec.inv_freq) + 4e-7)
    assert bool(((table - exact).abs() <= bound).all())
    assert abs(float(table[0, 0]) - _mscale(rope)) < 1e-6  # the table carries mscale


@pytest.mark.parametrize("name", VARIANTS)
def test_fp32_shift_matches_the_module_at_the_new_position(name):
    rope = _rope(name, torch.float32)
    spec = rope_spec_of(rope)
    exact = _exact_module(rope, spec)
    g, p, d, src, dst = _case()
    k = torch.randn(N, HEADS, spec.head_dim, generator=g)

    # Our own error: an exactly rotated K moved by d against the exact module at p + d.
    moved, _, _ = _shift_in_pool(_keys_at(exact, p, k), d, spec, src, dst, g)
    assert _rel(moved, _keys_at(exact, p + d, k)) < 1e-6

    # What reuse delivers: the module's K at p, moved, against exact RoPE at p + d ...
    moved, v_dst, v_src = _shift_in_pool(_keys_at(rope, p, k), d, spec, src, dst, g)
    assert torch.equal(v_dst, v_src)
    assert _rel(moved, _keys_at(exact, p + d, k)) < 1e-4
    # ... and against the module's own table at p + d, whose float32 angle is off by up
    # to half an ulp of (p + d) * inv_freq: the bound is that table's error.
    ulp_angle = 2.0 ** (math.floor(math.log2(MAX_P + MAX_D)) - 23) * max(spec.inv_freq)
    assert _rel(moved, _keys_at(rope, p + d, k)) < ulp_angle


@pytest.mark.parametrize("name", VARIANTS)
def test_bf16_shift_matches_the_module_at_the_new_position(name):
    rope = _rope(name, torch.bfloat16)  # on CPU: its table in bf16, the rotation in bf16
    spec = rope_spec_of(rope)
    g, p, d, src, dst = _case(seed=1)
    k = torch.randn(N, HEADS, spec.head_dim, generator=g).to(torch.bfloat16)

    moved, _, _ = _shift_in_pool(_keys_at(rope, p, k), d, spec, src, dst, g)
    assert moved.dtype == torch.bfloat16
    assert _bf16_ulps(moved, _keys_at(rope, p + d, k)) <= 3.0

    # An exactly rotated K rounded to bf16 (as a fp32-table kernel stores it), moved:
    exact = _exact_module(_rope(name, torch.float32), spec)
    at_p = _keys_at(exact, p, k.float()).to(torch.bfloat16)
    want = _keys_at(exact, p + d, k.float())
    moved, _, _ = _shift_in_pool(at_p, d, spec, src, dst, g)
    assert _bf16_ulps(moved, want) <= 2.0


def test_v_is_copied_exactly_and_nothing_else_is_touched():
    spec = rope_spec_of(_rope("yarn-4", torch.float32))
    g, p, d, src, dst = _case()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k_pool = torch.randn(POOL, HEADS, spec.head_dim, generator=g).to(dtype)
        v_pool = torch.randn(POOL, HEADS, 48, generator=g).to(dtype)
        k0, v0 = k_pool.clone(), v_pool.clone()
        replace_layer(k_pool, v_pool, src, dst, d, spec)
        assert torch.equal(v_pool[dst], v0[src])
        others = torch.ones(POOL, dtype=torch.bool)
        others[dst] = False
        assert torch.equal(k_pool[others], k0[others]) and torch.equal(v_pool[others], v0[others])


def test_pass_through_dims_are_exact():
    rope = _rope("partial-half", torch.float32)
    spec = rope_spec_of(rope)
    assert (spec.head_dim, spec.rotary_dim) == (64, 32)
    g, p, d, src, dst = _case()
    for dtype in (torch.float32, torch.bfloat16):
        k_pool = torch.randn(POOL, HEADS, 64, generator=g).to(dtype)
        v_pool = torch.randn(POOL, HEADS, 64, generator=g).to(dtype)
        k0 = k_pool.clone()
        replace_layer(k_pool, v_pool, src, dst, d, spec)
        assert torch.equal(k_pool[dst][..., 32:], k0[src][..., 32:])
        assert not torch.equal(k_pool[dst][..., :32], k0[src][..., :32])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_zero_delta_is_bit_identical():
    spec = rope_spec_of(_rope("gptj", torch.float32))
    g, _, _, src, dst = _case()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k_pool = torch.randn(POOL, HEADS, 64, generator=g).to(dtype)
        k_pool[src[0], 0, :4] = torch.tensor([-0.0, float("inf"), float("nan"), -0.0]).to(dtype)
        v_pool = torch.randn(POOL, HEADS, 64, generator=g).to(dtype)
        k0 = k_pool.clone()
        replace_layer(k_pool, v_pool, src, dst, torch.zeros(N, dtype=torch.int64), spec)
        assert torch.equal(_bits(k_pool[dst]), _bits(k0[src]))


def test_negative_deltas_undo_positive_ones():
    spec = rope_spec_of(_rope("llama3.1", torch.float32))
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(N, HEADS, 64, generator=g)
    d = torch.randint(-MAX_D, MAX_D, (N,), generator=g)
    back = shift_keys_torch(shift_keys_torch(keys, d, spec), -d, spec)
    assert _rel(back, keys) < 1e-6
    # R(a) R(b) = R(a + b): two moves equal one, whatever the signs.
    a = torch.randint(-MAX_D, MAX_D, (N,), generator=g)
    twice = shift_keys_torch(shift_keys_torch(keys, a, spec), d, spec)
    assert _rel(twice, shift_keys_torch(keys, a + d, spec)) < 1e-6


def test_pairing_matters():
    """The NeoX and GPT-J pairings give different keys: a shift with the wrong one is far
    off (so the per-variant tolerances above would catch it)."""
    rope = _rope("gptj", torch.float32)
    spec = rope_spec_of(rope)
    assert not spec.is_neox_style
    wrong = RopeSpec(spec.head_dim, spec.rotary_dim, True, spec.inv_freq)
    g, p, d, _, _ = _case()
    k = torch.randn(N, HEADS, 64, generator=g)
    want = _keys_at(_exact_module(rope, spec), p + d, k)
    assert _rel(shift_keys_torch(_keys_at(rope, p, k), d, wrong), want) > 0.1


def test_shifting_with_the_mscaled_table_would_be_caught():
    """YaRN's table is cos/sin * mscale; a K rotated with it (instead of the pure
    frequencies) is mscale too large, far beyond the fp32 tolerance."""
    rope = _rope("yarn-4", torch.float32)
    spec = rope_spec_of(rope)
    assert _mscale(rope) > 1.1
    g, p, d, _, _ = _case()
    k = torch.randn(N, HEADS, 64, generator=g)
    table = rope.cos_sin_cache[d.abs()].double()
    cos, sin = table.chunk(2, dim=-1)
    sin = sin * d.sign()[:, None]
    x = _keys_at(rope, p, k).double()
    x1, x2 = x[..., :32], x[..., 32:]
    cos, sin = cos[:, None], sin[:, None]
    via_table = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    want = _keys_at(_exact_module(rope, spec), p + d, k)
    assert _rel(via_table, want) > 0.1
    assert _rel(shift_keys_torch(_keys_at(rope, p, k), d, spec), want) < 1e-4


# ---- refusals ---------------------------------------------------------------------------


def test_dynamic_ntk_is_refused():
    for rope in (
        DynamicNTKScalingRotaryEmbedding(16, 16, 64, 10000, True, 2.0, torch.float32),
        DynamicNTKAlphaRotaryEmbedding(16, 16, 64, 10000, True, 2.0, torch.float32),
    ):
        with pytest.raises(UnsupportedRope, match=f"dynamic NTK.*{type(rope).__name__}"):
            rope_spec_of(rope)


def test_mrope_is_refused():
    for rope in (
        MRotaryEmbedding(16, 16, 64, 10000, True, torch.float32, mrope_section=[2, 3, 3]),
        YaRNScalingMRotaryEmbedding(16, 16, 64, 10000, True, 2.0, torch.float32, mrope_section=[2, 3, 3]),
    ):
        with pytest.raises(UnsupportedRope, match=f"multimodal RoPE.*{type(rope).__name__}"):
            rope_spec_of(rope)

    class VendorMRotaryEmbedding(torch.nn.Module):  # unknown, but named mRoPE
        pass

    with pytest.raises(UnsupportedRope, match="multimodal RoPE.*VendorMRotaryEmbedding"):
        rope_spec_of(VendorMRotaryEmbedding())


def test_classes_off_the_allow_list_are_refused():
    class MyRotaryEmbedding(RotaryEmbedding):  # a subclass may change the angle math
        pass

    refused = [
        MyRotaryEmbedding(16, 16, 64, 10000, True, torch.float32),
        Gemma4RotaryEmbedding(32, 16, 64, 10000, True, torch.float32),
        Phi3LongRoPEScaledRotaryEmbedding(16, 16, 128, 64, 10000, True, torch.float32, [1.0] * 8, [2.0] * 8),
    ]
    for rope in refused:
        with pytest.raises(UnsupportedRope, match=f"{type(rope).__name__} is not supported"):
            rope_spec_of(rope)
    with pytest.raises(UnsupportedRope, match="several scaling factors"):
        rope_spec_of(LinearScalingRotaryEmbedding(16, 16, 64, 10000, True, [1.0, 4.0], torch.float32))


def test_a_table_that_is_not_position_times_frequency_is_refused():
    rope = copy.deepcopy(_rope("default-1e4", torch.float32))
    rope_spec_of(rope)
    rope.cos_sin_cache = rope.cos_sin_cache * 1.01  # an unannounced mscale
    with pytest.raises(UnsupportedRope, match="not mscale x cos/sin"):
        rope_spec_of(rope)


def test_grown_tables_are_checked_and_linear_growth_is_skipped():
    """SGLang grows every table at load time. YaRN's growth follows its formula and its
    last row is checked; the linear class inherits a growth without ``/ factor``, whose
    rows (beyond the context length) are not held against it."""
    yarn = YaRNScalingRotaryEmbedding(16, 16, 64, 10000, True, 2.0, torch.float32)
    yarn._ensure_cos_sin_cache_length(1000)
    assert yarn.cos_sin_cache.shape[0] > 1000
    rope_spec_of(yarn)
    yarn.cos_sin_cache[-1] *= 1.5
    with pytest.raises(UnsupportedRope, match="at position"):
        rope_spec_of(yarn)

    linear = LinearScalingRotaryEmbedding(16, 16, 64, 10000, True, 4.0, torch.float32)
    spec = rope_spec_of(linear)
    linear._ensure_cos_sin_cache_length(1000)
    assert rope_spec_of(linear) == spec
    row = 300  # a grown row: SGLang's angle is t * inv_freq, not t * inv_freq / 4
    base = torch.tensor(spec.inv_freq, dtype=torch.float64) * 4
    assert torch.allclose(linear.cos_sin_cache[row, :8].double(), (row * base).cos(), atol=1e-4)


class _Attn(torch.nn.Module):
    def __init__(self, rotary_emb):
        super().__init__()
        self.rotary_emb = rotary_emb


class _Model(torch.nn.Module):
    def __init__(self, *ropes):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Attn(r) for r in ropes)


def test_model_rope_spec_of_identical_layers():
    def make():
        return RotaryEmbedding(32, 32, 256, 10000, True, torch.float32)

    model = _Model(make(), make())
    assert model_rope_spec(model) == rope_spec_of(model.layers[0].rotary_emb)
    shared = make()
    assert model_rope_spec(_Model(shared, shared)) == rope_spec_of(shared)


def test_model_rope_spec_refuses_per_layer_rope():
    local = RotaryEmbedding(32, 32, 256, 10000, True, torch.float32)
    global_ = RotaryEmbedding(32, 32, 256, 1000000, True, torch.float32)
    with pytest.raises(UnsupportedRope, match="per-layer RoPE.*layers.1.rotary_emb"):
        model_rope_spec(_Model(local, global_))
    with pytest.raises(UnsupportedRope, match="per-layer RoPE.*no RoPE"):
        model_rope_spec(_Model(local, None))
    with pytest.raises(UnsupportedRope, match="layers.1.rotary_emb: dynamic NTK"):
        model_rope_spec(_Model(local, DynamicNTKScalingRotaryEmbedding(32, 32, 64, 10000, True, 2.0, torch.float32)))
    with pytest.raises(UnsupportedRope, match="no rotary embedding module"):
        model_rope_spec(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# ---- the spec and the argument checks ---------------------------------------------------


def test_spec_validation():
    RopeSpec(8, 4, True, (1.0, 0.5))
    with pytest.raises(ValueError, match="even"):
        RopeSpec(8, 3, True, (1.0,))
    with pytest.raises(ValueError, match="exceeds head_dim"):
        RopeSpec(8, 10, True, (1.0,) * 5)
    with pytest.raises(ValueError, match="needs 2"):
        RopeSpec(8, 4, True, (1.0,))
    with pytest.raises(ValueError, match="not finite"):
        RopeSpec(8, 4, True, (1.0, float("nan")))


def test_signature_is_stable_and_covers_every_field():
    spec = RopeSpec(8, 4, True, [1.0, 0.01])
    assert spec.inv_freq == (1.0, 0.01)
    assert spec.signature() == RopeSpec(8, 4, True, (1.0, 0.01)).signature()
    assert spec.signature() == "af5f324d5ac1d5e2"  # the same in every process and release
    others = [
        RopeSpec(10, 4, True, (1.0, 0.01)),
        RopeSpec(8, 4, False, (1.0, 0.01)),
        RopeSpec(8, 4, True, (1.0, math.nextafter(0.01, 1))),
        RopeSpec(8, 2, True, (1.0,)),
    ]
    assert len({spec.signature(), *(o.signature() for o in others)}) == 5


def test_bad_arguments_are_rejected():
    spec = RopeSpec(8, 4, True, (1.0, 0.5))
    k = torch.randn(10, 2, 8)
    v = torch.randn(10, 2, 6)
    s = torch.tensor([0, 1])
    t = torch.tensor([2, 3])
    d = torch.tensor([5, -5])
    with pytest.raises(ValueError, match="overlap"):
        replace_layer(k, v, s, torch.tensor([1, 4]), d, spec)
    with pytest.raises(ValueError, match="appears twice"):
        replace_layer(k, v, s, torch.tensor([4, 4]), d, spec)
    with pytest.raises(ValueError, match="outside the pool"):
        replace_layer(k, v, s, torch.tensor([4, 10]), d, spec)
    with pytest.raises(ValueError, match="outside the pool"):
        check_slots(torch.tensor([-1]), torch.tensor([3]), 10)
    with pytest.raises(ValueError, match="2 source slots for 1"):
        replace_layer(k, v, s, t[:1], d, spec)
    with pytest.raises(ValueError, match="int64"):
        replace_layer(k, v, s, t, d.int(), spec)
    with pytest.raises(ValueError, match="3 deltas for 2"):
        replace_layer(k, v, s, t, torch.tensor([1, 2, 3]), spec)
    with pytest.raises(ValueError, match="head_dim 8 does not match.* 16"):
        replace_layer(k, v, s, t, d, RopeSpec(16, 4, True, (1.0, 0.5)))
    with pytest.raises(ValueError, match="pool size or number of heads"):
        replace_layer(k, v[:5], s, t, d, spec)
    with pytest.raises(ValueError, match="float tensor"):
        replace_layer(k.to(torch.uint8), v, s, t, d, spec)
    with pytest.raises(ValueError, match="int32/int64"):
        replace_layer(k, v, s.float(), t, d, spec)
    k0, v0 = k.clone(), v.clone()
    empty = torch.empty(0, dtype=torch.int64)
    replace_layer(k, v, empty, empty, empty, spec)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    # Disjoint lists checked once may skip the per-layer check.
    replace_layer(k, v, s, t, d, spec, verify_slots=False)
    assert torch.equal(v[t], v0[s])
