"""The reader threads of the I/O process, and the clock that times their reads.

Kept apart from :mod:`pcr_sglang.io.process`: the process's main loop owns the order
queues and hands a read to a thread here only when one is free; how the threads answer,
signal that they are free again and charge each read its share of the disk's busy time
is this module's one job.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable, Optional

import zmq

from pcr_sglang.core.orders import IoOutcome, ReadChunk
from pcr_sglang.io.protocol import Done, reply_encoder

logger = logging.getLogger(__name__)


class BusyClock:
    """Times reads as shares of the time the disk was busy (see :class:`ReaderThreads`):
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


class ReaderThreads:
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

    def __init__(
        self, threads: int, ctx: zmq.SyncContext, replies_endpoint: str, read: Callable[[ReadChunk], Optional[Done]]
    ):
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
        self._keys: collections.Counter[bytes] = collections.Counter()
        self._orders: queue.SimpleQueue[ReadChunk] = queue.SimpleQueue()
        self._clock = BusyClock()
        self._threads = [
            threading.Thread(target=self._run, name=f"pcr-io-read-{i}", daemon=True) for i in range(threads)
        ]
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
