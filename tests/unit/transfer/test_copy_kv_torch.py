from __future__ import annotations

import pytest
import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.copy_kv import Direction, copy_layer, copy_layer_torch
from tests.kernels.copy_kv_cases import DTYPES, check, make_case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("chunk_size,num_chunks", [(1, 7), (5, 3), (16, 4), (7, 0)])
def test_torch_copy_matches_reference(dtype, direction, chunk_size, num_chunks):
    check(copy_layer_torch, dtype, chunk_size, num_chunks, direction)


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize(
    "heads, head_dim, misalign, words",
    [(4, 4, 0, torch.int64), (3, 5, 0, torch.int32), (4, 4, 1, torch.int64)],
    ids=["8-byte-words", "4-byte-words", "misaligned-device-bytes"],
)
def test_rows_moved_as_words_or_bytes_match_the_reference(direction, heads, head_dim, misalign, words):
    """The copy moves rows as the widest words they tile, and as bytes where the device
    buffer's address does not allow words (a view one fp32 element into a buffer)."""
    from pcr_sglang.transfer.copy_kv import _as_words
    from tests.kernels.copy_kv_cases import reference

    layout, k, v, host, token_slots, host_slots = make_case(torch.float32, 4, 3, heads=heads, head_dim=head_dim)
    if misalign:
        k = torch.cat([torch.zeros(1), k.reshape(-1)])[1:].view(k.shape)  # data_ptr 4 bytes past 8-alignment
        assert k.is_contiguous() and k.data_ptr() % 8 == 4
    assert _as_words(host.view(-1, layout.row_bytes), layout.row_bytes).dtype == words
    want_k, want_v, want_host = reference(direction, k, v, host, token_slots, host_slots, 1, layout)
    copy_layer_torch(direction, k, v, host, token_slots, host_slots, 1, layout)
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 - random host bytes may be NaNs
    assert torch.equal(host, want_host)
    assert torch.equal(as_bytes(k), as_bytes(want_k)) and torch.equal(as_bytes(v), as_bytes(want_v))


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
