"""The effects executor: orders wait for their host slot's copies, kept reads are reordered or
cancelled in place, and a step's effects run in the state's order.

The transfer engine here only answers ``host_slot_ready`` (on the CPU every copy completes
inline, so the real engine never keeps an order back: this is the CUDA path's logic, run on
the CPU), and the I/O process is a recorder of what was submitted to it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pcr_sglang.core.effects import Effects
from pcr_sglang.core.orders import DeleteChunk, IoOutcome, ReadChunk, Reorder, WriteChunk
from pcr_sglang.sglang_adapter.executor import EffectsExecutor


class SlowCopies:
    """Host slots whose copies are still running, and the calls the executor made."""

    def __init__(self) -> None:
        self.busy: set[int] = set()
        self.calls: list[str] = []

    def host_slot_ready(self, slot: int) -> bool:
        return slot not in self.busy

    def copy_to_host(self, device: torch.Tensor, host_slots: list[int]) -> None:
        self.calls.append(f"copy {host_slots}")

    def fence_before_reuse(self) -> None:
        self.calls.append("fence")


class Recorder:
    def __init__(self) -> None:
        self.sent: list = []

    def submit(self, order) -> None:
        self.sent.append(order)


class Allocator:
    def __init__(self, engine: SlowCopies) -> None:
        self.engine = engine

    def free_segment(self, slots, start_pos: int = 0) -> None:
        self.engine.calls.append(f"free {slots.tolist()}")


def executor() -> tuple[EffectsExecutor, SlowCopies, Recorder]:
    engine, io = SlowCopies(), Recorder()
    state = SimpleNamespace(chunk_size=4)
    return EffectsExecutor(state, Allocator(engine), engine, io), engine, io


def test_an_order_waits_for_its_host_slots_copies_and_urgent_reads_go_first():
    ex, engine, io = executor()
    engine.busy = {1, 2, 3}
    ex.send(WriteChunk(1, b"k1", b"p", 1, 4, host_slot=1))
    ex.send(ReadChunk(2, b"k2", host_slot=2))
    ex.send(ReadChunk(3, b"k3", host_slot=3, urgent=True))
    ex.send(DeleteChunk(b"k4"))  # touches no slot: sent at once
    assert [type(o).__name__ for o in io.sent] == ["DeleteChunk"]
    engine.busy = {1}
    ex.send_deferred()
    assert [getattr(o, "seq", None) for o in io.sent[1:]] == [3, 2]  # the urgent read first
    engine.busy = set()
    ex.send_deferred()
    assert [getattr(o, "seq", None) for o in io.sent[3:]] == [1] and ex.deferred == []


def test_a_cancelled_kept_read_never_reaches_the_io_process_and_ends_cancelled():
    ex, engine, io = executor()
    engine.busy = {5, 6}
    ex.send(ReadChunk(7, b"k7", host_slot=5))
    ex.send(ReadChunk(8, b"k8", host_slot=6))
    ex.send(Reorder(7, cancel=True))
    ex.send(Reorder(8, cancel=False))
    assert io.sent == []  # both reorders applied here: the I/O process never saw the reads
    assert ex.finished == {7: (IoOutcome.CANCELLED, 0.0)}
    engine.busy = set()
    ex.send_deferred()
    assert [(o.seq, o.urgent) for o in io.sent] == [(8, True)]


def test_a_reorder_for_a_sent_read_goes_to_the_io_process():
    ex, engine, io = executor()
    ex.send(ReadChunk(9, b"k9", host_slot=1))
    ex.send(Reorder(9, cancel=True))
    assert [type(o).__name__ for o in io.sent] == ["ReadChunk", "Reorder"] and ex.finished == {}


def test_effects_run_copies_then_fenced_frees_then_orders():
    ex, engine, io = executor()
    effects = Effects()
    node = object()  # a chunk of the tree (only its identity matters here)
    effects.demotions[node] = (torch.tensor([4, 5, 6, 7]), 3)
    effects.device_frees.append(torch.tensor([4, 5, 6, 7]))
    effects.orders.append(DeleteChunk(b"k"))
    ex.execute(effects)
    assert engine.calls == ["copy [3]", "fence", "free [4, 5, 6, 7]"] and len(io.sent) == 1
