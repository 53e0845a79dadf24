from __future__ import annotations

import pytest
import torch

from pcr_sglang.transfer.copy_kv import Direction, copy_layer, copy_layer_torch
from pcr_sglang.transfer.layout import HostChunkLayout
from tests.kernels.copy_kv_cases import DTYPES, check, make_case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("chunk_size,num_chunks", [(1, 7), (5, 3), (16, 4), (7, 0)])
def test_torch_copy_matches_reference(dtype, direction, chunk_size, num_chunks):
    check(copy_layer_torch, dtype, chunk_size, num_chunks, direction)


def test_round_trip_through_host_restores_kv():
    layout, k, v, host, token_slots, host_slots = make_case(torch.bfloat16, 8, 3)
    original_k, original_v = k.clone(), v.clone()
    for layer in range(layout.num_layers):
        copy_layer(Direction.DEVICE_TO_HOST, k, v, host, token_slots, host_slots, layer, layout)
    k[token_slots] = 0
    v[token_slots] = 0
    copy_layer(Direction.HOST_TO_DEVICE, k, v, host, token_slots, host_slots, 1, layout)
    assert torch.equal(k, original_k) and torch.equal(v, original_v)


def test_layout_makes_one_layer_of_one_chunk_contiguous():
    layout = HostChunkLayout(num_slots=3, num_layers=4, chunk_size=8, row_bytes=96)
    host = torch.arange(layout.total_bytes, dtype=torch.int64)
    block = host.view(layout.shape)[2, 1]  # slot 2, layer 1: K rows then V rows
    assert block.is_contiguous() and block.numel() == layout.layer_bytes
    assert int(block.reshape(-1)[0]) == (2 * layout.num_layers + 1) * layout.layer_bytes


def test_bad_arguments_are_rejected():
    layout, k, v, host, token_slots, host_slots = make_case(torch.float16, 4, 2)
    with pytest.raises(ValueError, match="device token slots"):
        copy_layer_torch(Direction.HOST_TO_DEVICE, k, v, host, token_slots[:-1], host_slots, 0, layout)
    with pytest.raises(ValueError, match="layer 9 out of range"):
        copy_layer_torch(Direction.HOST_TO_DEVICE, k, v, host, token_slots, host_slots, 9, layout)
    with pytest.raises(ValueError, match="must be positive"):
        HostChunkLayout(num_slots=0, num_layers=1, chunk_size=1, row_bytes=1)
