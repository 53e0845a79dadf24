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


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new slots into its row of ``req_to_token``.

    Request i gets ``out_cache_loc[o_i : o_i + (end_i - start_i)]`` at row positions
    ``[start_i, end_i)``, where ``o_i`` is the total length of requests before it: the
    semantics of SGLang's Triton kernel ``assign_req_to_token_pool``.
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        length = end - start
        if length <= 0:
            continue
        if end > pool_len:
            raise IndexError(f"row position {end} beyond pool_len {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[offset : offset + length].to(req_to_token.dtype)
        offset += length
