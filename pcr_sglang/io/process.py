"""The I/O process: executes the scheduler's SSD orders against the store and host pool.

Started by :class:`pcr_sglang.io.supervisor.IOSupervisor` as ``python -m
pcr_sglang.io.process CONFIG`` (a msgpack-encoded
:class:`~pcr_sglang.io.protocol.IoProcessConfig`, hex). It attaches the host pool's shared
memory by name (plain bytes: no torch here, so it starts in a fraction of a second), opens
the store, connects to the scheduler's two IPC sockets, says hello, and then runs orders:
urgent reads first (a request waits for them), then prefetch reads and deletes, then writes
(a write only makes a chunk durable; :mod:`pcr_sglang.io.dispatch` picks the next). Reads
run on ``read_threads`` reader threads (``--pcr-ssd-read-threads``,
:mod:`pcr_sglang.io.readers`), so up to that many are in flight
at once: a disk serves reads in parallel (an NVMe drive needs a queue of several to reach
its bandwidth, a network disk hides its latency only so) and a read mostly waits in the
kernel, where Python threads run in parallel. Deletes and writes stay on the main thread, in
order; one of a chunk being read waits for that read. A read the threads have not started
yet can still be expedited or cancelled. With a remote tier (``--pcr-remote``), a read the
local SSD misses, every probe, and a copy of every record written go to the remote thread
(:mod:`pcr_sglang.io.remote_thread`), which answers them. A remote call that runs past
``remote_call_timeout_s`` gets the remote thread replaced (its order answered as failed, the
breaker tripped, a new client; the stuck thread is left behind and never touches a slot
again); while ``MAX_HUNG_REMOTE_THREADS`` of those are still stuck, the next hung call makes
the process exit instead, to be restarted with nothing left behind.

It dies with its scheduler: it checks its parent pid at least once a second and exits
when the parent is gone (even after kill -9). It also exits, to be restarted by its
supervisor, when a read has run longer than the supervisor's stall timeout (a hung
disk: the other threads may still answer, so the supervisor would not notice) or a
thread of its has died. ``PR_SET_PDEATHSIG`` is not used: Linux
sends that signal when the parent *thread* that spawned the process exits, which would
kill the I/O process whenever a helper thread built the cache.

Test knobs (``PCR_IO_TEST_FAULTS``): :mod:`pcr_sglang.io.faults`.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import sys
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import msgspec
import zmq

from pcr_sglang.core.orders import DeleteChunk, IoOutcome, ProbeRemote, ReadChunk, Reorder, WriteChunk
from pcr_sglang.io.dispatch import ReadQueue, dispatch_reads, ready, reorder, write_ready
from pcr_sglang.io.faults import DelayedRenames, TestFaults
from pcr_sglang.io.protocol import Done, Hello, IoProcessConfig, Probed, RemoteStatus, order_decoder, reply_encoder
from pcr_sglang.io.readers import ReaderThreads
from pcr_sglang.io.remote_calls import RemoteFaults
from pcr_sglang.io.remote_thread import RemoteThread
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import ChunkRecord, RecordCodec
from pcr_sglang.tiers.remote_store import RemoteChunkStore, RemoteConfig, RemoteConfigError, load_fleet_key
from pcr_sglang.tiers.ssd_store import ChunkFileStore

logger = logging.getLogger(__name__)

# Batch durability: at most this many written records wait for their group fsync (a
# group also ends whenever the write queue is empty, so a lone write is never held).
BATCH_RECORDS = 16
# Remote threads given up on (a call that never returned) and still stuck: each holds a
# Mooncake client. With this many, the next hung call makes the process exit instead.
MAX_HUNG_REMOTE_THREADS = 3


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=False)
    # Python < 3.13 would unlink the segment when this process exits: the scheduler owns it.
    # _name: the name the tracker registered (with its leading slash); private, not in typeshed
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


class IoProcess:
    def __init__(self, config: IoProcessConfig):
        self.config = config
        layout = HostChunkLayout(config.num_slots, config.num_layers, config.chunk_size, config.row_bytes)
        self.slot_bytes = layout.slot_bytes
        self.faults = TestFaults.from_env(config.tp_rank)
        write_delay_s = self.faults.write_delay_s if self.faults is not None else 0.0
        self.store = ChunkFileStore(
            config.store_root,
            bytes.fromhex(config.namespace_hex),
            layout,
            config.dtype,
            capacity_bytes=None,
            low_watermark_bytes=config.reserve_bytes,
            durability=config.durability,
            slot=config.writer_slot or None,
            fileops=DelayedRenames(write_delay_s) if write_delay_s > 0 else None,
        )
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
        self.readers = ReaderThreads(max(1, config.read_threads), self.ctx, config.replies_endpoint, self.read)
        self.remote: Optional[RemoteThread] = None
        self.remote_error = ""  # why there is no remote tier although one was configured
        self._hung_remote: list[RemoteThread] = []  # replaced by the watchdog, their call still running
        # Records the remote thread read, to keep on the local SSD too (the tree counts them
        # there): (key, verified header, payload), written when no order waits.
        self._to_cache: collections.deque[tuple[bytes, ChunkRecord, bytes]] = collections.deque(maxlen=64)
        if config.remote_config:
            try:
                remote = RemoteConfig(**msgspec.json.decode(config.remote_config))
                codec = RecordCodec(
                    load_fleet_key(remote.key_file), bytes.fromhex(config.namespace_hex), layout, config.dtype
                )
            except (RemoteConfigError, ValueError, TypeError, msgspec.DecodeError) as e:
                # The SSD tier goes on without it (a key file removed since the server started).
                self.remote_error = f"remote tier off: {e}"
                logger.error("PCR I/O process: %s", self.remote_error)
            else:
                faults = (
                    RemoteFaults(self.faults.remote_delay_s, self.faults.remote_fail, self.faults.remote_read_delay_s)
                    if self.faults is not None
                    else None
                )
                self.remote = RemoteThread(
                    RemoteChunkStore(remote, codec),
                    self.ctx,
                    config.replies_endpoint,
                    self.slot,
                    faults,
                    on_read=lambda *r: self._to_cache.append(r),
                    deadline_s=config.remote_call_timeout_s,
                    new_store=lambda: RemoteChunkStore(remote, codec),
                )

    def slot(self, index: int) -> memoryview:
        start = index * self.slot_bytes
        buf = self.shm.buf
        assert buf is not None  # attached for the process's whole life
        return buf[start : start + self.slot_bytes]

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

    def execute(self, order: WriteChunk | DeleteChunk) -> Optional[Done]:
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
                    self.remote.write(
                        order.key,
                        self.remote.store.build_record(
                            order.key, order.parent_key, order.depth, order.num_tokens, payload
                        ),
                    )
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
            replies = [
                d
                if d.outcome != IoOutcome.OK or key in durable
                else Done(d.seq, IoOutcome.CANCELLED, "not made durable by the flush")
                for key, d in held
            ]
        except OSError as e:
            replies = [
                Done(d.seq, IoOutcome.BAD, str(e), e.errno or 0) if d.outcome == IoOutcome.OK else d for _, d in held
            ]
        share = (time.perf_counter() - start) / len(held)
        for done in replies:
            done.seconds += share
            self.replies.send(reply_encoder.encode(done))

    def reorder(self, request: Reorder, urgent: collections.deque[ReadChunk], reads: ReadQueue) -> None:
        """Expedite or cancel a queued read (:func:`pcr_sglang.io.dispatch.reorder`); a
        cancelled read is answered here."""
        cancelled = reorder(request, urgent, reads)
        if cancelled is not None:
            self.replies.send(reply_encoder.encode(Done(cancelled.seq, IoOutcome.CANCELLED, "cancelled")))

    def probe(self, order: ProbeRemote) -> None:
        if self.remote is None:
            self.replies.send(
                reply_encoder.encode(Probed(order.seq, [0] * len(order.chains), self.remote_error or "no remote tier"))
            )
        else:
            self.remote.probe(order)

    def check_remote(self, now: Optional[float] = None) -> bool:
        """The remote thread's watchdog, run from the main loop: a call past its deadline
        gets the thread replaced (see :meth:`RemoteThread.replace`). False: too many
        replaced threads are still stuck, and the process should exit."""
        # mutant: remote-watchdog-never-gives-up-on-a-hung-call
        hung_s = self.remote.overdue_s(now) if self.remote is not None else 0.0
        if not hung_s:
            return True
        assert self.remote is not None  # only a remote thread's call hangs
        self._hung_remote = [t for t in self._hung_remote if t.alive]
        if len(self._hung_remote) >= MAX_HUNG_REMOTE_THREADS:
            logger.error(
                "PCR I/O process: a remote-tier call has not returned for %.0f s, and %d replaced remote "
                "threads are still stuck; exiting so that the supervisor restarts it",
                hung_s,
                len(self._hung_remote),
            )
            return False
        why = f"a call did not return in {self.remote.deadline_s:g} s"
        logger.error(
            "PCR I/O process: a remote-tier call has not returned for %.0f s: its order fails, the "
            "remote client is restarted and the stuck call left behind",
            hung_s,
        )
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
        urgent: collections.deque[ReadChunk] = collections.deque()  # reads a request waits for, in order
        reads: ReadQueue = collections.deque()  # prefetch reads and deletes
        writes: collections.deque[WriteChunk] = collections.deque()
        queues = (urgent, reads, writes)
        poller = zmq.Poller()
        poller.register(self.orders, zmq.POLLIN)
        poller.register(self.readers.freed, zmq.POLLIN)
        last_parent_check = time.monotonic()
        while True:
            # Reads were handed out below as far as threads were free; what is left waits for
            # a thread's wake-up (or a new order), not a spin.
            timeout_ms = 0 if ready(self.readers, urgent, reads, writes) else (10 if self._to_cache else 1000)
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
                    elif isinstance(order, WriteChunk):
                        writes.append(order)
                    else:
                        reads.append(order)
            dispatch_reads(self.readers, urgent, reads, self.execute)
            if write_ready(self.readers, urgent, reads, writes):
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
                    logger.error(
                        "PCR I/O process: a read has not returned for %.0f s (a hung disk?); exiting "
                        "so that the supervisor restarts it",
                        hung_s,
                    )
                    return


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="[pcr-io %(process)d] %(message)s")
    config = msgspec.msgpack.decode(bytes.fromhex(argv[1]), type=IoProcessConfig)
    if os.getppid() != config.parent_pid:
        return 0
    IoProcess(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
