"""The :class:`~pcr_sglang.transfer.rope_shift.RopeSpec` of a loaded SGLang model, or a
clear refusal.

Re-placing cached K by a rotation of the position delta is exact only when the angle of
pair ``i`` at position ``p`` is ``p * inv_freq[i]`` with ``inv_freq`` fixed. Which SGLang
0.5.23 rotary classes satisfy that was read off their source
(``sglang/srt/layers/rotary_embedding``); each class is matched *exactly* (a subclass may
change the angle math, as ``MRotaryEmbedding`` and ``Gemma4RotaryEmbedding`` do), and the
frequencies are taken from the module's own ``_compute_inv_freq`` (float32, as its
``cos_sin_cache`` was built), then checked against rows of that cache:

* ``RotaryEmbedding``: ``inv_freq = base^(-2i/r)``; ``_compute_inv_freq(base)``.
* ``LinearScalingRotaryEmbedding``: the cache uses ``t / factor``, folded here into
  ``inv_freq / factor``. One factor only (several are per-LoRA caches at offsets).
* ``Llama3RotaryEmbedding``: ``_compute_inv_freq(base)`` is overridden with the
  llama-3.1 wavelength-dependent blend; positions are not scaled.
* ``YaRNScalingRotaryEmbedding`` and ``DeepseekScalingRotaryEmbedding``:
  ``_compute_inv_freq(scaling_factor)`` (the interpolation/extrapolation blend); the
  cache is ``cos/sin * mscale``. The stored K already carries ``mscale`` once, so the
  spec holds the frequencies only and the shift never uses the cache.
  (DeepSeek's class serves MLA models, whose pool keeps one latent row per token with
  the rotary dims at its end; :func:`~pcr_sglang.transfer.rope_shift.replace_layer`
  refuses that layout by its shape checks, the spec itself is right.)

Refused, with the class named: dynamic NTK (``DynamicNTKScalingRotaryEmbedding``,
``DynamicNTKAlphaRotaryEmbedding``: by design their frequencies depend on the sequence
length), mRoPE (``MRotaryEmbedding`` and anything whose class name contains
``MRotary``: a position is three numbers), and every other class (Phi-3 LongRoPE switches
tables by prompt length, dual-chunk, Fourier, Gemma-4 cross-mixing, Llama-4 vision, a
Hugging Face module, ...). A model whose rotary modules disagree (per-layer RoPE), or
whose attention layers include some without RoPE (``rotary_emb = None``: NoPE layers),
is refused too: one spec would rotate some layer's keys wrongly.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from sglang.srt.layers.rotary_embedding.base import LinearScalingRotaryEmbedding, RotaryEmbedding
from sglang.srt.layers.rotary_embedding.mrope import MRotaryEmbedding
from sglang.srt.layers.rotary_embedding.rope_variant import (
    DeepseekScalingRotaryEmbedding,
    DynamicNTKAlphaRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
)
from sglang.srt.layers.rotary_embedding.yarn import YaRNScalingRotaryEmbedding

from pcr_sglang.transfer.rope_shift import RopeSpec

logger = logging.getLogger(__name__)


class UnsupportedRope(ValueError):
    """This model's RoPE cannot be re-placed by a rotation of the position delta (the
    message names the class or layer and why)."""


def _inv_freq_base(m: Any) -> torch.Tensor:
    inv_freq: torch.Tensor = m._compute_inv_freq(m.base)  # SGLang's rotary classes are untyped
    return inv_freq


def _inv_freq_linear(m: Any) -> torch.Tensor:
    factors = list(m.scaling_factors)
    if len(factors) != 1:
        raise UnsupportedRope(
            f"{type(m).__name__} with several scaling factors {factors} (one cos/sin table "
            "per LoRA adapter, picked by offsets): which positions a cached K was computed "
            "with is ambiguous"
        )
    # Its cache is built from t / factor: the same angle as t * (inv_freq / factor).
    inv_freq: torch.Tensor = m._compute_inv_freq(m.base)
    return inv_freq.double() / float(factors[0])


def _inv_freq_yarn(m: Any) -> torch.Tensor:
    inv_freq: torch.Tensor = m._compute_inv_freq(m.scaling_factor)
    return inv_freq


def _whole_table(m: Any) -> int:
    return int(m.cos_sin_cache.shape[0])


def _linear_table(m: Any) -> int:
    # The rows its own _compute_cos_sin_cache built; see _check_against_cache.
    return min(_whole_table(m), int(m.max_position_embeddings * m.scaling_factors[0]))


# Exact classes whose angle is position x a fixed frequency, with how to get the
# frequencies and how many rows of their cos_sin_cache follow that formula.
_ALLOWED = {
    RotaryEmbedding: (_inv_freq_base, _whole_table),
    LinearScalingRotaryEmbedding: (_inv_freq_linear, _linear_table),
    Llama3RotaryEmbedding: (_inv_freq_base, _whole_table),
    YaRNScalingRotaryEmbedding: (_inv_freq_yarn, _whole_table),
    DeepseekScalingRotaryEmbedding: (_inv_freq_yarn, _whole_table),
}
_DYNAMIC_NTK = (DynamicNTKScalingRotaryEmbedding, DynamicNTKAlphaRotaryEmbedding)


def _refusal(m: Any) -> str | None:
    cls = type(m)
    name = cls.__name__
    if isinstance(m, _DYNAMIC_NTK):
        return (
            f"dynamic NTK RoPE ({name}) is not supported: its frequencies are a function "
            "of the sequence length, so a cached K cannot be moved by rotating it by the "
            "position delta"
        )
    if isinstance(m, MRotaryEmbedding) or any("MRotary" in c.__name__ for c in cls.__mro__):
        return (
            f"multimodal RoPE ({name}) is not supported: its position is three numbers "
            "(time, height, width) per token, not one that a delta can shift"
        )
    if cls not in _ALLOWED:
        allowed = ", ".join(sorted(c.__name__ for c in _ALLOWED))
        return (
            f"RoPE class {cls.__module__}.{name} is not supported: only classes whose angle "
            f"is position x a fixed frequency are ({allowed})"
        )
    return None


def _check_against_cache(m: Any, inv_freq: torch.Tensor, rows: int) -> None:
    """Compare sampled rows (among the first ``rows``, the last included) of
    ``m.cos_sin_cache`` with ``mscale * cos/sin(p * inv_freq)``; a meta-device cache is
    not checked.

    SGLang grows every table at load time to the context length plus a margin
    (``reserve_rope_cache_for_long_sequences``). That growth is right for every allowed
    class but one: the base class's ``_ensure_cos_sin_cache_length``, which
    ``LinearScalingRotaryEmbedding`` inherits, appends rows of ``t * inv_freq`` without
    the ``/ factor``. Those rows start at ``max_position_embeddings * factor``, which is
    SGLang's context length for linear scaling, so only rows no request reaches are
    wrong; they are not sampled.
    """
    cache = getattr(m, "cos_sin_cache", None)
    if cache is None or cache.device.type == "meta":
        return
    start = int(getattr(m, "position_start", 0))
    candidates = [0, 1, 2, 3, 5, 8, 13, 100, 1000, 4096, rows // 3, rows // 2, rows - 1]
    positions = sorted({p for p in candidates if 0 <= p - start < rows})
    if not positions:
        return
    got = cache[torch.tensor([p - start for p in positions], device=cache.device)]
    got = got.detach().to("cpu", torch.float64)
    half = inv_freq.numel()
    if got.shape[-1] != 2 * half:
        raise UnsupportedRope(
            f"{type(m).__name__}.cos_sin_cache rows are {got.shape[-1]} wide, expected cos and sin of {half} pairs"
        )
    mscale = float(getattr(m, "mscale", 1.0))
    pos = torch.tensor(positions, dtype=torch.float64)[:, None]
    angle = pos * inv_freq.double()[None, :]
    want = torch.cat((angle.cos(), angle.sin()), dim=-1) * mscale
    # float32 forms t * inv_freq (and t / factor) with a rounding each: ~2 ulps of the
    # angle, plus the cache's own dtype rounding.
    angle_err = 4 * 2.0**-24 * angle.abs().max(dim=-1, keepdim=True).values
    tol = abs(mscale) * (angle_err + 4 * torch.finfo(cache.dtype).eps) + 1e-6
    bad = ((got - want).abs() > tol).any(dim=-1)
    if bool(bad.any()):
        p = positions[int(bad.nonzero()[0])]
        raise UnsupportedRope(
            f"{type(m).__name__}.cos_sin_cache at position {p} is not mscale x cos/sin of "
            "position x its inv_freq: this SGLang's rotary math differs from what the "
            "position shift assumes"
        )


def rope_spec_of(rotary_emb: Any) -> RopeSpec:
    """The spec of one SGLang rotary embedding module; :class:`UnsupportedRope` if its
    angles are not position x fixed frequency (see the module docstring)."""
    reason = _refusal(rotary_emb)
    if reason is not None:
        raise UnsupportedRope(reason)
    inv_freq_of, checked_rows = _ALLOWED[type(rotary_emb)]
    inv_freq = inv_freq_of(rotary_emb).detach().to("cpu", torch.float64).reshape(-1)
    head_dim, rotary_dim = int(rotary_emb.head_size), int(rotary_emb.rotary_dim)
    try:
        spec = RopeSpec(
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            is_neox_style=bool(rotary_emb.is_neox_style),
            inv_freq=tuple(inv_freq.tolist()),
        )
    except ValueError as e:
        raise UnsupportedRope(f"{type(rotary_emb).__name__}: {e}") from e
    _check_against_cache(rotary_emb, inv_freq, checked_rows(rotary_emb))
    return spec


# Class names that say "rotary embedding": "...Rotary..." or a CamelCase "RoPE"/"Rope"
# word (not the letters inside "Property").
_ROPE_NAME = re.compile(r"RoPE|Rope(?=[A-Z_0-9]|$)")


def _looks_rotary(m: torch.nn.Module) -> bool:
    if isinstance(m, RotaryEmbedding):
        return True
    name = type(m).__name__
    return "rotary" in name.lower() or _ROPE_NAME.search(name) is not None


_MISSING = object()


def model_rope_spec(model: torch.nn.Module) -> RopeSpec:
    """The one spec shared by every rotary embedding module of a loaded SGLang model.

    Raises :class:`UnsupportedRope` when there is none, when one is refused (the message
    names the module and class), when they differ (per-layer RoPE) or when some
    attention layers have ``rotary_emb = None`` (NoPE layers beside RoPE ones).
    """
    found: list[tuple[str, torch.nn.Module]] = []
    nope: list[str] = []
    for name, m in model.named_modules():
        if _looks_rotary(m):
            found.append((name or "<model>", m))
        if getattr(m, "rotary_emb", _MISSING) is None:
            nope.append(name or "<model>")
    model_cls = type(model).__name__
    if not found:
        raise UnsupportedRope(
            f"no rotary embedding module found in {model_cls}: a position shift needs the "
            "RoPE frequencies (a model without RoPE, or one computing it inline, is not "
            "supported)"
        )
    if nope:
        raise UnsupportedRope(
            f"per-layer RoPE in {model_cls}: {len(nope)} attention layers have no RoPE "
            f"(rotary_emb is None, e.g. {nope[0]}) beside layers with RoPE; one spec would "
            "rotate their keys wrongly"
        )
    specs: list[tuple[str, RopeSpec]] = []
    for name, m in found:
        try:
            specs.append((name, rope_spec_of(m)))
        except UnsupportedRope as e:
            raise UnsupportedRope(f"{model_cls}.{name}: {e}") from e
    first_name, first = specs[0]
    for name, spec in specs[1:]:
        if spec != first:
            raise UnsupportedRope(
                f"per-layer RoPE in {model_cls}: {name} ({_describe(spec)}) differs from "
                f"{first_name} ({_describe(first)}); one spec cannot re-place every layer"
            )
    return first


def _describe(spec: RopeSpec) -> str:
    f = spec.inv_freq
    return (
        f"head_dim={spec.head_dim}, rotary_dim={spec.rotary_dim}, "
        f"neox={spec.is_neox_style}, inv_freq[0]={f[0]:.6g}, inv_freq[-1]={f[-1]:.6g}, "
        f"signature={spec.signature()}"
    )


__all__ = ["UnsupportedRope", "model_rope_spec", "rope_spec_of"]
