"""The I/O process's supervisor never makes the scheduler wait: a stopped or dead process is
killed, its orders come back cancelled once it is gone, and a new one starts."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import msgspec
import pytest

from pcr_sglang.core.orders import DeleteChunk, IoOutcome, ReadChunk, Reorder, WriteChunk
from pcr_sglang.io.readers import BusyClock
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from tests.unit.io_config import io_config

LAYOUT = HostChunkLayout(num_slots=4, num_layers=2, chunk_size=4, row_bytes=16)


@pytest.fixture
def supervisor(tmp_path, request):
    """``request.param``: the test-fault JSON, or (that JSON, reader threads)."""
    param = getattr(request, "param", None)
    faults, read_threads = param if isinstance(param, tuple) else (param, 4)
    if faults:
        os.environ["PCR_IO_TEST_FAULTS"] = faults  # read by the I/O process at its start
    pool = HostChunkPool(LAYOUT, pin=False)
    store = ChunkFileStore(tmp_path / "store", bytes(16), LAYOUT, "float32", 1 << 20, low_watermark_bytes=0)
    sup = IOSupervisor(
        io_config(
            pool,
            store.root,
            store.namespace.hex(),
            "float32",
            read_threads=read_threads,
        ),
        stall_timeout_s=0.5,
    )
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
    assert by_seq[2] in (IoOutcome.OK, IoOutcome.BAD)  # a read may start before the write lands


@pytest.mark.parametrize("supervisor", [('{"read_delay_s": 0.3}', 2)], indirect=True)
def test_a_queued_read_a_request_waited_for_can_be_cancelled(supervisor):
    """Once the request that waited for them is gone, its queued urgent reads are cancelled
    (two reader threads take reads 1 and 2; read 3 waits for one of them for 0.3 s, and the
    cancel sent right after it arrives meanwhile)."""
    sup, _ = supervisor
    for seq in (1, 2, 3):
        sup.submit(ReadChunk(seq, b"missing-chunk!!!", seq, True))
    sup.submit(Reorder(3, cancel=True))
    outcomes, _ = poll_until(sup, lambda o: len(o) == 3)
    by_seq = {seq: outcome for seq, outcome, _ in outcomes}
    assert by_seq == {1: IoOutcome.BAD, 2: IoOutcome.BAD, 3: IoOutcome.CANCELLED}


@pytest.mark.parametrize("supervisor", [('{"read_rendezvous": 4}', 4)], indirect=True)
def test_reads_run_in_parallel_on_the_reader_threads(supervisor):
    """Four reads, urgent and prefetch, are in flight at once: each waits until all four
    run and fails if they never do, whatever the machine's speed. (With one reader thread
    this goes red: nothing is answered, and the supervisor kills the process.)"""
    sup, pool = supervisor
    pool.slot_view(0).fill_(7)
    sup.submit(WriteChunk(1, b"k" * 16, bytes(16), 1, 4, 0))
    outcomes, _ = poll_until(sup, lambda o: len(o) == 1)
    assert outcomes[0][1] is IoOutcome.OK
    for slot in range(4):
        pool.slot_view(slot).zero_()
    for seq, slot in ((2, 0), (3, 1), (4, 2), (5, 3)):
        sup.submit(ReadChunk(seq, b"k" * 16, slot, urgent=seq % 2 == 0))
    outcomes, _ = poll_until(sup, lambda o: len(o) == 4)
    assert {seq: outcome for seq, outcome, _ in outcomes} == {seq: IoOutcome.OK for seq in range(2, 6)}
    assert all((pool.slot_view(slot) == 7).all() for slot in range(4))


@pytest.mark.parametrize("supervisor", ['{"read_delay_s": 0.3}'], indirect=True)
def test_a_delete_waits_for_the_read_of_its_chunk_ordered_before_it(supervisor):
    """Deletes run on the main thread while reads run on theirs; one ordered after a
    read of the same chunk still comes after it (the first read finds the record, the
    read ordered after the delete does not)."""
    sup, pool = supervisor
    sup.submit(WriteChunk(1, b"k" * 16, bytes(16), 1, 4, 0))
    assert poll_until(sup, lambda o: len(o) == 1)[0][0][1] is IoOutcome.OK
    sup.submit(ReadChunk(2, b"k" * 16, 1))
    sup.submit(DeleteChunk(b"k" * 16))
    sup.submit(ReadChunk(3, b"k" * 16, 2))
    outcomes, _ = poll_until(sup, lambda o: len(o) == 2)
    assert {seq: outcome for seq, outcome, _ in outcomes} == {2: IoOutcome.OK, 3: IoOutcome.BAD}


@pytest.mark.parametrize("supervisor", ['{"read_delay_s": 5}'], indirect=True)
def test_a_hung_read_gets_the_process_replaced_while_its_writes_still_answer(supervisor):
    """One reader thread stuck (a hung disk) while the main thread keeps answering writes:
    the supervisor hears from the process all along, so the process itself must exit,
    and the stuck read comes back cancelled once it is gone."""
    sup, _ = supervisor
    pid = sup.pid
    sup.submit(ReadChunk(1, b"missing-chunk!!!", 0, True))
    outcomes, seq = [], 100
    deadline = time.monotonic() + 4.5  # before the read's 5 s would be over
    while not any(s == 1 for s, _, _ in outcomes):
        assert time.monotonic() < deadline, "the hung read was never given up on"
        if sup.healthy:
            sup.submit(WriteChunk(seq, seq.to_bytes(16, "little"), bytes(16), 1, 4, 1))
            seq += 1
        outcomes += sup.poll()
        time.sleep(0.1)
    assert (1, IoOutcome.CANCELLED, 0.0) in outcomes
    assert sum(1 for s, o, _ in outcomes if s >= 100 and o is IoOutcome.OK) >= 3  # it was heard meanwhile
    _, _ = poll_until(sup, lambda o: sup.healthy)
    assert sup.pid != pid and sup.restarts == 1


def test_a_read_is_timed_as_its_share_of_the_disks_busy_time():
    """Three reads of 20 ms that overlap cost the run's 22 ms together; a read after an
    idle gap costs all of its own time."""
    clock = BusyClock()
    shares = [clock.share(0.000, 0.020), clock.share(0.001, 0.021), clock.share(0.002, 0.022)]
    assert shares == pytest.approx([0.020, 0.001, 0.001])
    assert clock.share(0.100, 0.120) == pytest.approx(0.020)
    assert clock.share(0.090, 0.110) == 0.0  # finished before the last completion: no new busy time


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


def test_a_restart_keeps_the_orders_of_a_process_that_does_not_exit_until_it_has(supervisor, tmp_path, monkeypatch):
    """A restart onto another store (the weights changed) whose old process does not exit
    after SIGKILL (a read stuck in uninterruptible disk I/O) must not hand back its orders,
    and with them their host slots, before the kernel confirms the exit; the process on
    the new store starts then, and serves it."""
    sup, pool = supervisor
    os.kill(sup.pid, signal.SIGSTOP)
    sup.submit(ReadChunk(1, b"k" * 16, 0))  # never answered
    old = sup._proc
    real_poll, real_wait = old.poll, old.wait

    def stuck_wait(timeout=None):
        raise subprocess.TimeoutExpired(old.args, timeout)

    monkeypatch.setattr(old, "poll", lambda: None)  # SIGKILL has not taken effect yet
    monkeypatch.setattr(old, "wait", stuck_wait)
    sup.exit_wait_s = 0.1
    new_store = ChunkFileStore(
        tmp_path / "new-store", bytes(15) + b"\x01", LAYOUT, "float32", 1 << 20, low_watermark_bytes=0
    )
    config = msgspec.structs.replace(
        sup.config, store_root=str(new_store.root), namespace_hex=new_store.namespace.hex()
    )
    assert sup.restart(config) is False and sup.phase == "dying"
    for _ in range(20):  # killed, not gone: nothing is cancelled, nothing waits, no second process
        start = time.perf_counter()
        assert sup.poll() == [] and not sup.healthy and sup._proc is old
        assert time.perf_counter() - start < 0.2
    monkeypatch.setattr(old, "poll", real_poll)
    monkeypatch.setattr(old, "wait", real_wait)
    outcomes, _ = poll_until(sup, lambda o: o)
    assert outcomes == [(1, IoOutcome.CANCELLED, 0.0)]
    poll_until(sup, lambda o: sup.healthy, timeout_s=30)
    assert sup._proc is not old
    pool.slot_view(2).fill_(5)
    sup.submit(WriteChunk(2, b"n" * 16, bytes(16), 1, 4, 2))
    outcomes, _ = poll_until(sup, lambda o: o)
    assert outcomes[0][:2] == (2, IoOutcome.OK)
    assert [r.key for r in new_store.scan()] == [b"n" * 16]  # the new process writes into the new store
