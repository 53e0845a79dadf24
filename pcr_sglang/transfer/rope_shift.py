"""Re-place cached keys at new positions: rotate post-RoPE K by a position delta.

SGLang's KV pool holds K *after* RoPE. To reuse a document's KV computed at positions
``p`` at positions ``p + d`` (the document now sits elsewhere in the prompt), each K row
is rotated by the delta alone: ``K(p + d) = R(d) . K(p)``. That is exact for every RoPE
whose angle for pair ``i`` is ``position * inv_freq[i]`` with ``inv_freq`` fixed (plain,
linear, Llama-3 and YaRN scaling; not dynamic NTK, whose frequencies depend on the
sequence length, and not mRoPE, whose position is three numbers). V carries no position
and is copied unchanged.

The angles come from the pure frequencies (:class:`RopeSpec`), never from SGLang's
``cos_sin_cache``: YaRN's cache is pre-multiplied by ``mscale`` and the stored K already
carries that factor once, so rotating with the cache would scale K a second time. The
spec is built from a live SGLang module by :mod:`pcr_sglang.reuse.model_rope`;
this module itself knows nothing of SGLang.

Precision: the angle ``d * inv_freq`` is formed in float64 and only its cos/sin are
rounded to float32. ``d`` reaches 1e5 and the top frequency is ~1 rad/token, where one
float32 ulp of the angle is ~8e-3 rad: an angle formed in float32 would already rotate K
by a few 1e-3 wrong (bf16-sized error on an fp32 pool). In float64 the angle is good to
~1e-11 rad; the rotation itself then runs in float32 and is rounded once to the pool's
dtype. The Triton kernel does the same: it takes ``inv_freq`` as a float64 tensor and
forms the angle and its cos/sin in float64 (once per program, shared by the program's
heads: ``rotary_dim/2`` float64 sin/cos per token and head block, small beside the
row traffic even where float64 is slow), so the two paths agree to float32 rounding.

On CUDA the work is the Triton kernel ``_rope_shift_kernel``, one program per
(token, block of kv heads), which reads the source row, writes the rotated destination
row and copies V. On CPU a torch gather/rotate/scatter does the same, and the Triton
kernel is tested against it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from pcr_sglang.transfer.rope_spec import RopeSpec

# RopeSpec is re-exported: it was defined here before it got its own module.
__all__ = ["RopeSpec", "check_slots", "check_slots_on_device", "replace_layer", "shift_keys_torch"]

logger = logging.getLogger(__name__)

_MAX_BLOCK_ELEMS = 2048  # heads x head_dim elements one Triton program holds at most


@functools.lru_cache(maxsize=64)
def _inv_freq_on(spec: RopeSpec, device: torch.device) -> torch.Tensor:
    """``spec.inv_freq`` as a float64 tensor on ``device``, built once per device."""
    return torch.tensor(spec.inv_freq, dtype=torch.float64, device=device)


def _cos_sin(deltas: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``delta * inv_freq``, ``[n, rotary_dim/2]`` float32 (angle in float64)."""
    angles = deltas.to(torch.float64)[:, None] * _inv_freq_on(spec, deltas.device)[None, :]
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def shift_keys_torch(keys: torch.Tensor, deltas: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Return ``keys`` rotated by ``deltas`` positions: ``R(delta_t) . keys[t]``.

    ``keys`` is ``[n, num_heads, head_dim]`` of any float dtype, ``deltas`` int64 ``[n]``
    (negative moves a token earlier). The rotation runs in float32 and is rounded once
    to ``keys.dtype``; the angles are formed in float64 (see the module docstring).
    Dims ``>= rotary_dim`` and every row whose delta is 0 come back bit-identical.
    """
    if keys.dim() != 3 or keys.shape[-1] != spec.head_dim:
        raise ValueError(f"keys must be [n, num_heads, {spec.head_dim}], got {list(keys.shape)}")
    if not keys.is_floating_point():
        raise ValueError(f"keys must be a float tensor, got {keys.dtype}")
    _check_deltas(deltas, keys.shape[0], keys.device)
    if keys.shape[0] == 0:
        return keys.clone()
    half, rot = spec.half, spec.rotary_dim
    cos, sin = _cos_sin(deltas, spec)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x = keys[..., :rot].to(torch.float32)
    if spec.is_neox_style:
        x1, x2 = x[..., :half], x[..., half:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if spec.is_neox_style:
        rotated = torch.cat((o1, o2), dim=-1)
    else:
        rotated = torch.stack((o1, o2), dim=-1).flatten(-2)
    out = keys.clone()
    # Delta 0 is the identity: keep those rows' bits (rotating would turn -0.0 into +0.0
    # and propagate inf/nan through the products).
    unmoved = (deltas == 0)[:, None, None]
    out[..., :rot] = torch.where(unmoved, keys[..., :rot], rotated.to(keys.dtype))
    return out


def _check_deltas(deltas: torch.Tensor, n: int, device: torch.device) -> None:
    if deltas.dtype != torch.int64 or deltas.dim() != 1:
        raise ValueError(f"deltas must be a 1-D int64 tensor, got {deltas.dtype} {list(deltas.shape)}")
    if deltas.numel() != n:
        raise ValueError(f"{deltas.numel()} deltas for {n} tokens")
    if deltas.device != device:
        raise ValueError(f"deltas are on {deltas.device}, the keys on {device}")


def check_slots(src_slots: torch.Tensor, dst_slots: torch.Tensor, pool_size: int) -> None:
    """Raise ValueError unless every slot is in ``[0, pool_size)``, no destination slot
    repeats and no destination is also a source.

    Why: the Triton kernel reads sources while other programs write destinations, and it
    has no bounds check. Cost: one sort of the destinations, one ``isin`` and a single
    device-to-host sync for the three verdicts, which is why :func:`replace_layer` lets a
    caller that re-places the same slot lists in every layer check them once here and pass
    ``verify_slots=False`` for the layers.
    """
    if src_slots.numel() == 0:
        return
    both = torch.cat((src_slots, dst_slots))
    ordered = torch.sort(dst_slots).values
    verdicts = torch.stack(
        (
            (both.min() < 0) | (both.max() >= pool_size),
            (ordered[1:] == ordered[:-1]).any(),
            torch.isin(src_slots, dst_slots).any(),
        )
    ).tolist()
    if verdicts[0]:
        raise ValueError(f"a slot is outside the pool [0, {pool_size})")
    if verdicts[1]:
        raise ValueError("a destination slot appears twice")
    if verdicts[2]:
        raise ValueError("source and destination slots overlap; re-place into fresh slots")


def check_slots_on_device(src_slots: torch.Tensor, dst_slots: torch.Tensor, pool_size: int) -> None:
    """:func:`check_slots`'s three verdicts as device-side asserts (``--pcr-debug-checks``).

    On CUDA, :func:`check_slots` would cost a device-to-host sync in the scheduler thread,
    so the re-placement path leaves it out; with this check a bookkeeping slip is still an
    error, not silent KV corruption: ``torch._assert_async`` queues the verdicts on the
    current stream without waiting, and a violated one fails the CUDA context at the next
    synchronization (a device-side assertion naming the message). On CPU it raises at once."""
    if src_slots.numel() == 0:
        return
    both = torch.cat((src_slots, dst_slots))
    ordered = torch.sort(dst_slots).values
    torch._assert_async(
        ((both >= 0) & (both < pool_size)).all(),
        f"PCR debug check: a re-placement slot is outside the KV pool [0, {pool_size})",
    )
    torch._assert_async(
        (ordered[1:] != ordered[:-1]).all(), "PCR debug check: a re-placement destination slot appears twice"
    )
    torch._assert_async(
        torch.logical_not(torch.isin(src_slots, dst_slots).any()),
        "PCR debug check: re-placement source and destination slots overlap",
    )


def _check_layer(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
) -> None:
    if k_buffer.dim() != 3 or v_buffer.dim() != 3:
        raise ValueError(
            f"k_buffer and v_buffer must be [pool_size, num_kv_heads, head_dim], got "
            f"{list(k_buffer.shape)} and {list(v_buffer.shape)}"
        )
    if k_buffer.shape[-1] != spec.head_dim:
        raise ValueError(f"k_buffer head_dim {k_buffer.shape[-1]} does not match the RoPE spec's {spec.head_dim}")
    if v_buffer.shape[:2] != k_buffer.shape[:2]:
        raise ValueError(
            f"v_buffer {list(v_buffer.shape)} and k_buffer {list(k_buffer.shape)} differ in "
            "pool size or number of heads"
        )
    if not k_buffer.is_floating_point():
        raise ValueError(
            f"k_buffer must be a float tensor to rotate, got {k_buffer.dtype} (view an fp8 "
            "pool stored as uint8 as its float8 dtype first)"
        )
    if v_buffer.device != k_buffer.device:
        raise ValueError(f"v_buffer is on {v_buffer.device}, k_buffer on {k_buffer.device}")
    if v_buffer.data_ptr() == k_buffer.data_ptr():
        raise ValueError("k_buffer and v_buffer are the same memory (an MLA pool has no separate V)")
    for name, slots in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got {slots.dtype} {list(slots.shape)}")
        if slots.device != k_buffer.device:
            raise ValueError(f"{name} is on {slots.device}, the buffers on {k_buffer.device}")
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(f"{src_slots.numel()} source slots for {dst_slots.numel()} destinations")
    _check_deltas(deltas, src_slots.numel(), k_buffer.device)


def replace_layer(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
    *,
    use_triton: Optional[bool] = None,
    verify_slots: bool = True,
) -> None:
    """Re-place tokens within one layer of SGLang's token-indexed pool, in place:
    ``k_buffer[dst] = R(delta) . k_buffer[src]`` and ``v_buffer[dst] = v_buffer[src]``.

    ``k_buffer`` is ``[pool_size, num_kv_heads, spec.head_dim]``, ``v_buffer``
    ``[pool_size, num_kv_heads, v_head_dim]`` (``v_head_dim`` may differ); the slot lists
    are 1-D int32/int64 of equal length ``n``, ``deltas`` int64 ``[n]``, all on the
    buffers' device. Sources and destinations must be disjoint and destinations unique
    (see :func:`check_slots`, run here unless ``verify_slots=False``). ``use_triton``:
    None picks the Triton kernel on CUDA and torch elsewhere; True forces the kernel
    (under ``TRITON_INTERPRET=1`` on CPU, for tests). No slots: nothing happens.
    """
    _check_layer(k_buffer, v_buffer, src_slots, dst_slots, deltas, spec)
    if src_slots.numel() == 0:
        return
    if verify_slots:
        check_slots(src_slots, dst_slots, k_buffer.shape[0])
    if use_triton is None:
        use_triton = k_buffer.is_cuda
    if use_triton:
        _replace_layer_triton(k_buffer, v_buffer, src_slots, dst_slots, deltas, spec)
    else:
        _replace_layer_torch(k_buffer, v_buffer, src_slots, dst_slots, deltas, spec)


def _replace_layer_torch(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
) -> None:
    """Reference and CPU path: gather, rotate, scatter."""
    src, dst = src_slots.long(), dst_slots.long()
    k_buffer[dst] = shift_keys_torch(k_buffer[src], deltas, spec)
    v_buffer[dst] = v_buffer[src]


def _triton_kernel() -> Any:
    """Build the kernel on first use, so importing this module never needs Triton (a
    ``triton.JITFunction``: Triton ships no types)."""
    import triton
    import triton.language as tl

    # Slot and delta tensors are not specialized on their alignment (the re-placement's
    # deltas are a row of a stacked index tensor, aligned or not by its length): the
    # kernel the startup warm-up compiles is the one every later launch uses.
    # Typing: Triton ships no types (an untyped decorator), and it reads a kernel's parameter
    # annotations as its own (``tl.constexpr``, argument types), so these carry none.
    @triton.jit(do_not_specialize_on_alignment=["src_ptr", "dst_ptr", "delta_ptr"])  # type: ignore[untyped-decorator]
    def _rope_shift_kernel(  # type: ignore[no-untyped-def]
        k_ptr,
        v_ptr,
        src_ptr,
        dst_ptr,
        delta_ptr,
        inv_freq_ptr,
        num_heads,
        k_stride_tok,
        k_stride_head,
        v_stride_tok,
        v_stride_head,
        HALF: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        V_HEAD_DIM: tl.constexpr,
        IS_NEOX: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        token = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < num_heads
        src = tl.load(src_ptr + token).to(tl.int64)
        dst = tl.load(dst_ptr + token).to(tl.int64)
        delta = tl.load(delta_ptr + token)

        # Angles in float64, cos/sin rounded to float32 (module docstring: precision).
        pair = tl.arange(0, BLOCK_HALF)
        pair_mask = pair < HALF
        inv_freq = tl.load(inv_freq_ptr + pair, mask=pair_mask, other=0.0)
        angle = delta.to(tl.float64) * inv_freq
        cos = tl.cos(angle).to(tl.float32)[None, :]
        sin = tl.sin(angle).to(tl.float32)[None, :]
        if IS_NEOX:
            i1 = pair
            i2 = pair + HALF
        else:
            i1 = 2 * pair
            i2 = 2 * pair + 1

        k_src = k_ptr + src * k_stride_tok + heads[:, None] * k_stride_head
        k_dst = k_ptr + dst * k_stride_tok + heads[:, None] * k_stride_head
        mask = head_mask[:, None] & pair_mask[None, :]
        x1_raw = tl.load(k_src + i1[None, :], mask=mask)
        x2_raw = tl.load(k_src + i2[None, :], mask=mask)
        x1 = x1_raw.to(tl.float32)
        x2 = x2_raw.to(tl.float32)
        o1 = (x1 * cos - x2 * sin).to(x1_raw.dtype)
        o2 = (x2 * cos + x1 * sin).to(x2_raw.dtype)
        # Delta 0 keeps the bits (as the torch path does).
        o1 = tl.where(delta == 0, x1_raw, o1)
        o2 = tl.where(delta == 0, x2_raw, o2)
        tl.store(k_dst + i1[None, :], o1, mask=mask)
        tl.store(k_dst + i2[None, :], o2, mask=mask)

        if BLOCK_PASS > 0:  # dims >= rotary_dim: copied as they are
            rest = 2 * HALF + tl.arange(0, BLOCK_PASS)
            rest_mask = head_mask[:, None] & (rest < HEAD_DIM)[None, :]
            tl.store(k_dst + rest[None, :], tl.load(k_src + rest[None, :], mask=rest_mask), mask=rest_mask)

        vd = tl.arange(0, BLOCK_V)
        v_mask = head_mask[:, None] & (vd < V_HEAD_DIM)[None, :]
        v_off = heads[:, None] * v_stride_head + vd[None, :]
        row = tl.load(v_ptr + src * v_stride_tok + v_off, mask=v_mask)
        tl.store(v_ptr + dst * v_stride_tok + v_off, row, mask=v_mask)

    return _rope_shift_kernel


_KERNEL: Any = None  # the JITFunction, built at the first launch


def _replace_layer_triton(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    deltas: torch.Tensor,
    spec: RopeSpec,
) -> None:
    """The kernel: one program per (token, block of heads); the last dim must be dense."""
    global _KERNEL
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("the Triton path needs k_buffer and v_buffer dense in head_dim")
    if _KERNEL is None:
        _KERNEL = _triton_kernel()
    import triton

    num_heads = k_buffer.shape[1]
    pass_dims = spec.head_dim - spec.rotary_dim
    widest = max(spec.head_dim, v_buffer.shape[-1])
    block_h = min(triton.next_power_of_2(num_heads), max(1, _MAX_BLOCK_ELEMS // triton.next_power_of_2(widest)))
    grid = (src_slots.numel(), triton.cdiv(num_heads, block_h))
    _KERNEL[grid](
        k_buffer,
        v_buffer,
        src_slots,
        dst_slots,
        deltas,
        _inv_freq_on(spec, k_buffer.device),
        num_heads,
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        HALF=spec.half,
        HEAD_DIM=spec.head_dim,
        V_HEAD_DIM=v_buffer.shape[-1],
        IS_NEOX=spec.is_neox_style,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(spec.half),
        BLOCK_PASS=triton.next_power_of_2(pass_dims) if pass_dims else 0,
        BLOCK_V=triton.next_power_of_2(v_buffer.shape[-1]),
    )
