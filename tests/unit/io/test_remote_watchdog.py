"""The remote thread's watchdog: a remote-tier call that never returns fails its order, frees
its host slot, trips the breaker and gets the client restarted, and whatever the stuck call
brings back later is dropped; against a real ``mooncake_master`` and store process on
loopback (started once for the module).

The thread-level tests hang a call on an Event and drive the watchdog's clock, so nothing
depends on timing; the process-level test hangs every remote read for an hour
(``remote_read_delay_s``) while local SSD reads keep completing, and waits for conditions.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import zmq

from pcr_sglang.core.orders import IoOutcome, ProbeRemote, ReadChunk, WriteChunk
from pcr_sglang.io.process import MAX_HUNG_REMOTE_THREADS
from pcr_sglang.io.protocol import Done, Probed, RemoteStatus, reply_decoder
from pcr_sglang.io.remote_thread import RemoteThread
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import RecordCodec
from pcr_sglang.tiers.remote_store import ReadResult, RemoteChunkStore, RemoteConfig, load_fleet_key
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_tools.mooncake_services import MooncakeMaster, MooncakeStoreProcess, client_config, keygen
from tests.unit.io_config import io_config

LAYOUT = HostChunkLayout(num_slots=4, num_layers=2, chunk_size=4, row_bytes=32)
NAMESPACE = bytes(range(16))
WAIT_S = 30.0  # the most any condition below is waited for (a failure, not a pace)
# One context for the module's life, as the I/O process has: a thread left behind keeps its
# socket open, and terminating a context waits for every socket to close.
CTX = zmq.Context()


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(LAYOUT.slot_bytes))


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    logs = tmp_path_factory.mktemp("mooncake")
    master = MooncakeMaster(log_path=logs / "master.log")
    master.start()
    store = MooncakeStoreProcess(master, 32 << 20, log_path=logs / "store.log")
    try:
        store.start()
        yield master, keygen(logs / "fleet.key")
    finally:
        store.stop()
        master.stop()


def remote_config(mooncake) -> RemoteConfig:
    master, key_file = mooncake
    return RemoteConfig.parse(json.dumps(client_config(master, key_file)))


def new_store(mooncake, store_class=RemoteChunkStore) -> RemoteChunkStore:
    config = remote_config(mooncake)
    return store_class(config, RecordCodec(load_fleet_key(config.key_file), NAMESPACE, LAYOUT, "float32"))


class HangingStore(RemoteChunkStore):
    """The real store, except that ``read_into`` blocks until ``release`` is set (a call
    that does not return: a partition without a reset, a store that stops answering)."""

    entered = threading.Event()
    release = threading.Event()

    def read_into(self, key: bytes, out: memoryview) -> ReadResult:
        HangingStore.entered.set()
        HangingStore.release.wait()
        return super().read_into(key, out)


class Replies:
    """The scheduler's end of the replies socket."""

    def __init__(self):
        self.ctx = CTX
        self.pull = self.ctx.socket(zmq.PULL)
        self.endpoint = f"inproc://pcr-test-replies-{id(self)}"
        self.pull.bind(self.endpoint)
        self.got: list = []

    def until(self, want, timeout_s: float = WAIT_S) -> list:
        deadline = time.monotonic() + timeout_s
        while not want(self.got):
            assert time.monotonic() < deadline, f"no such reply in time; got {self.got}"
            if self.pull.poll(100):
                self.got.append(reply_decoder.decode(self.pull.recv()))
        return self.got

    def drain(self) -> list:
        while self.pull.poll(0):
            self.got.append(reply_decoder.decode(self.pull.recv()))
        return self.got


def answers(got, seq: int, kind=Done) -> list:
    return [r for r in got if isinstance(r, kind) and r.seq == seq]


def test_a_hung_call_fails_its_orders_and_its_late_result_is_dropped(mooncake):
    """A read blocks inside the store; a probe and another read queue behind it. Past its
    deadline (the watchdog's clock driven, not waited for) the thread is replaced: the
    hung read comes back BAD, the queued orders fail at once (the breaker is down), the
    successor's new client serves reads once the back-off is over, and when the stuck call
    finally returns, its OK result is dropped: no reply, no count, nothing in the host slot
    (which the scheduler may have given to another chunk meanwhile)."""
    writer = new_store(mooncake)
    writer.open()
    try:
        assert writer.write(key(1), writer.build_record(key(1), bytes(16), 1, LAYOUT.chunk_size, payload(1)))
    finally:
        writer.close()
    HangingStore.entered.clear()
    HangingStore.release.clear()
    replies = Replies()
    slots = [bytearray(LAYOUT.slot_bytes) for _ in range(LAYOUT.num_slots)]
    hung = RemoteThread(
        new_store(mooncake, HangingStore),
        replies.ctx,
        replies.endpoint,
        lambda i: memoryview(slots[i]),
        deadline_s=60.0,
        new_store=lambda: new_store(mooncake),
    )
    hung.start()
    successor = None
    try:
        replies.until(lambda g: any(isinstance(r, RemoteStatus) and r.healthy for r in g))
        assert hung.overdue_s(time.monotonic() + 3600) == 0.0  # connected and idle: nothing to time
        hung.read(ReadChunk(seq=1, key=key(1), host_slot=2, urgent=True))
        assert HangingStore.entered.wait(WAIT_S)
        hung.probe(ProbeRemote(2, [[key(1)]]))
        hung.read(ReadChunk(seq=3, key=key(1), host_slot=3))
        assert hung.overdue_s(time.monotonic()) == 0.0  # within its deadline
        assert hung.overdue_s(time.monotonic() + 61.0) > 60.0  # past it

        successor = hung.replace("a call did not return in 60 s")
        successor.start()
        got = replies.until(lambda g: answers(g, 1) and answers(g, 3) and answers(g, 2, Probed))
        assert answers(got, 1)[0].outcome == IoOutcome.BAD and "did not return" in answers(got, 1)[0].error
        assert answers(got, 3)[0].outcome == IoOutcome.BAD  # queued behind it: failed at once, breaker down
        assert answers(got, 2, Probed)[0].present == [0] and answers(got, 2, Probed)[0].error
        assert not successor.healthy and hung.overdue_s(time.monotonic() + 3600) == 0.0
        counters = successor.counters
        assert counters.calls_timed_out == 1 and counters.outages == 1 and counters.read_failed == 2

        HangingStore.release.set()  # the stuck call returns, with the chunk: too late
        hung._thread.join(WAIT_S)
        assert not hung.alive
        assert bytes(slots[2]) == bytes(LAYOUT.slot_bytes)  # never written
        assert counters.read_ok == 0
        assert len(answers(replies.drain(), 1)) == 1  # no second answer to the hung read

        # The successor's own client: up after the back-off (its health query), and reads.
        deadline = time.monotonic() + WAIT_S
        while not successor.healthy:
            assert time.monotonic() < deadline, "the successor never reached the store"
            time.sleep(0.05)
        successor.read(ReadChunk(seq=4, key=key(1), host_slot=0, urgent=True))
        done = answers(replies.until(lambda g: answers(g, 4)), 4)[0]
        assert done.outcome == IoOutcome.OK and bytes(slots[0]) == payload(1)
        assert counters.read_ok == 1 and counters.calls_timed_out == 1
    finally:
        HangingStore.release.set()


def test_a_thread_is_not_replaced_without_a_factory_for_its_successor(mooncake):
    replies = Replies()
    thread = RemoteThread(new_store(mooncake), replies.ctx, replies.endpoint, lambda i: memoryview(bytearray(1)))
    with pytest.raises(ValueError, match="new_store"):
        thread.replace("test")


@pytest.fixture
def io_process(tmp_path, mooncake, request):
    """An I/O process with the SSD tier and the remote tier, every remote read of which
    takes an hour; its remote calls are given ``request.param`` seconds (default 2)."""
    deadline_s = getattr(request, "param", 2.0)
    os.environ["PCR_IO_TEST_FAULTS"] = json.dumps({"remote_read_delay_s": 3600})
    pool = HostChunkPool(LAYOUT, pin=False)
    store = ChunkFileStore(tmp_path / "store", NAMESPACE, LAYOUT, "float32", 1 << 20, low_watermark_bytes=0)
    sup = IOSupervisor(
        io_config(
            pool,
            store.root,
            store.namespace.hex(),
            "float32",
            remote_config=remote_config(mooncake).to_json(),
            remote_call_timeout_s=deadline_s,
        ),
        stall_timeout_s=30.0,
    )
    try:
        assert sup.wait_ready(30)
    finally:
        os.environ.pop("PCR_IO_TEST_FAULTS", None)
    yield sup, pool
    sup.close()
    pool.close()


def test_a_hung_remote_read_is_failed_while_local_reads_keep_completing(io_process):
    """The review's case: local SSD reads keep the supervisor hearing from the process, so
    only the remote thread's watchdog can notice the remote read that never returns. It
    comes back BAD (the slot is freed, the chunk recomputed), not CANCELLED: the process
    was not restarted; and probes are answered again, not queued behind the stuck call."""
    sup, pool = io_process
    pid = sup.pid
    local = key(10)
    sup.submit(WriteChunk(1, local, bytes(16), 1, LAYOUT.chunk_size, 0))
    deadline = time.monotonic() + WAIT_S
    outcomes = []
    while not outcomes:
        assert time.monotonic() < deadline
        outcomes += sup.poll()
        time.sleep(0.01)
    assert outcomes == [(1, IoOutcome.OK, outcomes[0][2])]
    sup.submit(ReadChunk(2, key(11), 1, urgent=True))  # not on the local SSD: the remote tier's, hangs
    outcomes, seq, probe = [], 100, None
    while not any(s == 2 for s, _, _ in outcomes):
        assert time.monotonic() < deadline, f"the hung remote read was never given up on: {sup.remote_status}"
        sup.submit(ReadChunk(seq, local, 2))  # steady local reads, answered all along
        seq += 1
        outcomes += sup.poll()
        time.sleep(0.05)
    assert (2, IoOutcome.BAD, 0.0) in outcomes
    local_ok = [s for s, o, _ in outcomes if s >= 100 and o is IoOutcome.OK]
    assert len(local_ok) >= 10, outcomes  # the supervisor heard from the process all along
    assert sup.pid == pid and sup.restarts == 0 and sup.failures == 0
    sup.submit(ProbeRemote(7, [[key(12)]]))
    while (probe := sup.take_probe(7)) is None:
        assert time.monotonic() < deadline + WAIT_S, "the probe queued behind the stuck call"
        sup.poll()
        time.sleep(0.05)
    assert probe.present == [0]
    while sup.remote_status is None or not sup.remote_status.counters.get("calls_timed_out"):
        assert time.monotonic() < deadline + WAIT_S, sup.remote_status
        sup.poll()
        time.sleep(0.1)
    assert sup.remote_status.counters["calls_timed_out"] >= 1 and sup.remote_status.pid == pid


@pytest.mark.parametrize("io_process", [1.0], indirect=True)
def test_stuck_remote_threads_are_bounded_by_a_process_restart(io_process):
    """Each thread given up on keeps a Mooncake client while its call hangs: with
    MAX_HUNG_REMOTE_THREADS of them stuck, the next hung call restarts the I/O process
    (its outstanding read comes back cancelled) and the new one starts clean."""
    sup, _ = io_process
    pid, seq, outcomes, timed_out = sup.pid, 1, [], 0
    deadline = time.monotonic() + 4 * WAIT_S
    while sup.restarts == 0 or not sup.healthy:
        assert time.monotonic() < deadline, (outcomes, sup.remote_status)
        if sup.healthy and not sup.in_flight:
            sup.submit(ReadChunk(seq, key(1000 + seq), 0, urgent=True))  # local miss: to the remote tier
            seq += 1
        outcomes += sup.poll()
        if sup.remote_status is not None and sup.remote_status.pid == pid:
            timed_out = int(sup.remote_status.counters.get("calls_timed_out", 0))
        time.sleep(0.05)
    assert sup.pid != pid and sup.failures == 1
    assert timed_out == MAX_HUNG_REMOTE_THREADS, (timed_out, outcomes)
    assert outcomes[-1][1] is IoOutcome.CANCELLED  # the read hung at the exit
    assert sum(1 for _, o, _ in outcomes if o is IoOutcome.BAD) >= MAX_HUNG_REMOTE_THREADS
