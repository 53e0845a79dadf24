"""The layer-wise transfer protocol on CPU: when each layer of a load or offload lands."""

from __future__ import annotations

import pytest
import torch

from pcr_sglang.transfer.copy_kv import Direction
from pcr_sglang.transfer.layerwise import LayerwiseMode, LayerwiseTransfer
from pcr_sglang.transfer.layout import HostChunkLayout

LAYERS, CHUNK, HEADS, DIM, TOKENS, SLOTS = 3, 4, 2, 8, 64, 6


def make_pipeline(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kv = [(torch.randn(TOKENS, HEADS, DIM, generator=gen), torch.randn(TOKENS, HEADS, DIM, generator=gen))
          for _ in range(LAYERS)]
    layout = HostChunkLayout(SLOTS, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.randn(layout.total_bytes // 4, generator=gen).view(torch.uint8)  # no NaN patterns
    return LayerwiseTransfer(kv, host, layout), kv, host.view(layout.shape)


def host_rows(host, slot: int, layer: int, kv: int) -> torch.Tensor:
    return host[slot, layer, kv].view(torch.float32).view(CHUNK, HEADS, DIM)


def test_modes():
    assert LayerwiseMode("both").loads and LayerwiseMode("both").offloads
    assert LayerwiseMode("load").loads and not LayerwiseMode("load").offloads
    assert not LayerwiseMode("offload").loads and LayerwiseMode("offload").offloads
    assert not LayerwiseMode("off").loads and not LayerwiseMode("off").offloads
    with pytest.raises(ValueError):
        LayerwiseMode("sometimes")


def test_load_lands_layer_by_layer_when_the_layer_is_read():
    pipe, kv, host = make_pipeline()
    slots = torch.tensor([9, 3, 40, 41, 17, 5, 6, 63])  # two chunks, scattered
    settled = []
    pipe.submit_load(slots, [4, 1], on_settled=lambda: settled.append(True))
    expected = {(layer, i): torch.cat([host_rows(host, 4, layer, i), host_rows(host, 1, layer, i)])
                for layer in range(LAYERS) for i in (0, 1)}
    assert not torch.equal(kv[0][0][slots], expected[(0, 0)])  # nothing moved yet
    pipe.wait_until(0)  # the forward reads layer 0
    assert torch.equal(kv[0][0][slots], expected[(0, 0)])
    assert torch.equal(kv[0][1][slots], expected[(0, 1)])
    assert not torch.equal(kv[1][0][slots], expected[(1, 0)])  # layer 1 still in flight
    assert not settled
    pipe.settle()  # completes the rest and runs the callback once
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][0][slots], expected[(layer, 0)])
        assert torch.equal(kv[layer][1][slots], expected[(layer, 1)])
    assert settled == [True] and not pipe.busy
    pipe.settle()
    assert settled == [True]


def test_offload_waits_for_its_forward_then_copies_each_layer_as_written():
    pipe, kv, host = make_pipeline()
    slots = torch.tensor([7, 8, 9, 30])
    settled = []
    pipe.plan_offload(slots, [2], on_settled=lambda: settled.append(True))
    pipe.settle()  # before the forward: the new KV does not exist yet, nothing may be copied
    assert not settled and pipe.planned_chunks == 1
    pipe.begin_forward()
    for layer in range(LAYERS):
        kv[layer][0][slots] = float(layer + 1)  # the forward writes layer `layer`
        kv[layer][1][slots] = -float(layer + 1)
        pipe.on_layer_written(layer)
        assert torch.all(host_rows(host, 2, layer, 0) == layer + 1)
        assert torch.all(host_rows(host, 2, layer, 1) == -(layer + 1))
    pipe.settle()
    assert settled == [True] and pipe.planned_chunks == 0 and not pipe.busy


def test_settle_finishes_an_offload_whose_layers_were_written_without_the_hook():
    pipe, kv, host = make_pipeline()
    slots = torch.tensor([1, 2, 3, 4])
    pipe.plan_offload(slots, [0])
    pipe.begin_forward()
    pipe.on_layer_written(0)
    for layer in range(LAYERS):  # e.g. a graph replay wrote layers 1.. without Python calls
        kv[layer][0][slots] = 5.0
        kv[layer][1][slots] = 6.0
    pipe.settle()
    for layer in range(1, LAYERS):
        assert torch.all(host_rows(host, 0, layer, 0) == 5.0)
        assert torch.all(host_rows(host, 0, layer, 1) == 6.0)


def test_copy_now_round_trip():
    pipe, kv, host = make_pipeline()
    src, dst = torch.tensor([0, 1, 2, 3]), torch.tensor([50, 52, 54, 56])
    pipe.copy_now(Direction.DEVICE_TO_HOST, src, [5])
    pipe.copy_now(Direction.HOST_TO_DEVICE, dst, [5])
    for k, v in kv:
        assert torch.equal(k[dst], k[src]) and torch.equal(v[dst], v[src])
    assert not pipe.busy


def test_layer_count_must_match_the_host_layout():
    _, kv, _ = make_pipeline()
    with pytest.raises(ValueError, match="layers"):
        LayerwiseTransfer(kv[:2], torch.empty(0, dtype=torch.uint8), HostChunkLayout(1, LAYERS, CHUNK, 64))
