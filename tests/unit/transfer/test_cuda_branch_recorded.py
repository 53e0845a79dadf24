"""The transfer engine's CUDA branch on CPU, checked by what it calls (issue: the first GPU
run made boring). The engine runs with :class:`CudaStreams` over a recording stand-in for
``torch.cuda`` (:mod:`tests.unit.transfer.cuda_recorder`), the copy and rotation kernels
replaced by recorders of their launches. A step (host-hit loads, re-placements of 16
documents, offloads written layer by layer) must make no event and no pinned allocation
(all made once, at construction), no synchronization, no host read of a tensor, and send
its indices with non-blocking copies from the pinned ring. Nothing here ran on a GPU."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer import engine as engine_module
from pcr_sglang.transfer import replacements as replacements_module
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec
from pcr_sglang.transfer.staging import PinnedStaging
from pcr_sglang.transfer.streams import CudaStreams
from pcr_sglang.transfer.warmup import warm_up_on_cuda
from tests.unit.transfer.cuda_recorder import HostTraffic, RecordingCuda

LAYERS, CHUNK, HEADS, DIM, TOKENS, SLOTS, DOCS = 8, 4, 2, 8, 512, 40, 16
ROPE = RopeSpec(DIM, DIM, True, (1.0, 0.1, 0.01, 0.001))


@pytest.fixture
def rig(monkeypatch):
    cuda = RecordingCuda()
    launches: list[tuple[str, int]] = []
    monkeypatch.setattr(
        engine_module, "copy_layer", lambda d, k, v, h, ts, hs, layer, lay: launches.append(("copy", layer))
    )
    monkeypatch.setattr(
        replacements_module,
        "replace_layer",
        lambda k, v, s, d, delta, rope, verify_slots: launches.append(
            ("rope", [i for i, (kk, _) in enumerate(kv) if kk is k][0])
        ),
    )
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    kv = [(torch.zeros(TOKENS, HEADS, DIM), torch.zeros(TOKENS, HEADS, DIM)) for _ in range(LAYERS)]
    layout = HostChunkLayout(SLOTS, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    streams = CudaStreams(torch.device("cpu"), events_per_stream=4 * LAYERS + 16, cuda=cuda, pin=cuda.pin)
    engine = TransferEngine(kv, host, layout, LayerwiseMode.BOTH, streams=streams)
    return cuda, engine, launches


def one_step(engine: TransferEngine, step: int, offloads: int = 1, traffic: Optional[HostTraffic] = None) -> None:
    """What the scheduler and the forward call in one step with host hits and 16 documents
    (``offloads`` chunks written layer by layer; ``traffic``'s phase names the layer while
    the forward's per-layer hooks run: "layer 0", ...)."""
    base = 64 + (step % 4) * 96
    for i in range(4):  # host hits: four chunks loaded
        engine.load(torch.arange(base + i * CHUNK, base + (i + 1) * CHUNK), [i])
    for doc in range(DOCS):  # 16 documents re-placed into private slots
        src = torch.arange(doc * 2, doc * 2 + 2)
        dst = torch.arange(400 + doc * 2, 400 + doc * 2 + 2)
        engine.replace(src, dst, torch.full((2,), 3, dtype=torch.int64), ROPE)
    for i in range(offloads):
        start = base + 16 + i * CHUNK
        engine.plan_offload("r", torch.arange(start, start + CHUNK), 10 + (step * offloads + i) % 16)
    engine.note_forward_stream()
    engine.begin_batch(["r"])
    for layer in range(LAYERS):
        if traffic is not None:
            traffic.phase = f"layer {layer}"
        engine.wait_until(layer)
        engine.on_layer_written(layer)
    if traffic is not None:
        traffic.phase = ""
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


def test_a_step_uploads_nothing_from_pageable_memory_and_allocates_nothing_per_layer(rig):
    """Every host-to-device copy of the step reads pinned memory (a pageable one is a
    synchronous copy on a GPU); the forward's per-layer hooks make no event and no pinned
    buffer, and no tensor past layer 0 (two offloads per step: their merged index pair is
    made once, at the first layer, and serves every layer)."""
    cuda, engine, launches = rig
    one_step(engine, 0, offloads=2)
    made, pinned = cuda.events_made, len(cuda.pinned)
    traffic = HostTraffic(cuda)
    with traffic:
        for step in range(1, 6):
            one_step(engine, step, offloads=2, traffic=traffic)
    assert traffic.uploads and traffic.pageable_uploads == []
    per_layer = [a for a in traffic.allocations if a[0].startswith("layer ")]
    assert per_layer == [("layer 0", "cat")] * 2 * 5, "tensors made per layer"
    assert cuda.events_made == made and len(cuda.pinned) == pinned
    assert cuda.synchronizations == 0 and traffic.host_reads == []


def _kernel_key(kernel: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a launch compiles for, as Triton specializes these kernels: the dtypes of the
    tensor operands and the compile-time constants (direction, layout, RoPE), not the layer
    index nor the slot values (the kernels do not specialize on them; that part is checked
    on a GPU by tests/kernels/test_warmup_triton.py)."""
    if kernel == "copy":
        direction, k, v, host, token_slots, host_slots, _layer, layout = args
        return (
            "copy",
            int(direction),
            k.dtype,
            v.dtype,
            tuple(k.shape[1:]),
            getattr(host, "dtype", type(host).__name__),
            token_slots.dtype,
            host_slots.dtype,
            layout,
        )
    k, v, src, dst, delta, rope = args
    return ("rope", k.dtype, v.dtype, tuple(k.shape[1:]), src.dtype, dst.dtype, delta.dtype, rope.signature())


def test_a_step_launches_only_kernels_the_warm_up_compiled(monkeypatch):
    """The startup warm-up's launches (``warm_up_on_cuda`` on the same engine and pools) are
    the compiled set; every kernel launch of the step must be one of them: a launch with
    another specialization would compile in the scheduler thread (seconds on a GPU)."""
    cuda = RecordingCuda()
    compiled: set[tuple[Any, ...]] = set()
    uncompiled: list[tuple[Any, ...]] = []

    def copy(*args: Any) -> None:
        key = _kernel_key("copy", args)
        if key not in compiled:
            uncompiled.append(key)

    def rotate(k, v, src, dst, delta, rope, use_triton=True, verify_slots=True) -> None:
        key = _kernel_key("rope", (k, v, src, dst, delta, rope))
        if key not in compiled:
            uncompiled.append(key)

    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    kv = [(torch.zeros(TOKENS, HEADS, DIM), torch.zeros(TOKENS, HEADS, DIM)) for _ in range(LAYERS)]
    layout = HostChunkLayout(SLOTS, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    streams = CudaStreams(torch.device("cpu"), events_per_stream=4 * LAYERS + 16, cuda=cuda, pin=cuda.pin)
    engine = TransferEngine(kv, host, layout, LayerwiseMode.BOTH, streams=streams)
    report = warm_up_on_cuda(
        engine=engine,
        kv_layers=kv,
        rope=ROPE,
        on_cuda=True,
        copy=lambda *a: compiled.add(_kernel_key("copy", a)),
        rotate=lambda k, v, s, d, delta, rope, **kw: compiled.add(_kernel_key("rope", (k, v, s, d, delta, rope))),
        synchronize=lambda: None,
    )
    assert report is not None and compiled
    monkeypatch.setattr(engine_module, "copy_layer", copy)
    monkeypatch.setattr(replacements_module, "replace_layer", rotate)
    for step in range(3):
        one_step(engine, step, offloads=2)
    assert uncompiled == []


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
