"""Asynchronous write-back of host-resident chunks to the SSD store.

The scheduler submits an order per chunk that reached host memory; a background thread
copies the chunk's host slot into the store (write, fsync, rename) and queues the
result; the scheduler drains results at its next step and only then marks the chunk
SSD-resident. So the scheduler never waits on the disk, and the tree (which the
scheduler alone mutates) never claims a record that is not yet durable.

The one thing the scheduler must not do meanwhile is reuse the host slot being written:
:meth:`WriteBack.wait_slot` blocks until no order reads that slot (a host eviction
calls it, and the cache evicts chunks with writes in flight last).

Orders and results carry sequence numbers, and the order protocol (read slot S, persist
as key K) is what a separate I/O process will execute later; this thread is the
in-process executor.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Optional

from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.ssd_store import ChunkFileStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteOrder:
    seq: int
    key: bytes
    parent_key: bytes
    depth: int
    num_tokens: int
    host_slot: int
    handle: Any = None  # the submitter's reference (the tree node), returned untouched


@dataclass(frozen=True)
class WriteResult:
    order: WriteOrder
    error: Optional[OSError] = None


class WriteBack:
    def __init__(self, store: ChunkFileStore, host_pool: HostChunkPool):
        self.store = store
        self.host_pool = host_pool
        self._seq = itertools.count(1)
        self._orders: queue.Queue[Optional[WriteOrder]] = queue.Queue()
        self._results: collections.deque[WriteResult] = collections.deque()
        self._cond = threading.Condition()
        self._slots_in_flight: collections.Counter[int] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="pcr-ssd-write-back", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, host_slot: int,
               handle: Any = None) -> WriteOrder:
        order = WriteOrder(next(self._seq), key, parent_key, depth, num_tokens, host_slot, handle)
        with self._cond:
            self._slots_in_flight[host_slot] += 1
        self._orders.put(order)
        return order

    def drain(self) -> list[WriteResult]:
        """Results completed since the last call, in completion order."""
        results = []
        while self._results:
            results.append(self._results.popleft())
        return results

    @property
    def in_flight(self) -> int:
        with self._cond:
            return sum(self._slots_in_flight.values())

    def wait_slot(self, host_slot: int, timeout_s: Optional[float] = None) -> bool:
        """Block until no pending order reads ``host_slot``; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._slots_in_flight[host_slot] == 0, timeout_s)

    def wait_idle(self, timeout_s: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not any(self._slots_in_flight.values()), timeout_s)

    def close(self) -> None:
        if self._thread.is_alive():
            self._orders.put(None)
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            order = self._orders.get()
            if order is None:
                return
            error: Optional[OSError] = None
            try:
                payload = self.host_pool.slot_view(order.host_slot).numpy()
                self.store.write(order.key, order.parent_key, order.depth, order.num_tokens, payload)
            except OSError as e:
                error = e
            except Exception as e:  # never let the thread die: report it as an I/O failure
                logger.exception("PCR write-back: unexpected error")
                error = OSError(str(e))
            with self._cond:
                self._results.append(WriteResult(order, error))
                self._slots_in_flight[order.host_slot] -= 1
                if self._slots_in_flight[order.host_slot] == 0:
                    del self._slots_in_flight[order.host_slot]
                self._cond.notify_all()
