"""The I/O process: executes the scheduler's SSD orders against the store and host pool.

Started by :class:`pcr_sglang.io.supervisor.IOSupervisor` as ``python -m
pcr_sglang.io.worker CONFIG`` (a msgpack-encoded
:class:`~pcr_sglang.io.protocol.WorkerConfig`, hex). It attaches the host pool's shared
memory by name (plain bytes: no torch here, so it starts in a fraction of a second),
opens the store, connects to the scheduler's two IPC sockets, says hello, and then runs
orders: urgent reads first (a request waits for them), then prefetch reads and deletes,
then writes (a write only makes a chunk durable). Reads run on ``read_threads`` reader
threads (``--pcr-ssd-read-threads``), so up to that many are in flight at once: a disk serves
reads in parallel (an NVMe drive needs a queue of several to reach its bandwidth, a
network disk hides its latency only so) and a read mostly waits in the kernel, where
Python threads run in parallel. Deletes and writes stay on the main thread, in order; one
of a chunk being read waits for that read. A read the threads have not started yet can
still be expedited or cancelled. With a remote tier
(``--pcr-remote``), a read the local SSD misses, every probe, and a copy of every record
written go to the remote thread (:mod:`pcr_sglang.io.remote_thread`), which answers them.
A remote call that runs past ``remote_call_timeout_s`` gets the remote thread replaced
(its order answered as failed, the breaker tripped, a new client; the stuck thread is left
behind and never touches a slot again); while ``MAX_HUNG_REMOTE_THREADS`` of those are
still stuck, the next hung call makes the process exit instead, to be restarted with
nothing left behind.

It dies with its scheduler: it checks its parent pid at least once a second and exits
when the parent is gone (even after kill -9). It also exits, to be restarted by its
supervisor, when a read has run longer than the supervisor's stall timeout (a hung
disk: the other threads may still answer, so the supervisor would not notice) or a
thread of its has died. ``PR_SET_PDEATHSIG`` is not used: Linux
sends that signal when the parent *thread* that spawned the process exits, which would
kill the I/O process whenever a helper thread built the cache.

Test knob: ``PCR_IO_TEST_FAULTS`` (JSON, e.g. ``{"tp_ranks": [1], "read_delay_s": 2}``,
``{"fail_reads": true}``, ``{"fail_writes": true}``, ``{"write_delay_s": 0.2}``,
``{"read_rendezvous": 4}`` (each read waits until that many are running at once, and
fails if they never are: a test that reads overlap; once broken the barrier stays
broken, so a test sends reads in multiples of it),
``{"remote_delay_s": 0.5}``, ``{"remote_read_delay_s": 2}`` or ``{"remote_fail": true}``)
makes the processes of the listed TP ranks (all ranks when absent) delay or fail their
reads, fail their writes as a full disk would, hold each record in its temp file before
the rename, or delay every remote call (or read), or fail every one, so tests can make one
rank's reads arrive late or fail, kill mid-write, or make the remote store slow or
unreachable. It is read once at start and logged; never set it in production.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Callable, Optional

import msgspec
import zmq

from pcr_sglang.core.orders import DeleteChunk, IoOutcome, ProbeRemote, ReadChunk, Reorder, WriteChunk
from pcr_sglang.io.protocol import Done, Hello, Probed, RemoteStatus, WorkerConfig, order_decoder, reply_encoder
from pcr_sglang.io.remote_thread import RemoteFaults, RemoteThread
from pcr_sglang.tiers.fileops import FileOps
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import RecordCodec
from pcr_sglang.tiers.remote_store import RemoteChunkStore, RemoteConfig, RemoteConfigError, load_fleet_key
from pcr_sglang.tiers.ssd_store import ChunkFileStore

logger = logging.getLogger(__name__)

FAULTS_ENV = "PCR_IO_TEST_FAULTS"
# Batch durability: at most this many written records wait for their group fsync (a
# group also ends whenever the write queue is empty, so a lone write is never held).
BATCH_RECORDS = 16
# Deletes run on the main thread and are not acknowledged; at most this many run before
# the loop reads new orders again (a reset or a large eviction orders thousands).
DELETES_PER_TURN = 32
# Remote threads given up on (a call that never returned) and still stuck: each holds a
# Mooncake client. With this many, the next hung call makes the process exit instead.
MAX_HUNG_REMOTE_THREADS = 3


@dataclass(frozen=True)
class TestFaults:
    read_delay_s: float = 0.0
    fail_reads: bool = False
    fail_writes: bool = False
    # Each record waits this long, complete in its temp file, before its rename, so that a
    # kill is likely to land mid-write (the kill -9 test discards what it catches).
    write_delay_s: float = 0.0
    remote_delay_s: float = 0.0  # every remote call waits this long first
    remote_fail: bool = False  # every remote call fails, as with an unreachable master
    remote_read_delay_s: float = 0.0  # every remote read waits this long first
    read_rendezvous: int = 0  # reads wait for this many to run at once (0: they do not)

    @classmethod
    def from_env(cls, tp_rank: int) -> Optional[TestFaults]:
        text = os.environ.get(FAULTS_ENV)
        if not text:
            return None
        spec = json.loads(text)
        ranks = spec.get("tp_ranks")
        if ranks is not None and tp_rank not in ranks:
            return None
        faults = cls(float(spec.get("read_delay_s", 0.0)), bool(spec.get("fail_reads", False)),
                     bool(spec.get("fail_writes", False)), float(spec.get("write_delay_s", 0.0)),
                     float(spec.get("remote_delay_s", 0.0)), bool(spec.get("remote_fail", False)),
                     float(spec.get("remote_read_delay_s", 0.0)), int(spec.get("read_rendezvous", 0)))
        logger.warning("PCR I/O process of TP rank %d: test faults %s (%s)", tp_rank, faults, FAULTS_ENV)
        return faults


class _DelayedRenames(FileOps):
    """The store's file operations with a pause before each rename (``write_delay_s``)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def rename(self, src: str, dst: str) -> None:
        time.sleep(self.delay_s)
        super().rename(src, dst)


class BusyClock:
    """Times reads as shares of the time the disk was busy (see :class:`_ReaderThreads`):
    a read that overlapped the previous one is charged only from that one's completion."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_done = 0.0

    def share(self, started: float, finished: Optional[float] = None) -> float:
        """``finished``: now unless given (read under the lock, so completions are ordered)."""
        with self._lock:
            finished = time.perf_counter() if finished is None else finished
            share = finished - max(started, self._last_done)
            self._last_done = max(self._last_done, finished)
        return max(share, 0.0)


class _ReaderThreads:
    """The reads of the I/O process, ``threads`` at a time.

    The main loop owns the queues and hands a read over only when a thread is free, so a
    read not started yet can still be expedited or cancelled there. Each thread answers
    the scheduler on a socket of its own (ZMQ sockets are per thread), at once, and then
    tells the main loop on an in-process socket that it is free again, which wakes the
    loop's poll: nothing spins while every thread is busy.

    A read's ``seconds`` is its share of the time the disk was busy: from its start, or
    from the previous read's completion if that came later, to its own completion. Over
    a run of overlapping reads the shares add up to the run's wall time, so the cost
    model sees what a chunk costs at the parallelism reached (on a latency-bound disk N
    reads cost about one; on two busy CPU cores, copies and MACs overlap little).
    """

    def __init__(self, threads: int, ctx: zmq.Context, replies_endpoint: str,
                 read: Callable[[ReadChunk], Optional[Done]]):
        self.threads = threads
        self._read = read
        self._ctx = ctx
        self._replies_endpoint = replies_endpoint
        self._free_endpoint = f"inproc://pcr-io-reader-free-{id(self)}"
        self.freed = ctx.socket(zmq.PULL)  # the main loop polls it
        self.freed.bind(self._free_endpoint)  # before any thread connects
        # The main loop's view, changed by it alone: reads handed over and not yet
        # finished (seq -> (key, when handed over)), and how many of each key.
        self.running: dict[int, tuple[bytes, float]] = {}
        self._keys: collections.Counter = collections.Counter()
        self._orders: queue.SimpleQueue = queue.SimpleQueue()
        self._clock = BusyClock()
        self._threads = [threading.Thread(target=self._run, name=f"pcr-io-read-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    @property
    def free(self) -> int:
        return self.threads - len(self.running)

    @property
    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def reading(self, key: bytes) -> bool:
        """A read of ``key`` is running: a delete or write of it waits (so a read is never
        cut by a delete that was ordered after it, and no corrupt old copy a thread is
        checking is unlinked by name after a new record took its place)."""
        return self._keys[key] > 0

    def submit(self, order: ReadChunk) -> None:
        self.running[order.seq] = (order.key, time.monotonic())
        self._keys[order.key] += 1
        self._orders.put(order)

    def take_freed(self) -> None:
        """Count the threads that finished since the last call free again."""
        while True:
            try:
                raw = self.freed.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            key, _ = self.running.pop(int.from_bytes(raw, "little"))
            self._keys[key] -= 1
            if not self._keys[key]:
                del self._keys[key]

    def oldest_running_s(self) -> float:
        """How long the longest-running read has run (0: none runs)."""
        if not self.running:
            return 0.0
        return time.monotonic() - min(started for _, started in self.running.values())

    def _run(self) -> None:
        replies = self._ctx.socket(zmq.PUSH)
        replies.setsockopt(zmq.LINGER, 1000)
        replies.connect(self._replies_endpoint)
        freed = self._ctx.socket(zmq.PUSH)
        freed.setsockopt(zmq.LINGER, 0)
        freed.connect(self._free_endpoint)
        while True:
            order = self._orders.get()
            started = time.perf_counter()
            try:
                try:
                    done = self._read(order)
                except Exception:  # noqa: BLE001 - a bug here must not leave a read unanswered
                    logger.exception("PCR I/O process: reading chunk %s failed unexpectedly", order.key.hex())
                    done = Done(order.seq, IoOutcome.BAD, "internal error")
                if done is not None:
                    done.seconds = self._clock.share(started)
                    replies.send(reply_encoder.encode(done))
            finally:
                freed.send(order.seq.to_bytes(8, "little"))


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=False)
    # Python < 3.13 would unlink the segment when this process exits: the scheduler owns it.
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        layout = HostChunkLayout(config.num_slots, config.num_layers, config.chunk_size, config.row_bytes)
        self.slot_bytes = layout.slot_bytes
        self.faults = TestFaults.from_env(config.tp_rank)
        delayed = self.faults is not None and self.faults.write_delay_s > 0
        self.store = ChunkFileStore(config.store_root, bytes.fromhex(config.namespace_hex), layout,
                                    config.dtype, capacity_bytes=None,
                                    low_watermark_bytes=config.reserve_bytes,
                                    durability=config.durability, slot=config.writer_slot or None,
                                    fileops=_DelayedRenames(self.faults.write_delay_s) if delayed else None)
        # Batch durability: (key, completion) of writes acknowledged after the group fsync.
        self._unsynced: list[tuple[bytes, Done]] = []
        self.shm = _attach(config.shm_name)
        self.ctx = zmq.Context()
        self.orders = self.ctx.socket(zmq.PULL)
        self.orders.connect(config.orders_endpoint)
        self.replies = self.ctx.socket(zmq.PUSH)
        self.replies.setsockopt(zmq.LINGER, 1000)
        self.replies.connect(config.replies_endpoint)
        rendezvous = self.faults.read_rendezvous if self.faults is not None else 0
        self._rendezvous = threading.Barrier(rendezvous, timeout=10.0) if rendezvous > 1 else None
        self.readers = _ReaderThreads(max(1, config.read_threads), self.ctx, config.replies_endpoint, self.read)
        self.remote: Optional[RemoteThread] = None
        self.remote_error = ""  # why there is no remote tier although one was configured
        self._hung_remote: list[RemoteThread] = []  # replaced by the watchdog, their call still running
        # Records the remote thread read, to keep on the local SSD too (the tree counts them
        # there): (key, verified header, payload), written when no order waits.
        self._to_cache: collections.deque = collections.deque(maxlen=64)
        if config.remote_config:
            try:
                remote = RemoteConfig(**msgspec.json.decode(config.remote_config))
                codec = RecordCodec(load_fleet_key(remote.key_file), bytes.fromhex(config.namespace_hex), layout,
                                    config.dtype)
            except (RemoteConfigError, ValueError, TypeError, msgspec.DecodeError) as e:
                # The SSD tier goes on without it (a key file removed since the server started).
                self.remote_error = f"remote tier off: {e}"
                logger.error("PCR I/O process: %s", self.remote_error)
            else:
                faults = (RemoteFaults(self.faults.remote_delay_s, self.faults.remote_fail,
                                       self.faults.remote_read_delay_s) if self.faults is not None else None)
                self.remote = RemoteThread(RemoteChunkStore(remote, codec), self.ctx, config.replies_endpoint,
                                           self.slot, faults, on_read=lambda *r: self._to_cache.append(r),
                                           deadline_s=config.remote_call_timeout_s,
                                           new_store=lambda: RemoteChunkStore(remote, codec))

    def slot(self, index: int) -> memoryview:
        start = index * self.slot_bytes
        return self.shm.buf[start:start + self.slot_bytes]

    def read(self, order: ReadChunk) -> Optional[Done]:
        """One read, on a reader thread (None: the remote thread answers it). The thread
        sets the reply's ``seconds``."""
        try:
            if self.faults is not None:
                time.sleep(self.faults.read_delay_s)
                if self.faults.fail_reads:
                    return Done(order.seq, IoOutcome.BAD, "test fault")
                if self._rendezvous is not None:
                    try:
                        self._rendezvous.wait()
                    except threading.BrokenBarrierError:
                        return Done(order.seq, IoOutcome.BAD, "test fault: reads did not overlap")
            ok = self.store.read_into(order.key, self.slot(order.host_slot))
        except OSError as e:
            return Done(order.seq, IoOutcome.BAD, str(e), e.errno or 0)
        if not ok and self.remote is not None:
            self.remote.read(order)  # the remote thread answers it
            return None
        return Done(order.seq, IoOutcome.OK if ok else IoOutcome.BAD, "" if ok else "missing or failed verification")

    def execute(self, order) -> Optional[Done]:
        """A write or a delete, on the main thread."""
        start = time.perf_counter()
        try:
            if isinstance(order, WriteChunk):
                if self.faults is not None and self.faults.fail_writes:
                    raise OSError(errno.ENOSPC, "test fault: no space left on device")
                self._supersede(order.key, "rewritten before its fsync")  # the store drops the older one
                payload = self.slot(order.host_slot)
                self.store.write(order.key, order.parent_key, order.depth, order.num_tokens, payload)
                # from a copy: the slot is reused after the reply
                if self.remote is not None and self.remote.has_room():
                    self.remote.write(order.key, self.remote.store.build_record(
                        order.key, order.parent_key, order.depth, order.num_tokens, payload))
                done = Done(order.seq, IoOutcome.OK, seconds=time.perf_counter() - start)
                if self.store.pending_writes:  # batch durability: not durable yet
                    self._unsynced.append((order.key, done))
                    return None
                return done
            self.store.delete(order.key)  # DeleteChunk: not acknowledged
            self._supersede(order.key, "deleted before its fsync")
            return None
        except OSError as e:
            if isinstance(order, DeleteChunk):
                return None
            return Done(order.seq, IoOutcome.BAD, str(e), e.errno or 0, time.perf_counter() - start)

    def _supersede(self, key: bytes, why: str) -> None:
        """A held (batch) write of ``key`` whose record the store drops before it became
        durable is answered cancelled, never OK."""
        for i, (held_key, held) in enumerate(self._unsynced):
            if held_key == key and held.outcome == IoOutcome.OK:
                self._unsynced[i] = (key, Done(held.seq, IoOutcome.CANCELLED, why))

    def flush(self) -> None:
        """Batch durability: make the held writes durable, then acknowledge them (all of
        them failed if the group fsync failed; OK only for a record the flush made durable)."""
        held, self._unsynced = self._unsynced, []
        if not held:
            return
        start = time.perf_counter()
        try:
            durable = set(self.store.flush())
            replies = [d if d.outcome != IoOutcome.OK or key in durable
                       else Done(d.seq, IoOutcome.CANCELLED, "not made durable by the flush")
                       for key, d in held]
        except OSError as e:
            replies = [Done(d.seq, IoOutcome.BAD, str(e), e.errno or 0) if d.outcome == IoOutcome.OK else d
                       for _, d in held]
        share = (time.perf_counter() - start) / len(held)
        for done in replies:
            done.seconds += share
            self.replies.send(reply_encoder.encode(done))

    def dispatch_reads(self, urgent: collections.deque, reads: collections.deque) -> None:
        """Hand queued reads to free reader threads, urgent ones first; a delete reached in
        the prefetch queue runs here, in its place."""
        while urgent and self.readers.free:
            self.readers.submit(urgent.popleft())
        deletes = 0
        while reads and deletes < DELETES_PER_TURN:
            order = reads[0]
            if isinstance(order, ReadChunk):
                if not self.readers.free:
                    return
                self.readers.submit(reads.popleft())
            elif self.readers.reading(order.key):
                return  # after the read of that key ordered before it
            else:
                reads.popleft()
                self.execute(order)  # DeleteChunk: not acknowledged
                deletes += 1

    def _write_ready(self, urgent: collections.deque, reads: collections.deque, writes: collections.deque) -> bool:
        """A write may run: no read waits, and none of its chunk runs."""
        return bool(writes) and not urgent and not reads and not self.readers.reading(writes[0].key)

    def _ready(self, urgent: collections.deque, reads: collections.deque, writes: collections.deque) -> bool:
        """Work the main thread can do without waiting for a reader thread: a write, or more
        deletes of a long run of them."""
        if reads and isinstance(reads[0], DeleteChunk):
            return not self.readers.reading(reads[0].key)
        return self._write_ready(urgent, reads, writes)

    def reorder(self, request: Reorder, urgent: collections.deque, reads: collections.deque) -> None:
        """Expedite a queued prefetch read, or cancel a queued read (a read that a request
        waited for is cancelled too once that request has gone)."""
        for pending in ((reads, urgent) if request.cancel else (reads,)):
            for order in pending:
                if isinstance(order, ReadChunk) and order.seq == request.target:
                    pending.remove(order)
                    if request.cancel:
                        self.replies.send(reply_encoder.encode(Done(order.seq, IoOutcome.CANCELLED, "cancelled")))
                    else:
                        urgent.append(order)
                    return

    def probe(self, order: ProbeRemote) -> None:
        if self.remote is None:
            self.replies.send(reply_encoder.encode(Probed(order.seq, [0] * len(order.chains),
                                                          self.remote_error or "no remote tier")))
        else:
            self.remote.probe(order)

    def check_remote(self, now: Optional[float] = None) -> bool:
        """The remote thread's watchdog, run from the main loop: a call past its deadline
        gets the thread replaced (see :meth:`RemoteThread.replace`). False: too many
        replaced threads are still stuck, and the process should exit."""
        hung_s = self.remote.overdue_s(now) if self.remote is not None else 0.0
        if not hung_s:
            return True
        self._hung_remote = [t for t in self._hung_remote if t.alive]
        if len(self._hung_remote) >= MAX_HUNG_REMOTE_THREADS:
            logger.error("PCR I/O process: a remote-tier call has not returned for %.0f s, and %d replaced remote "
                         "threads are still stuck; exiting so that the supervisor restarts it", hung_s,
                         len(self._hung_remote))
            return False
        why = f"a call did not return in {self.remote.deadline_s:g} s"
        logger.error("PCR I/O process: a remote-tier call has not returned for %.0f s: its order fails, the "
                     "remote client is restarted and the stuck call left behind", hung_s)
        hung, self.remote = self.remote, self.remote.replace(why)
        self._hung_remote.append(hung)
        self.remote.start()
        return True

    def cache_remote_read(self) -> None:
        """Keep a record read from the remote tier on the local SSD as well (the tree has
        it at the SSD level, so its next read is local). Best effort: nothing waits for it."""
        key, record, payload = self._to_cache.popleft()
        try:
            self.store.write(key, record.parent_key, record.depth, record.num_tokens, payload)
            if self.store.pending_writes:
                self.flush()
        except OSError as e:
            logger.debug("PCR I/O process: caching remote chunk %s locally failed: %s", key.hex(), e)

    def run(self) -> None:
        if self.remote is not None:
            self.remote.start()
        self.replies.send(reply_encoder.encode(Hello(os.getpid())))
        if self.remote_error:
            self.replies.send(reply_encoder.encode(RemoteStatus(False, self.remote_error, {}, os.getpid())))
        urgent: collections.deque = collections.deque()  # reads a request waits for, in order
        reads: collections.deque = collections.deque()  # prefetch reads and deletes
        writes: collections.deque = collections.deque()
        queues = (urgent, reads, writes)
        poller = zmq.Poller()
        poller.register(self.orders, zmq.POLLIN)
        poller.register(self.readers.freed, zmq.POLLIN)
        last_parent_check = time.monotonic()
        while True:
            # Reads were handed out below as far as threads were free; what is left waits for
            # a thread's wake-up (or a new order), not a spin.
            timeout_ms = 0 if self._ready(urgent, reads, writes) else (10 if self._to_cache else 1000)
            if poller.poll(timeout_ms):
                self.readers.take_freed()
                while True:
                    try:
                        raw = self.orders.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    order = order_decoder.decode(raw)
                    if isinstance(order, Reorder):
                        self.reorder(order, urgent, reads)
                    elif isinstance(order, ProbeRemote):
                        self.probe(order)
                    elif isinstance(order, ReadChunk):
                        (urgent if order.urgent else reads).append(order)
                    else:
                        (writes if isinstance(order, WriteChunk) else reads).append(order)
            self.dispatch_reads(urgent, reads)
            if self._write_ready(urgent, reads, writes):
                done = self.execute(writes.popleft())
                if done is not None:
                    self.replies.send(reply_encoder.encode(done))
                if self._unsynced and (not writes or len(self._unsynced) >= BATCH_RECORDS):
                    self.flush()
            elif self._to_cache and not any(queues) and not self.readers.reading(self._to_cache[0][0]):
                self.cache_remote_read()
            now = time.monotonic()
            if now - last_parent_check > 1.0:
                last_parent_check = now
                if os.getppid() != self.config.parent_pid:
                    return
                if not self.check_remote(now):
                    return
                if self.remote is not None and not self.remote.alive:
                    logger.error("PCR I/O process: the remote thread died; exiting so that the supervisor restarts it")
                    return
                if not self.readers.alive:
                    logger.error("PCR I/O process: a reader thread died; exiting so that the supervisor restarts it")
                    return
                hung_s = self.readers.oldest_running_s()
                if hung_s > self.config.stall_timeout_s:
                    # The other threads may still answer, so the supervisor would not see the
                    # stall: the process goes, and its orders come back cancelled.
                    logger.error("PCR I/O process: a read has not returned for %.0f s (a hung disk?); exiting "
                                 "so that the supervisor restarts it", hung_s)
                    return


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="[pcr-io %(process)d] %(message)s")
    config = msgspec.msgpack.decode(bytes.fromhex(argv[1]), type=WorkerConfig)
    if os.getppid() != config.parent_pid:
        return 0
    Worker(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
