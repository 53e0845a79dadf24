"""The transfer engine's CUDA branch on CPU, checked by what it calls (issue: the first GPU
run made boring). The engine runs with :class:`CudaStreams` over a recording stand-in for
``torch.cuda`` (:mod:`tests.unit.transfer.cuda_recorder`), the copy and rotation kernels
replaced by recorders of their launches. A step (host-hit loads, re-placements of 16
documents, offloads written layer by layer) must make no event and no pinned allocation
(all made once, at construction), no synchronization, no host read of a tensor, and send
its indices with non-blocking copies from the pinned ring. Nothing here ran on a GPU."""

from __future__ import annotations

import pytest
import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer import engine as engine_module
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec
from pcr_sglang.transfer.staging import PinnedStaging
from pcr_sglang.transfer.streams import CudaStreams
from tests.unit.transfer.cuda_recorder import HostTraffic, RecordingCuda

LAYERS, CHUNK, HEADS, DIM, TOKENS, SLOTS, DOCS = 8, 4, 2, 8, 512, 40, 16
ROPE = RopeSpec(DIM, DIM, True, (1.0, 0.1, 0.01, 0.001))


@pytest.fixture
def rig(monkeypatch):
    cuda = RecordingCuda()
    launches: list[tuple[str, int]] = []
    monkeypatch.setattr(engine_module, "copy_layer", lambda d, k, v, h, ts, hs, layer, lay: launches.append(
        ("copy", layer)))
    monkeypatch.setattr(engine_module, "replace_layer", lambda k, v, s, d, delta, rope, verify_slots: launches.append(
        ("rope", [i for i, (kk, _) in enumerate(kv) if kk is k][0])))
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    kv = [(torch.zeros(TOKENS, HEADS, DIM), torch.zeros(TOKENS, HEADS, DIM)) for _ in range(LAYERS)]
    layout = HostChunkLayout(SLOTS, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    streams = CudaStreams(torch.device("cpu"), events_per_stream=4 * LAYERS + 16, cuda=cuda, pin=cuda.pin)
    engine = TransferEngine(kv, host, layout, LayerwiseMode.BOTH, streams=streams)
    return cuda, engine, launches


def one_step(engine: TransferEngine, step: int) -> None:
    """What the scheduler and the forward call in one step with host hits and 16 documents."""
    base = 64 + (step % 4) * 96
    for i in range(4):  # host hits: four chunks loaded
        engine.load(torch.arange(base + i * CHUNK, base + (i + 1) * CHUNK), [i])
    for doc in range(DOCS):  # 16 documents re-placed into private slots
        src = torch.arange(doc * 2, doc * 2 + 2)
        dst = torch.arange(400 + doc * 2, 400 + doc * 2 + 2)
        engine.replace(src, dst, torch.full((2,), 3, dtype=torch.int64), ROPE)
    engine.plan_offload("r", torch.arange(base + 16, base + 16 + CHUNK), 10 + step % 8)
    engine.note_forward_stream()
    engine.begin_batch(["r"])
    for layer in range(LAYERS):
        engine.wait_until(layer)
        engine.on_layer_written(layer)
    engine.end_batch()
    engine.fence_before_reuse()
    for slot in range(SLOTS):
        engine.host_slot_ready(slot)


def test_a_step_makes_no_event_no_pinned_memory_no_sync_and_no_host_read(rig):
    cuda, engine, launches = rig
    made, pinned = cuda.events_made, len(cuda.pinned)
    assert pinned == 1  # the staging ring, at construction
    one_step(engine, 0)  # the first step may make the compute stream's event ring (once)
    made = cuda.events_made
    traffic = HostTraffic(cuda)
    with traffic:
        for step in range(1, 6):
            one_step(engine, step)
    assert cuda.events_made == made, "events made per step (per layer or per transfer)"
    assert len(cuda.pinned) == pinned, "pinned memory allocated in a step"
    assert cuda.synchronizations == 0
    assert traffic.host_reads == []
    staged = [c for c in traffic.copies if c[2]]
    assert len(staged) == 5 * 5  # four loads and one offload plan per step, each one copy
    assert all(non_blocking for _, non_blocking, _ in staged)
    assert engine._streams.staging.overflows == 0
    for kind in ("copy", "rope"):  # every layer launched
        assert {layer for k, layer in launches if k == kind} == set(range(LAYERS))


def test_events_are_reused_in_turn_per_stream():
    cuda = RecordingCuda()
    streams = CudaStreams(torch.device("cpu"), events_per_stream=3, cuda=cuda, pin=cuda.pin)
    side = streams.new_stream("pcr-copy")
    made = cuda.events_made
    events = [streams.record_event(side) for _ in range(7)]
    assert cuda.events_made == made
    assert events[0] is events[3] is events[6] and events[1] is events[4] and events[0] is not events[1]
    other = streams.new_stream("pcr-replace")
    assert streams.record_event(other) not in events  # a ring per stream: never re-recorded elsewhere


def test_a_staging_region_is_written_again_only_after_its_copy_completed():
    cuda = RecordingCuda(complete=False)
    events = []

    def record():
        event = cuda.Event()
        events.append(event)
        return event

    staging = PinnedStaging(torch.device("cpu"), cuda.pin, record, capacity=8)
    first = staging.to_device([1, 2, 3, 4, 5])
    assert first.tolist() == [1, 2, 3, 4, 5] and len(cuda.pinned) == 1
    second = staging.to_device([6, 7, 8])  # fits behind the first
    assert second.tolist() == [6, 7, 8] and staging.overflows == 0
    third = staging.to_device([9, 10])  # wraps onto the first's region, still in flight
    assert third.tolist() == [9, 10] and staging.overflows == 1 and len(cuda.pinned) == 2
    assert cuda.pinned[0][:5].tolist() == [1, 2, 3, 4, 5]  # the region in flight was not overwritten
    cuda.complete = True
    fourth = staging.to_device([11, 12])
    assert fourth.tolist() == [11, 12] and staging.overflows == 1 and len(cuda.pinned) == 2
    assert cuda.pinned[0][:2].tolist() == [11, 12]
