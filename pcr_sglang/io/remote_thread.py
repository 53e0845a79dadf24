"""The I/O process's remote tier: probes, reads and write-through on a thread of their own.

A call to Mooncake blocks while the master is unreachable (about four seconds per call
here), so remote work never runs on the I/O process's main loop, where local SSD reads
and writes go on regardless. The thread answers the scheduler itself, on a socket of its
own, with the same replies the main loop sends (:class:`Done` for reads, :class:`Probed`
for probes), and reports the tier's state and counters in :class:`RemoteStatus`. What each
order asks the store and counts is in :mod:`.remote_calls`.

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

A call that never returns (a network partition without a reset, a store that stops
answering) is caught by a watchdog: the I/O process's main loop asks
:meth:`RemoteThread.overdue_s` about once a second, and a call running past its deadline
(``IoProcessConfig.remote_call_timeout_s``) gets the thread replaced
(:meth:`RemoteThread.replace`): the stuck call's order is answered as failed (a read BAD, so
the scheduler frees its host slot and recomputes the chunk; a probe as finding nothing),
the breaker trips, and a successor with a new Mooncake client takes the queued work
(answered as failed at once while the breaker is down). The stuck thread is left behind
(a daemon): it never sends, counts, or writes a host slot again, whenever its call returns,
because a remote read lands in a buffer of the thread's own and is copied into its host
slot under the lock that the replacement takes.

Replies never block under that lock, which the main loop takes to hand work over: a reply
is queued in the thread's outbox and sent without blocking; when the scheduler does not
take replies (ZMQ's high-water mark reached), the thread takes no new work and retries every
``OUTBOX_RETRY_S``, releasing the lock meanwhile, so the main loop's local SSD work and its
watchdog go on. A replacement takes the outbox over and sends it first: replies decided
before the replacement are delivered, none decided after it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, TypeVar

import zmq

from pcr_sglang.core.orders import IoOutcome, ProbeRemote, ReadChunk
from pcr_sglang.io import remote_calls
from pcr_sglang.io.protocol import SOURCE_REMOTE, Done, Probed, RemoteStatus, Reply, reply_encoder
from pcr_sglang.io.remote_calls import RemoteCounters, RemoteFaults
from pcr_sglang.tiers.records import ChunkRecord
from pcr_sglang.tiers.remote_store import RemoteChunkStore, RemoteConfigError, RemoteError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MAX_BACKOFF_S = 30.0
STATUS_INTERVAL_S = 1.0
OUTBOX_RETRY_S = 0.01  # how often replies the scheduler has not taken yet are sent again


@dataclass(frozen=True)
class _Running:
    """The call the thread is in: its order (None: a connect or a health query; a
    ``(key, record)`` pair: a write) and when it began."""

    item: Any
    started: float


class RemoteThread:
    def __init__(
        self,
        store: RemoteChunkStore,
        ctx: zmq.SyncContext,
        replies_endpoint: str,
        slot: Callable[[int], memoryview],
        faults: Optional[RemoteFaults] = None,
        on_read: Optional[Callable[[bytes, ChunkRecord, bytes], None]] = None,
        deadline_s: float = 10.0,
        new_store: Optional[Callable[[], RemoteChunkStore]] = None,
    ):
        self.store = store
        self.new_store = new_store  # a fresh client of the same store, for a successor (replace)
        self.slot = slot
        self.on_read = on_read  # (key, verified header, payload copy): the main loop caches it locally
        self.faults = faults
        self.deadline_s = deadline_s  # a call running longer is given up on (see overdue_s)
        self.counters = RemoteCounters()
        self.healthy = False
        self.error = "not connected yet"
        self._opened = False
        self._retry_at = 0.0
        self._backoff_s = 1.0
        self._probes: collections.deque[ProbeRemote] = collections.deque()
        self._urgent: collections.deque[ReadChunk] = collections.deque()
        self._reads: collections.deque[ReadChunk] = collections.deque()
        self._writes: collections.deque[tuple[bytes, bytes | bytearray]] = collections.deque()  # (key, record)
        self._cv = threading.Condition()
        # Where a read lands before it is copied into its host slot (under _cv, and only
        # while the thread has not been replaced: a late read never writes a reused slot).
        self._scratch = bytearray(store.codec.layout.slot_bytes)
        self._running: Optional[_Running] = None
        self._replaced = False  # given up on: it never sends, counts or writes a slot again
        self._failed: list[tuple[Any, str]] = []  # a predecessor's hung order, answered first as failed
        self._outbox: collections.deque[bytes] = collections.deque()  # replies decided, not sent yet (under _cv)
        self._ctx = ctx
        self._socket = ctx.socket(zmq.PUSH)  # this thread's own (ZMQ sockets are per thread)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._replies_endpoint = replies_endpoint
        self._last_status: Optional[tuple[bool, str, tuple[float, ...]]] = None
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

    # ------------------------------------------------------------------ the watchdog (main loop)
    def overdue_s(self, now: Optional[float] = None) -> float:
        """How long the call in progress has run, if longer than ``deadline_s`` (0: none
        is, or the thread is idle). ``now``: time.monotonic() unless given."""
        now = time.monotonic() if now is None else now
        with self._cv:
            running = self._running
            if running is None or self._replaced:
                return 0.0
            elapsed = now - running.started
            return elapsed if elapsed > self.deadline_s else 0.0

    def replace(self, why: str) -> RemoteThread:
        """Give this thread up (its call hangs) and return its successor, not started yet: a
        new client of the same store, this thread's counters and breaker state with the
        breaker tripped, its queued work, and the hung order to answer first as failed.
        From here on this thread answers nothing, counts nothing and writes no host slot."""
        if self.new_store is None:
            raise ValueError("RemoteThread.replace needs the new_store factory it was built with")
        with self._cv:
            self._replaced = True
            running, self._running = self._running, None
            queues = (self._probes, self._urgent, self._reads, self._writes)
            self._probes, self._urgent, self._reads, self._writes = (collections.deque() for _ in range(4))
            counters, self.counters = self.counters, RemoteCounters()  # its late counts go nowhere
            on_read, self.on_read = self.on_read, None
            outbox, self._outbox = self._outbox, collections.deque()  # decided before: the successor sends them
        successor = RemoteThread(
            self.new_store(),
            self._ctx,
            self._replies_endpoint,
            self.slot,
            self.faults,
            on_read,
            self.deadline_s,
            self.new_store,
        )
        successor.counters = counters
        successor._outbox = outbox
        successor._probes, successor._urgent, successor._reads, successor._writes = queues
        successor.healthy, successor._backoff_s = self.healthy, self._backoff_s
        counters.calls_timed_out += 1
        counters.errors += 1
        item = running.item if running is not None else None
        if isinstance(item, (ReadChunk, ProbeRemote)):
            successor._failed.append((item, why))
        elif isinstance(item, tuple):
            counters.writes_failed += 1
        successor._down(why)
        return successor

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

    def write(self, key: bytes, record: bytes | bytearray) -> None:
        with self._cv:  # re-entrant: has_room takes the same lock
            if not self.has_room():
                return
            self._writes.append((key, record))
            self._cv.notify()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        self._socket.connect(self._replies_endpoint)
        try:
            if not self._drain_outbox():
                return
            for item, why in self._failed:  # a predecessor's hung order: failed, whatever the breaker says
                self._fail(item, f"remote tier: {why}")
            self._failed = []
            if self._begin(None):
                try:
                    self._call(lambda: None)  # connect at start, not at the first request
                except RemoteError:
                    pass  # down: retried after the back-off
            if not self._end():
                return
            self._send_status(force=True)
            while True:
                if not self._drain_outbox():  # no new work while the scheduler takes no replies
                    return
                item = queue = None
                with self._cv:
                    while not (self._probes or self._urgent or self._reads or self._writes):
                        if self._replaced:
                            return
                        # mutant: remote-idle-thread-never-asks-the-store
                        if not self.healthy and time.monotonic() >= self._retry_at:
                            break  # down, back-off over, nothing to do: ask the store itself
                        wait = (
                            STATUS_INTERVAL_S
                            if self.healthy
                            else max(min(self._retry_at - time.monotonic(), STATUS_INTERVAL_S), 0.01)
                        )
                        self._cv.wait(wait)
                        self._send_status()
                    else:
                        queue = next(q for q in (self._probes, self._urgent, self._reads, self._writes) if q)
                        item = queue.popleft()
                    if not self._begin(item):
                        return
                try:
                    if queue is None:
                        try:
                            self._call(self.store.ping)
                        except RemoteError:
                            pass
                    elif queue is self._probes:
                        remote_calls.probe(self, item)
                    elif queue is self._writes:
                        remote_calls.write(self, *item)
                    else:
                        remote_calls.read(self, item)
                except zmq.ZMQError:
                    raise  # the replies socket is gone: the process is ending
                except Exception:  # noqa: BLE001 - a bug here must not leave orders unanswered forever
                    logger.exception("PCR remote tier: unexpected error (the order is answered as failed)")
                    self._fail(item, "remote tier: internal error")
                if not self._end():
                    return
                self._send_status()
        finally:
            if self._replaced:  # given up on: whatever its late call brought was dropped
                logger.warning("PCR remote tier: a replaced remote thread ends (a call given up on returned)")
                self._socket.close(linger=0)

    def _begin(self, item: Any) -> bool:
        """A call starts (the watchdog times it); False: the thread was replaced."""
        with self._cv:
            if self._replaced:
                return False
            self._running = _Running(item, time.monotonic())
            return True

    def _end(self) -> bool:
        """The call is over; False: the thread was replaced meanwhile (it stops)."""
        with self._cv:
            self._running = None
            return not self._replaced

    def _fail(self, item: Any, error: str) -> None:
        """Answer an order as failed (a read BAD: its slot is freed and the chunk
        recomputed; a probe as finding nothing)."""
        if isinstance(item, ReadChunk):
            self._answer(
                Done(item.seq, IoOutcome.BAD, error, source=SOURCE_REMOTE), final=True, counts={"read_failed": 1}
            )
        elif isinstance(item, ProbeRemote):
            self._answer(Probed(item.seq, [0] * len(item.chains), error), final=True)

    def _call(self, fn: Callable[[], _T]) -> _T:
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
            if self._replaced:  # given up on already: the successor keeps the breaker
                raise RemoteError("the call was given up on") from None
            self.counters.errors += 1
            self._down(str(e))
            raise RemoteError(self.error) from None
        if self._replaced:  # it returned after all, too late: what it brought is not used
            raise RemoteError("the call was given up on")
        if not self.healthy:
            logger.warning("PCR remote tier: reachable%s", " again" if self.counters.outages else "")
        self.healthy, self.error, self._backoff_s = True, "", 1.0
        return result

    def _down(self, why: str) -> None:
        if self.healthy or self.counters.outages == 0:
            self.counters.outages += 1
            logger.warning(
                "PCR remote tier down (%s): serving from the local tiers; retrying in %.0f s", why, self._backoff_s
            )
        self.healthy, self.error = False, why
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)

    def _answer(
        self,
        reply: Reply,
        final: bool = False,
        into_slot: Optional[int] = None,
        counts: Optional[dict[str, float]] = None,
    ) -> bool:
        """Add ``counts`` to the counters, copy the read into host slot ``into_slot`` and send
        ``reply``, unless the thread was replaced: then none of it happens, and False is
        returned. ``final``: it answers the call in progress, which the watchdog stops timing."""
        with self._cv:
            if self._replaced:
                return False
            for name, value in (counts or {}).items():
                setattr(self.counters, name, getattr(self.counters, name) + value)
            if into_slot is not None:
                memoryview(self.slot(into_slot)).cast("B")[:] = self._scratch
            if final:
                self._running = None
            # mutant: remote-reply-sent-blocking-under-the-lock
            self._outbox.append(reply_encoder.encode(reply))
            self._send_outbox()
            return True

    def _send_outbox(self) -> bool:
        """Send the outbox's replies in order without blocking (under ``_cv``); False when
        some wait (the scheduler has not taken enough replies yet)."""
        while self._outbox:
            try:
                self._socket.send(self._outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._outbox.popleft()
        return True

    def _drain_outbox(self) -> bool:
        """Wait until every reply decided is sent, releasing the lock between tries (the
        main loop hands work over and runs its watchdog meanwhile); False: replaced."""
        with self._cv:
            while not self._replaced and not self._send_outbox():
                self._cv.wait(OUTBOX_RETRY_S)
            return not self._replaced

    def _send_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_status_at < STATUS_INTERVAL_S:
            return
        with self._cv:
            queued_writes, queued_reads = len(self._writes), len(self._urgent) + len(self._reads)
        counters = {
            **{k: float(v) for k, v in asdict(self.counters).items()},
            "queued_writes": float(queued_writes),
            "queued_reads": float(queued_reads),
        }
        state = (self.healthy, self.error, tuple(counters.values()))
        if not force and state == self._last_status:
            return
        self._last_status, self._last_status_at = state, now
        self._answer(RemoteStatus(self.healthy, self.error, counters, os.getpid()))
