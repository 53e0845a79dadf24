"""``--pcr-debug-checks``: the slot bounds the CPU path raises on, checked on the device too
in the engine's CUDA branch (device-side asserts queued without a host wait). Run on CPU
with the recording stand-in for ``torch.cuda``: there ``torch._assert_async`` raises at
once; on a GPU the same verdict fails at the next synchronization. Nothing here ran on a
GPU."""

from __future__ import annotations

import pytest
import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer import engine as engine_module
from pcr_sglang.transfer import replacements as replacements_module
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec
from pcr_sglang.transfer.streams import CudaStreams
from tests.unit.transfer.cuda_recorder import HostTraffic, RecordingCuda

LAYERS, CHUNK, HEADS, DIM, TOKENS, SLOTS = 3, 4, 2, 8, 64, 6
ROPE = RopeSpec(DIM, DIM, True, (1.0, 0.1, 0.01, 0.001))


def make(debug: bool, monkeypatch) -> tuple[RecordingCuda, TransferEngine]:
    cuda = RecordingCuda()
    monkeypatch.setattr(engine_module, "copy_layer", lambda *a: None)  # kernel launches: not the point here
    monkeypatch.setattr(replacements_module, "replace_layer", lambda *a, **k: None)
    kv = [(torch.zeros(TOKENS, HEADS, DIM), torch.zeros(TOKENS, HEADS, DIM)) for _ in range(LAYERS)]
    layout = HostChunkLayout(SLOTS, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    streams = CudaStreams(torch.device("cpu"), cuda=cuda, pin=cuda.pin)
    return cuda, TransferEngine(kv, host, layout, LayerwiseMode.BOTH, streams=streams, debug_checks=debug)


BAD_REPLACEMENTS = [
    ("outside the KV pool", torch.tensor([1, 2]), torch.tensor([10, TOKENS])),
    ("appears twice", torch.tensor([1, 2]), torch.tensor([10, 10])),
    ("overlap", torch.tensor([1, 2]), torch.tensor([2, 11])),
]


@pytest.mark.parametrize("message, src, dst", BAD_REPLACEMENTS, ids=[b[0] for b in BAD_REPLACEMENTS])
def test_a_bad_replacement_is_an_error_with_the_flag_and_unchecked_without(monkeypatch, message, src, dst):
    _, checked = make(True, monkeypatch)
    with pytest.raises(RuntimeError, match=message):
        checked.replace(src, dst, torch.zeros(2, dtype=torch.int64), ROPE)
    _, unchecked = make(False, monkeypatch)
    unchecked.replace(src, dst, torch.zeros(2, dtype=torch.int64), ROPE)  # the flag's cost is opt-in


def test_a_copy_outside_either_pool_is_an_error_with_the_flag(monkeypatch):
    _, checked = make(True, monkeypatch)
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        checked.load(torch.arange(TOKENS - 2, TOKENS + 2), [0])
    with pytest.raises(RuntimeError, match="outside the host pool"):
        checked.load(torch.arange(0, CHUNK), [SLOTS])
    with pytest.raises(ValueError, match="device token slots for 1 chunks"):
        checked.plan_offload("r", torch.arange(0, CHUNK + 1), 1)
    _, unchecked = make(False, monkeypatch)
    unchecked.load(torch.arange(0, CHUNK), [SLOTS])  # unchecked: the slip would reach the kernel


def test_the_checks_wait_for_nothing_on_the_host(monkeypatch):
    cuda, checked = make(True, monkeypatch)
    traffic = HostTraffic(cuda)
    with traffic:
        checked.load(torch.arange(8, 8 + CHUNK), [1])
        checked.replace(torch.tensor([1, 2]), torch.tensor([30, 31]), torch.zeros(2, dtype=torch.int64), ROPE)
        checked.plan_offload("r", torch.arange(40, 40 + CHUNK), 2)
    assert traffic.host_reads == [] and cuda.synchronizations == 0
