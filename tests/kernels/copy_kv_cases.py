"""Shared cases for the KV copy: a naive per-token reference and random index sets."""

from __future__ import annotations

import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.copy_kv import Direction

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]  # uint8 stands for fp8 bytes


def make_case(dtype, chunk_size, num_chunks, heads=3, head_dim=5, pool_tokens=211, slots=9, layers=4, seed=0):
    """Odd sizes on purpose: rows of heads*head_dim*itemsize bytes, non-contiguous and
    unsorted device token slots, host slots out of order."""
    g = torch.Generator().manual_seed(seed)
    row_bytes = heads * head_dim * torch.empty((), dtype=dtype).element_size()
    layout = HostChunkLayout(num_slots=slots, num_layers=layers, chunk_size=chunk_size, row_bytes=row_bytes)
    if dtype == torch.uint8:
        k = torch.randint(0, 256, (pool_tokens, heads, head_dim), generator=g, dtype=torch.uint8)
        v = torch.randint(0, 256, (pool_tokens, heads, head_dim), generator=g, dtype=torch.uint8)
    else:
        k = torch.randn(pool_tokens, heads, head_dim, generator=g).to(dtype)
        v = torch.randn(pool_tokens, heads, head_dim, generator=g).to(dtype)
    host = torch.randint(0, 256, (layout.total_bytes,), generator=g, dtype=torch.uint8)
    token_slots = torch.randperm(pool_tokens, generator=g)[: num_chunks * chunk_size]
    host_slots = torch.randperm(slots, generator=g)[:num_chunks]
    return layout, k, v, host, token_slots, host_slots


def reference(direction, k, v, host, token_slots, host_slots, layer, layout):
    """One token at a time, straight from the layout's definition."""
    host = host.clone().view(layout.shape)
    k, v = k.clone(), v.clone()
    rows_k = k.view(torch.uint8).reshape(-1, layout.row_bytes)
    rows_v = v.view(torch.uint8).reshape(-1, layout.row_bytes)
    for i, token in enumerate(token_slots.tolist()):
        slot = int(host_slots[i // layout.chunk_size])
        pos = i % layout.chunk_size
        for kv, rows in ((0, rows_k), (1, rows_v)):
            if direction == Direction.DEVICE_TO_HOST:
                host[slot, layer, kv, pos] = rows[token]
            else:
                rows[token] = host[slot, layer, kv, pos]
    return k, v, host.reshape(-1)


def check(copy_fn, dtype, chunk_size, num_chunks, direction, layer=2, seed=0, device="cpu"):
    """Run ``copy_fn`` with the device pool on ``device`` (the host pool pinned when that
    is CUDA) and compare every byte with the reference."""
    layout, k, v, host, token_slots, host_slots = make_case(dtype, chunk_size, num_chunks, seed=seed)
    want_k, want_v, want_host = reference(direction, k, v, host, token_slots, host_slots, layer, layout)
    if device != "cpu":
        k, v, token_slots, host_slots = (t.to(device) for t in (k, v, token_slots, host_slots))
        host = host.pin_memory()
    copy_fn(direction, k, v, host, token_slots, host_slots, layer, layout)
    if device != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(host, want_host)
    assert torch.equal(k.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v.cpu().view(torch.uint8), want_v.view(torch.uint8))
