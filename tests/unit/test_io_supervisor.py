"""The I/O process's supervisor never makes the scheduler wait: a stopped or dead process is
killed, its orders come back cancelled once it is gone, and a new one starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pcr_sglang.io.protocol import IoOutcome, ReadChunk, Reorder, WorkerConfig, WriteChunk
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_sglang.transfer.layout import HostChunkLayout

LAYOUT = HostChunkLayout(num_slots=4, num_layers=2, chunk_size=4, row_bytes=16)


@pytest.fixture
def supervisor(tmp_path, request):
    faults = getattr(request, "param", None)
    if faults:
        os.environ["PCR_IO_TEST_FAULTS"] = faults  # read by the I/O process at its start
    pool = HostChunkPool(LAYOUT, pin=False)
    store = ChunkFileStore(tmp_path / "store", bytes(16), LAYOUT, "float32", 1 << 20, low_watermark_bytes=0)
    sup = IOSupervisor(WorkerConfig(
        store_root=str(store.root), namespace_hex=store.namespace.hex(), dtype="float32",
        num_slots=LAYOUT.num_slots, num_layers=LAYOUT.num_layers, chunk_size=LAYOUT.chunk_size,
        row_bytes=LAYOUT.row_bytes, reserve_bytes=0, shm_name=pool.info().shm_name, orders_endpoint="",
        replies_endpoint="", parent_pid=0), stall_timeout_s=0.5)
    assert sup.wait_ready(30)
    os.environ.pop("PCR_IO_TEST_FAULTS", None)
    yield sup, pool
    sup.close()
    pool.close()


def poll_until(sup, predicate, timeout_s: float = 30.0):
    """Poll as the scheduler does each step; returns what came back and the slowest poll."""
    outcomes, slowest = [], 0.0
    deadline = time.monotonic() + timeout_s
    while not predicate(outcomes):
        assert time.monotonic() < deadline, "timed out"
        start = time.perf_counter()
        outcomes += sup.poll()
        slowest = max(slowest, time.perf_counter() - start)
        time.sleep(0.01)
    return outcomes, slowest


def test_orders_complete_with_their_outcome(supervisor):
    sup, pool = supervisor
    sup.submit(WriteChunk(1, b"k" * 16, bytes(16), 1, 4, 2))
    sup.submit(ReadChunk(2, b"k" * 16, 3))
    sup.submit(ReadChunk(3, b"missing-chunk!!!", 0))
    outcomes, _ = poll_until(sup, lambda o: len(o) == 3)
    by_seq = {seq: outcome for seq, outcome, _ in outcomes}
    assert by_seq[1] is IoOutcome.OK and by_seq[3] is IoOutcome.BAD
    assert by_seq[2] in (IoOutcome.OK, IoOutcome.BAD)  # reads go before writes: it may not exist yet


@pytest.mark.parametrize("supervisor", ['{"read_delay_s": 0.3}'], indirect=True)
def test_a_queued_read_a_request_waited_for_can_be_cancelled(supervisor):
    """Once the request that waited for them is gone, its queued urgent reads are cancelled
    (the worker sees the cancel before it starts them: one socket, in order)."""
    sup, _ = supervisor
    for seq in (1, 2, 3):
        sup.submit(ReadChunk(seq, b"missing-chunk!!!", seq, True))
    sup.submit(Reorder(3, cancel=True))
    outcomes, _ = poll_until(sup, lambda o: len(o) == 3)
    by_seq = {seq: outcome for seq, outcome, _ in outcomes}
    assert by_seq == {1: IoOutcome.BAD, 2: IoOutcome.BAD, 3: IoOutcome.CANCELLED}


def test_a_stopped_process_is_killed_and_replaced_and_no_poll_waits(supervisor):
    sup, _ = supervisor
    pid = sup.pid
    os.kill(pid, signal.SIGSTOP)
    sup.submit(ReadChunk(1, b"k" * 16, 0))  # never answered
    outcomes, slowest = poll_until(sup, lambda o: o)
    assert outcomes == [(1, IoOutcome.CANCELLED, 0.0)]  # only once the process was gone
    assert sup.failures == 1 and not sup.healthy
    sup.submit(ReadChunk(2, b"k" * 16, 0))  # no process: cancelled, not sent
    assert sup.poll() == [(2, IoOutcome.CANCELLED, 0.0)]
    _, slowest_restart = poll_until(sup, lambda o: sup.healthy)
    assert sup.pid != pid and sup.restarts == 1
    assert max(slowest, slowest_restart) < 0.2  # every poll returned at once
    sup.submit(WriteChunk(3, b"k" * 16, bytes(16), 1, 4, 1))
    outcomes, _ = poll_until(sup, lambda o: o)
    assert outcomes[0][:2] == (3, IoOutcome.OK)


def test_orders_of_a_killed_process_stay_outstanding_until_it_is_gone(supervisor, monkeypatch):
    """A process stuck in the kernel (say, uninterruptible disk I/O) does not die at once:
    its orders, and the host slots they name, must not come back before it has."""
    sup, _ = supervisor
    os.kill(sup.pid, signal.SIGSTOP)
    sup.submit(ReadChunk(1, b"k" * 16, 0))
    proc = sup._proc
    real_poll = proc.poll
    monkeypatch.setattr(proc, "poll", lambda: None)  # SIGKILL has not taken effect yet
    deadline = time.monotonic() + 10
    while sup.phase != "dying":
        assert time.monotonic() < deadline
        assert sup.poll() == []
        time.sleep(0.05)
    for _ in range(20):  # killed, not gone: nothing is cancelled, nothing waits
        start = time.perf_counter()
        assert sup.poll() == [] and not sup.healthy
        assert time.perf_counter() - start < 0.2
    monkeypatch.setattr(proc, "poll", real_poll)
    outcomes, _ = poll_until(sup, lambda o: o)
    assert outcomes == [(1, IoOutcome.CANCELLED, 0.0)]
