"""Pure-torch bodies for the ``sgl_kernel`` functions SGLang calls on CPU."""

from __future__ import annotations

import ctypes

import torch


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows ``src_loc -> tgt_loc`` inside every buffer listed in ``data_ptrs``.

    ``data_ptrs[i]`` is the address of buffer i and ``strides[i]`` its row size in bytes
    (SGLang passes every layer's K and V buffer). Rows are copied through a snapshot of the
    sources, so overlapping source and target sets behave like the CUDA kernel's
    gather-then-scatter.
    """
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError("tgt_loc and src_loc must have the same length")
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to("cpu", torch.int64)
    tgt = tgt_loc.to("cpu", torch.int64)
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        ptr, stride = int(ptr), int(stride)
        rows_needed = int(max(src.max().item(), tgt.max().item())) + 1
        buffer = (ctypes.c_uint8 * (rows_needed * stride)).from_address(ptr)
        view = torch.frombuffer(buffer, dtype=torch.uint8).view(rows_needed, stride)
        view[tgt] = view[src].clone()
