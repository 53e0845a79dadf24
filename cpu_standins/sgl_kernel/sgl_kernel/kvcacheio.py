"""Pure-torch bodies for ``sgl_kernel.kvcacheio``: KV copies between SGLang's device KV
pool and HiCache's host pool, as SGLang's host-pool code calls them on CPU.

All copies are byte copies of whole token rows (``item_size`` bytes per token and
layer), so every KV dtype works. Where SGLang passes raw buffer addresses (the
``*_all_layer*`` variants take a uint64 tensor of per-layer data pointers), the rows are
reached through a byte view of that address, exactly what the CUDA kernels dereference.

Provided: the ``layer_first`` and ``page_first`` host layouts with the ``kernel`` I/O
backend, and ``layer_first`` with the ``direct`` backend. The ``page_head`` and
``page_first_direct`` layouts and the MLA variants raise, naming themselves: choose
``--hicache-mem-layout layer_first`` or ``page_first`` on CPU.
"""

from __future__ import annotations

import ctypes
from typing import List

import torch

from sgl_kernel._unavailable import export_unavailable


def _as_rows(buffer: torch.Tensor, row_bytes: int) -> torch.Tensor:
    if not buffer.is_contiguous():
        raise ValueError("kvcacheio on CPU needs contiguous KV buffers")
    flat = buffer.view(torch.uint8).reshape(-1)
    if flat.numel() % row_bytes:
        raise ValueError(f"buffer of {flat.numel()} bytes is not a whole number of {row_bytes}-byte rows")
    return flat.view(-1, row_bytes)


def _rows_at(address: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    array = (ctypes.c_uint8 * (row_bytes * num_rows)).from_address(int(address))
    return torch.frombuffer(array, dtype=torch.uint8).view(num_rows, row_bytes)


def _indices(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", torch.int64)


def _check_same_length(src_indices: torch.Tensor, dst_indices: torch.Tensor) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"src_indices ({src_indices.numel()}) and dst_indices ({dst_indices.numel()}) differ in length"
        )


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size,
                          block_quota=2, num_warps_per_block=32) -> None:
    """One layer, token-major on both sides: ``dst[dst_i] = src[src_i]`` row by row."""
    _check_same_length(src_indices, dst_indices)
    src_i, dst_i = _indices(src_indices), _indices(dst_indices)
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _as_rows(dst, item_size)[dst_i] = _as_rows(src, item_size)[src_i]


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id,
                                item_size, src_layout_dim, block_quota=2,
                                num_warps_per_block=32) -> None:
    """Host page-first (``[token][layer][row]``) to one device layer (``[token][row]``)."""
    _check_same_length(src_indices, dst_indices)
    src_i, dst_i = _indices(src_indices), _indices(dst_indices)
    lo, hi = layer_id * item_size, (layer_id + 1) * item_size
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _as_rows(dst, item_size)[dst_i] = _as_rows(src, src_layout_dim)[src_i, lo:hi]


def _layer_rows(pointers: torch.Tensor, item_size: int, num_rows: int) -> list[torch.Tensor]:
    return [_rows_at(int(p), item_size, num_rows) for p in pointers.tolist()]


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices,
                          dst_indices, item_size, num_layers, block_quota=2,
                          num_warps_per_block=32) -> None:
    """Every layer, token-major on both sides, buffers given by address."""
    _check_same_length(src_indices, dst_indices)
    if src_indices.numel() == 0:
        return
    src_i, dst_i = _indices(src_indices), _indices(dst_indices)
    src_rows, dst_rows = int(src_i.max()) + 1, int(dst_i.max()) + 1
    for src_ptrs, dst_ptrs in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        srcs = _layer_rows(src_ptrs[:num_layers], item_size, src_rows)
        dsts = _layer_rows(dst_ptrs[:num_layers], item_size, dst_rows)
        for src, dst in zip(srcs, dsts):
            dst[dst_i] = src[src_i]


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices,
                                item_size, dst_layout_dim, num_layers, block_quota=2,
                                num_warps_per_block=32) -> None:
    """Every device layer (by address) into the host page-first buffer."""
    _check_same_length(src_indices, dst_indices)
    if src_indices.numel() == 0:
        return
    src_i, dst_i = _indices(src_indices), _indices(dst_indices)
    src_rows = int(src_i.max()) + 1
    for src_ptrs, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        host = _as_rows(dst, dst_layout_dim)
        for layer_id, src in enumerate(_layer_rows(src_ptrs[:num_layers], item_size, src_rows)):
            host[dst_i, layer_id * item_size : (layer_id + 1) * item_size] = src[src_i]


def transfer_kv_direct(src_layers: List[torch.Tensor], dst_layers: List[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Token-indexed copy between matching lists of token-major buffers."""
    _check_same_length(src_indices, dst_indices)
    if len(src_layers) != len(dst_layers):
        raise ValueError("src_layers and dst_layers differ in length")
    src_i, dst_i = _indices(src_indices), _indices(dst_indices)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_i.to(dst.device)] = src[src_i.to(src.device)].to(dst.device)


export_unavailable(
    globals(),
    "sgl_kernel.kvcacheio",
    [
        "transfer_kv_per_layer_ph_lf",
        "transfer_kv_all_layer_lf_ph",
        "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_all_layer_direct_lf_pf",
        "transfer_kv_per_layer_mla",
        "transfer_kv_per_layer_mla_pf_lf",
        "transfer_kv_all_layer_mla",
        "transfer_kv_all_layer_mla_lf_pf",
        "transfer_embedding_ranges_direct",
    ],
)
