"""Copy one layer of K and V between SGLang's device KV pool and PCR's host chunk slots.

The device pool is token-indexed (``k_buffer[layer][token_slot]``, one row per token);
the host pool is chunk-slot-indexed (see :mod:`pcr_sglang.tiers.layout`). A transfer
names, for each chunk, its host slot and its ``chunk_size`` device token slots (any
order, not contiguous). Both directions, any dtype: rows are copied as raw bytes (on CPU
as the widest integer words that tile them).

On CUDA the copy is a Triton kernel, one program per (token, block of row bytes), which
reads a pinned host buffer directly and runs on whatever stream is current (the
layer-wise pipeline puts it on a side stream). The kernel gets the host buffer's device
address, obtained explicitly for registered memory (:mod:`pcr_sglang.transfer.host_pointer`,
as SGLang's HiCache builds its pointer tables), never the CPU tensor: the transfer engine
resolves it once and passes a :class:`~pcr_sglang.transfer.host_pointer.HostPointer`.
On CPU a torch gather/scatter does the same, and the Triton kernel is tested against it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Union

import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.host_pointer import HostPointer, resolve

Host = Union[torch.Tensor, HostPointer]  # the host pool: its tensor, or its device address (CUDA)

logger = logging.getLogger(__name__)

_BLOCK_BYTES = 512


class Direction(enum.IntEnum):
    DEVICE_TO_HOST = 0
    HOST_TO_DEVICE = 1


def _byte_rows(buffer: torch.Tensor, row_bytes: int) -> torch.Tensor:
    if not buffer.is_contiguous():
        raise ValueError("the device KV buffer must be contiguous")
    return buffer.view(torch.uint8).reshape(-1, row_bytes)


# Rows are moved as the widest integer words that tile them: torch's gather and scatter
# move one element at a time, so 8-byte words copy a 768-byte row about 4x faster than
# its bytes (measured on the 2-core CI machine, SmolLM2's fp32 rows).
_WORDS = (torch.int64, torch.int32, torch.int16)


def _as_words(rows: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``rows`` (uint8, ``[n, row_bytes]``, contiguous) viewed as ``[n, row_bytes / w]``
    words of the widest size ``w`` its length and alignment allow."""
    for dtype in _WORDS:
        if row_bytes % dtype.itemsize == 0 and rows.data_ptr() % dtype.itemsize == 0:
            return rows.view(dtype)
    return rows


def _host_tensor(host: Host) -> torch.Tensor:
    return host.tensor if isinstance(host, HostPointer) else host


def _check(
    layout: HostChunkLayout, host: torch.Tensor, token_slots: torch.Tensor, host_slots: torch.Tensor, layer: int
) -> None:
    if host.dtype != torch.uint8 or host.numel() != layout.total_bytes:
        raise ValueError(f"host pool must be a uint8 tensor of {layout.total_bytes} bytes")
    if token_slots.numel() != host_slots.numel() * layout.chunk_size:
        raise ValueError(
            f"{token_slots.numel()} device token slots for {host_slots.numel()} chunks of {layout.chunk_size}"
        )
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {layout.num_layers})")


def check_copy_slots_on_device(
    token_slots: torch.Tensor, host_slots: torch.Tensor, pool_tokens: int, num_host_slots: int
) -> None:
    """The copy's slot bounds as device-side asserts (``--pcr-debug-checks``): the kernel has
    no bounds check, so an out-of-range slot would read or write outside the pools. Queued
    on the current stream without a host wait (``torch._assert_async``); on CPU it raises
    at once."""
    if token_slots.numel():
        torch._assert_async(
            ((token_slots >= 0) & (token_slots < pool_tokens)).all(),
            f"PCR debug check: a copy's device token slot is outside the KV pool [0, {pool_tokens})",
        )
    if host_slots.numel():
        torch._assert_async(
            ((host_slots >= 0) & (host_slots < num_host_slots)).all(),
            f"PCR debug check: a copy's host slot is outside the host pool [0, {num_host_slots})",
        )


def copy_layer_torch(
    direction: Direction,
    device_k: torch.Tensor,
    device_v: torch.Tensor,
    host: torch.Tensor,
    token_slots: torch.Tensor,
    host_slots: torch.Tensor,
    layer: int,
    layout: HostChunkLayout,
) -> None:
    """Reference and CPU path: per K and V, one gather and one scatter over all chunks
    (a chunk's layer block is contiguous on the host, so one index per chunk names it).
    ``host_slots`` must not repeat (a scatter into one slot twice has no order)."""
    _check(layout, host, token_slots, host_slots, layer)
    if host_slots.numel() == 0:
        return
    chunks, chunk = host_slots.numel(), layout.chunk_size
    host_rows = _as_words(host.view(-1, layout.row_bytes), layout.row_bytes)
    host_view = host_rows.view(layout.num_slots, layout.num_layers, 2, chunk, -1)
    slots = host_slots.to(host.device, torch.int64)
    rows = token_slots.to(device_k.device, torch.int64)
    for kv, device in ((0, device_k), (1, device_v)):
        dev_rows = _byte_rows(device, layout.row_bytes)
        if dev_rows.data_ptr() % host_rows.element_size() == 0:
            dev_rows = dev_rows.view(host_rows.dtype)
            words = host_view
        else:  # an odd device alignment: both sides as bytes
            words = host.view(layout.shape)
        if direction == Direction.DEVICE_TO_HOST:
            words[slots, layer, kv] = dev_rows[rows].view(chunks, chunk, -1).to(host.device)
        else:
            # mutant: oracle-host-load-shifts-tokens
            dev_rows[rows] = words[slots, layer, kv].reshape(chunks * chunk, -1).to(device.device)


def _triton_kernel() -> Any:
    """Build the kernel on first use, so importing this module never needs Triton (a
    ``triton.JITFunction``: Triton ships no types)."""
    import triton
    import triton.language as tl

    # ``layer`` is not specialized on (1 and multiples of 16 would each compile a variant),
    # nor the index tensors on their alignment (views of a larger tensor may be unaligned):
    # the kernels the startup warm-up compiles are the ones every later launch uses.
    # Typing: Triton ships no types (an untyped decorator), and it reads a kernel's parameter
    # annotations as its own (``tl.constexpr``, argument types), so these carry none.
    @triton.jit(do_not_specialize=["layer"], do_not_specialize_on_alignment=["token_slots_ptr", "host_slots_ptr"])  # type: ignore[untyped-decorator]
    def copy_layer_kernel(  # type: ignore[no-untyped-def]
        dev_k_ptr,
        dev_v_ptr,
        host_ptr,
        token_slots_ptr,
        host_slots_ptr,
        layer,
        num_layers,
        chunk_size,
        row_bytes,
        DIRECTION: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        block = tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_bytes
        chunk = token // chunk_size
        pos = token % chunk_size
        slot = tl.load(host_slots_ptr + chunk).to(tl.int64)
        dev_row = tl.load(token_slots_ptr + token).to(tl.int64)
        host_k = ((slot * num_layers + layer) * 2 * chunk_size + pos) * row_bytes + offs
        host_v = host_k + chunk_size * row_bytes
        dev = dev_row * row_bytes + offs
        if DIRECTION == 0:
            tl.store(host_ptr + host_k, tl.load(dev_k_ptr + dev, mask=mask), mask=mask)
            tl.store(host_ptr + host_v, tl.load(dev_v_ptr + dev, mask=mask), mask=mask)
        else:
            tl.store(dev_k_ptr + dev, tl.load(host_ptr + host_k, mask=mask), mask=mask)
            tl.store(dev_v_ptr + dev, tl.load(host_ptr + host_v, mask=mask), mask=mask)

    return copy_layer_kernel


_KERNEL: Any = None  # the JITFunction, built at the first launch


def kernel_host_arg(host: Host, device: torch.device) -> Union[torch.Tensor, HostPointer]:
    """What the kernel gets for the host pool when it runs on ``device``: on CUDA the
    device address of the registered buffer (a :class:`HostPointer`, resolved here if the
    caller passed the tensor), never a CPU tensor; elsewhere (the interpreter) the tensor."""
    if device.type != "cuda":
        return _host_tensor(host)
    if isinstance(host, HostPointer):
        return host
    if host.is_cuda:
        return host
    # mutant: gpu-kernel-host-arg-not-resolved
    return resolve(host, device)


def copy_layer_triton(
    direction: Direction,
    device_k: torch.Tensor,
    device_v: torch.Tensor,
    host: Host,
    token_slots: torch.Tensor,
    host_slots: torch.Tensor,
    layer: int,
    layout: HostChunkLayout,
) -> None:
    global _KERNEL
    _check(layout, _host_tensor(host), token_slots, host_slots, layer)
    if host_slots.numel() == 0:
        return
    if _KERNEL is None:
        _KERNEL = _triton_kernel()
    import triton

    grid = (token_slots.numel(), triton.cdiv(layout.row_bytes, _BLOCK_BYTES))
    _KERNEL[grid](
        _byte_rows(device_k, layout.row_bytes),
        _byte_rows(device_v, layout.row_bytes),
        # mutant: gpu-copy-kernel-gets-the-cpu-tensor
        kernel_host_arg(host, device_k.device),
        token_slots,
        host_slots,
        layer,
        layout.num_layers,
        layout.chunk_size,
        layout.row_bytes,
        DIRECTION=int(direction),
        BLOCK=_BLOCK_BYTES,
    )


def copy_layer(
    direction: Direction,
    device_k: torch.Tensor,
    device_v: torch.Tensor,
    host: Host,
    token_slots: torch.Tensor,
    host_slots: torch.Tensor,
    layer: int,
    layout: HostChunkLayout,
) -> None:
    """Copy ``layer`` of every listed chunk; the Triton kernel on CUDA, torch elsewhere.
    ``host``: the pool's tensor, or (CUDA) its :class:`HostPointer`, resolved once by the
    caller (a tensor is resolved at each call)."""
    if device_k.is_cuda:
        copy_layer_triton(direction, device_k, device_v, host, token_slots, host_slots, layer, layout)
    else:
        copy_layer_torch(direction, device_k, device_v, _host_tensor(host), token_slots, host_slots, layer, layout)
