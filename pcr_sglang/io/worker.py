"""The I/O process: executes the scheduler's SSD orders against the store and host pool.

Started by :class:`pcr_sglang.io.supervisor.IOSupervisor` as ``python -m
pcr_sglang.io.worker CONFIG`` (a msgpack-encoded
:class:`~pcr_sglang.io.protocol.WorkerConfig`, hex). It attaches the host pool's shared
memory by name (plain bytes: no torch here, so it starts in a fraction of a second),
opens the store, connects to the scheduler's two IPC sockets, says hello, and then runs
orders one at a time: urgent reads first (a request waits for them), then prefetch reads
and deletes, then writes (a write only makes a chunk durable). With a remote tier
(``--pcr-remote``), a read the local SSD misses, every probe, and a copy of every record
written go to the remote thread (:mod:`pcr_sglang.io.remote_thread`), which answers them.

It dies with its scheduler: it checks its parent pid at least once a second and exits
when the parent is gone (even after kill -9). ``PR_SET_PDEATHSIG`` is not used: Linux
sends that signal when the parent *thread* that spawned the process exits, which would
kill the I/O process whenever a helper thread built the cache.

Test knob: ``PCR_IO_TEST_FAULTS`` (JSON, e.g. ``{"tp_ranks": [1], "read_delay_s": 2}``,
``{"fail_reads": true}``, ``{"fail_writes": true}``, ``{"write_delay_s": 0.2}``,
``{"remote_delay_s": 0.5}``, ``{"remote_read_delay_s": 2}`` or ``{"remote_fail": true}``)
makes the processes of the listed TP ranks (all ranks when absent) delay or fail their
reads, fail their writes as a full disk would, hold each record in its temp file before
the rename, or delay every remote call (or read), or fail every one, so tests can make one rank's reads arrive late or fail, kill mid-write, or
make the remote store slow or unreachable. It is read once
at start and logged; never set it in production.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import msgspec
import zmq

from pcr_sglang.io.protocol import (
    DeleteChunk,
    Done,
    Hello,
    IoOutcome,
    Probed,
    ProbeRemote,
    ReadChunk,
    RemoteStatus,
    Reorder,
    WorkerConfig,
    WriteChunk,
    order_decoder,
    reply_encoder,
)
from pcr_sglang.io.remote_thread import RemoteFaults, RemoteThread
from pcr_sglang.tiers.fileops import FileOps
from pcr_sglang.tiers.records import RecordCodec
from pcr_sglang.tiers.remote_store import RemoteChunkStore, RemoteConfig, RemoteConfigError, load_fleet_key
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_sglang.transfer.layout import HostChunkLayout

logger = logging.getLogger(__name__)

FAULTS_ENV = "PCR_IO_TEST_FAULTS"
# Batch durability: at most this many written records wait for their group fsync (a
# group also ends whenever the write queue is empty, so a lone write is never held).
BATCH_RECORDS = 16


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
                     float(spec.get("remote_read_delay_s", 0.0)))
        logger.warning("PCR I/O process of TP rank %d: test faults %s (%s)", tp_rank, faults, FAULTS_ENV)
        return faults


class _DelayedRenames(FileOps):
    """The store's file operations with a pause before each rename (``write_delay_s``)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def rename(self, src: str, dst: str) -> None:
        time.sleep(self.delay_s)
        super().rename(src, dst)


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
        self.remote: Optional[RemoteThread] = None
        self.remote_error = ""  # why there is no remote tier although one was configured
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
                                           self.slot, faults, on_read=lambda *r: self._to_cache.append(r))

    def slot(self, index: int) -> memoryview:
        start = index * self.slot_bytes
        return self.shm.buf[start:start + self.slot_bytes]

    def execute(self, order) -> Optional[Done]:
        start = time.perf_counter()
        try:
            if isinstance(order, ReadChunk):
                if self.faults is not None:
                    time.sleep(self.faults.read_delay_s)
                    if self.faults.fail_reads:
                        return Done(order.seq, IoOutcome.BAD, "test fault", seconds=time.perf_counter() - start)
                ok = self.store.read_into(order.key, self.slot(order.host_slot))
                if not ok and self.remote is not None:
                    self.remote.read(order)  # the remote thread answers it
                    return None
                return Done(order.seq, IoOutcome.OK if ok else IoOutcome.BAD,
                            "" if ok else "missing or failed verification", seconds=time.perf_counter() - start)
            if isinstance(order, WriteChunk):
                if self.faults is not None and self.faults.fail_writes:
                    raise OSError(errno.ENOSPC, "test fault: no space left on device")
                self._supersede(order.key, "rewritten before its fsync")  # the store drops the older one
                payload = self.slot(order.host_slot)
                self.store.write(order.key, order.parent_key, order.depth, order.num_tokens, payload)
                if self.remote is not None and self.remote.has_room():  # from a copy: the slot is reused after the reply
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

    def reorder(self, request: Reorder, urgent: collections.deque, reads: collections.deque) -> None:
        """Expedite a queued prefetch read, or cancel a queued read (a read that a request
        waited for is cancelled too once that request has gone)."""
        for queue in ((reads, urgent) if request.cancel else (reads,)):
            for order in queue:
                if isinstance(order, ReadChunk) and order.seq == request.target:
                    queue.remove(order)
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
        last_parent_check = time.monotonic()
        while True:
            timeout_ms = 0 if any(queues) else (10 if self._to_cache else 1000)
            if poller.poll(timeout_ms):
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
            queue = next((q for q in queues if q), None)
            if queue is not None:
                done = self.execute(queue.popleft())
                if done is not None:
                    self.replies.send(reply_encoder.encode(done))
                if self._unsynced and (not writes or len(self._unsynced) >= BATCH_RECORDS):
                    self.flush()
            elif self._to_cache:
                self.cache_remote_read()
            now = time.monotonic()
            if now - last_parent_check > 1.0:
                last_parent_check = now
                if os.getppid() != self.config.parent_pid:
                    return
                if self.remote is not None and not self.remote.alive:
                    logger.error("PCR I/O process: the remote thread died; exiting so that the supervisor restarts it")
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
