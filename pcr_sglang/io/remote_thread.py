"""The I/O process's remote tier: probes, reads and write-through on a thread of their own.

A call to Mooncake blocks while the master is unreachable (about four seconds per call
here), so remote work never runs on the I/O process's main loop, where local SSD reads
and writes go on regardless. The thread answers the scheduler itself, on a socket of its
own, with the same replies the main loop sends (:class:`Done` for reads, :class:`Probed`
for probes), and reports the tier's state and counters in :class:`RemoteStatus`.

Failure handling is a circuit breaker: the first error marks the tier down; while down,
probes find nothing, reads come back bad (the scheduler recomputes) and write-through
records are dropped, all at once; after a back-off (1 s, doubling to 30 s) the next call
tries again (a health check when no work waits, so an idle server notices too), and the
tier is up as soon as one succeeds. Mooncake's client reconnects to a
restarted master by itself; a store that never opened is opened again.

Order of work: probes, then reads a request waits for, then prefetch reads, then writes.
Write-through records wait in a bounded queue (``write_queue_records``): when it is full
a record is dropped and counted (the chunk stays on the local SSD; a peer recomputes it).
Reads handed here cannot be cancelled or expedited any more: they complete normally.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import zmq

from pcr_sglang.io.protocol import (SOURCE_REMOTE, Done, IoOutcome, Probed, ProbeRemote, ReadChunk,
                                    RemoteStatus, reply_encoder)
from pcr_sglang.tiers.remote_store import ReadResult, RemoteChunkStore, RemoteConfigError, RemoteError

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
STATUS_INTERVAL_S = 1.0


@dataclass
class RemoteCounters:
    probes: int = 0
    probed_chunks: int = 0
    found_chunks: int = 0
    reads: int = 0
    read_ok: int = 0
    read_missing: int = 0
    read_corrupt: int = 0
    read_failed: int = 0  # the store could not be asked (down, or the call failed)
    read_bytes: int = 0
    read_seconds: float = 0.0
    writes: int = 0  # records sent
    writes_present: int = 0  # not sent: the store held the key already
    writes_dropped: int = 0  # not sent: the queue was full
    writes_failed: int = 0  # not sent: the call failed, or the tier was down
    write_bytes: int = 0
    errors: int = 0  # calls that failed (each one trips the breaker)
    outages: int = 0  # times the tier went down


@dataclass(frozen=True)
class RemoteFaults:
    """Test knob (``PCR_IO_TEST_FAULTS``: ``remote_delay_s``, ``remote_read_delay_s``,
    ``remote_fail``): every remote call (or every read) waits, or every call fails as an
    unreachable master would."""

    delay_s: float = 0.0
    fail: bool = False
    read_delay_s: float = 0.0


class RemoteThread:
    def __init__(self, store: RemoteChunkStore, ctx: zmq.Context, replies_endpoint: str,
                 slot: Callable[[int], memoryview], faults: Optional[RemoteFaults] = None,
                 on_read: Optional[Callable[[bytes, Any, bytes], None]] = None):
        self.store = store
        self.slot = slot
        self.on_read = on_read  # (key, verified header, payload copy): the main loop caches it locally
        self.faults = faults
        self.counters = RemoteCounters()
        self.healthy = False
        self.error = "not connected yet"
        self._opened = False
        self._retry_at = 0.0
        self._backoff_s = 1.0
        self._probes: collections.deque = collections.deque()
        self._urgent: collections.deque = collections.deque()
        self._reads: collections.deque = collections.deque()
        self._writes: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._socket = ctx.socket(zmq.PUSH)  # this thread's own (ZMQ sockets are per thread)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._replies_endpoint = replies_endpoint
        self._last_status: Optional[tuple] = None
        self._last_status_at = 0.0
        self._thread = threading.Thread(target=self._run, name="pcr-remote", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def has_room(self) -> bool:
        """Whether a write-through record would be queued (checked before building one)."""
        with self._cv:
            if len(self._writes) < self.store.config.write_queue_records:
                return True
            self.counters.writes_dropped += 1
            return False

    # ------------------------------------------------------------------ from the main loop
    def probe(self, order: ProbeRemote) -> None:
        with self._cv:
            self._probes.append(order)
            self._cv.notify()

    def read(self, order: ReadChunk) -> None:
        """A read the local SSD missed: the remote thread answers it."""
        with self._cv:
            (self._urgent if order.urgent else self._reads).append(order)
            self._cv.notify()

    def write(self, key: bytes, record: bytes) -> None:
        with self._cv:  # re-entrant: has_room takes the same lock
            if not self.has_room():
                return
            self._writes.append((key, record))
            self._cv.notify()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        self._socket.connect(self._replies_endpoint)
        try:
            self._call(lambda: None)  # connect at start, not at the first request
        except RemoteError:
            pass  # down: retried after the back-off
        self._send_status(force=True)
        while True:
            item = queue = None
            with self._cv:
                while not (self._probes or self._urgent or self._reads or self._writes):
                    if not self.healthy and time.monotonic() >= self._retry_at:
                        break  # down, back-off over, nothing to do: ask the store itself
                    wait = STATUS_INTERVAL_S if self.healthy else max(min(self._retry_at - time.monotonic(),
                                                                          STATUS_INTERVAL_S), 0.01)
                    self._cv.wait(wait)
                    self._send_status()
                else:
                    queue = next(q for q in (self._probes, self._urgent, self._reads, self._writes) if q)
                    item = queue.popleft()
            try:
                if queue is None:
                    try:
                        self._call(self.store.ping)
                    except RemoteError:
                        pass
                elif queue is self._probes:
                    self._probe(item)
                elif queue is self._writes:
                    self._write(*item)
                else:
                    self._read(item)
                self._send_status()
            except zmq.ZMQError:
                raise  # the replies socket is gone: the process is ending
            except Exception:  # noqa: BLE001 - a bug here must not leave orders unanswered forever
                logger.exception("PCR remote tier: unexpected error (the order is answered as failed)")
                if isinstance(item, ReadChunk):
                    self._reply(Done(item.seq, IoOutcome.BAD, "remote tier: internal error", source=SOURCE_REMOTE))
                elif isinstance(item, ProbeRemote):
                    self._reply(Probed(item.seq, [0] * len(item.chains), "remote tier: internal error"))

    def _call(self, fn: Callable):
        """Run ``fn`` against the store, or raise RemoteError at once while the tier is
        down and its back-off has not passed."""
        now = time.monotonic()
        if not self.healthy and now < self._retry_at:
            raise RemoteError(self.error)
        try:
            if self.faults is not None:
                time.sleep(self.faults.delay_s)
                if self.faults.fail:
                    raise RemoteError("test fault: the remote store does not answer")
            if not self._opened:
                self.store.open()
                self._opened = True
            result = fn()
        except (RemoteError, RemoteConfigError) as e:
            self.counters.errors += 1
            self._down(str(e))
            raise RemoteError(self.error) from None
        if not self.healthy:
            logger.warning("PCR remote tier: reachable%s", " again" if self.counters.outages else "")
        self.healthy, self.error, self._backoff_s = True, "", 1.0
        return result

    def _down(self, why: str) -> None:
        if self.healthy or self.counters.outages == 0:
            self.counters.outages += 1
            logger.warning("PCR remote tier down (%s): serving from the local tiers; retrying in %.0f s",
                           why, self._backoff_s)
        self.healthy, self.error = False, why
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)

    def _probe(self, order: ProbeRemote) -> None:
        start = time.perf_counter()
        self.counters.probes += 1
        self.counters.probed_chunks += sum(len(c) for c in order.chains)
        try:
            present = self._call(lambda: self.store.probe(order.chains))
            error = ""
        except RemoteError as e:
            present, error = [0] * len(order.chains), str(e)
        self.counters.found_chunks += sum(present)
        self._reply(Probed(order.seq, present, error, time.perf_counter() - start))

    def _read(self, order: ReadChunk) -> None:
        start = time.perf_counter()
        self.counters.reads += 1
        if self.faults is not None and self.faults.read_delay_s:
            time.sleep(self.faults.read_delay_s)
        try:
            result = self._call(lambda: self.store.read_into(order.key, self.slot(order.host_slot)))
        except RemoteError as e:
            self.counters.read_failed += 1
            self._reply(Done(order.seq, IoOutcome.BAD, f"not on the local SSD; remote tier: {e}",
                             seconds=time.perf_counter() - start, source=SOURCE_REMOTE))
            return
        seconds = time.perf_counter() - start
        if result is ReadResult.OK:
            self.counters.read_ok += 1
            self.counters.read_bytes += self.store.codec.record_bytes
            self.counters.read_seconds += seconds
            # Copied while the slot is still this read's (the scheduler reuses it only after the reply).
            payload = bytes(self.slot(order.host_slot)) if self.on_read is not None else b""
            self._reply(Done(order.seq, IoOutcome.OK, seconds=seconds, source=SOURCE_REMOTE))
            if self.on_read is not None and self.store.last_record is not None:
                self.on_read(order.key, self.store.last_record, payload)
            return
        if result is ReadResult.CORRUPT:
            self.counters.read_corrupt += 1
            logger.warning("PCR remote tier: chunk %s failed verification; removed, it will be recomputed",
                           order.key.hex())
        else:
            self.counters.read_missing += 1
        self._reply(Done(order.seq, IoOutcome.BAD, f"remote tier: {result.value}", seconds=seconds,
                         source=SOURCE_REMOTE))

    def _write(self, key: bytes, record: bytes) -> None:
        try:
            sent = self._call(lambda: self.store.write(key, record))
        except RemoteError:
            self.counters.writes_failed += 1
            return
        if sent:
            self.counters.writes += 1
            self.counters.write_bytes += len(record)
        else:
            self.counters.writes_present += 1

    def _reply(self, reply) -> None:
        self._socket.send(reply_encoder.encode(reply))

    def _send_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_status_at < STATUS_INTERVAL_S:
            return
        with self._cv:
            queued_writes, queued_reads = len(self._writes), len(self._urgent) + len(self._reads)
        counters = {**{k: float(v) for k, v in asdict(self.counters).items()}, "queued_writes": float(queued_writes),
                    "queued_reads": float(queued_reads)}
        state = (self.healthy, self.error, tuple(counters.values()))
        if not force and state == self._last_status:
            return
        self._last_status, self._last_status_at = state, now
        self._reply(RemoteStatus(self.healthy, self.error, counters, os.getpid()))
