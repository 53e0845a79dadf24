"""The fast tier on a CPU machine: clusters copied into host memory ahead of a search.

The datastore's cluster table may live on SSD (memory-mapped); a search that reads a
cluster from there waits for the disk. The look-ahead copies the clusters a search is
predicted to need into one preallocated host buffer while the LLM still generates the
query, on a background thread, so the search finds them in DRAM.

The buffer is cut into pages of ``page_rows`` vectors; a cluster holds whole pages, not a
contiguous range, so freeing one never needs a compaction (TeleRAG's GPU pool is a bump
allocator that copies retained clusters again). Each cluster is ``queued``, ``copying``
or ``landed``; only a landed one is searched (one still in flight counts as a miss, and
the search sends it to faiss), and a search pins what it reads, so eviction (least
recently used first, never a pinned or in-flight cluster) cannot overwrite it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Collection, Iterable, Iterator, Optional, Sequence

import numpy as np

from pcr_client.rag.ivf import ClusterTable

logger = logging.getLogger(__name__)

DEFAULT_PAGE_ROWS = 256


@dataclass
class _Cluster:
    cluster: int
    pages: list[int]
    rows: int
    state: str = "queued"  # queued -> copying -> landed
    landed: threading.Event = field(default_factory=threading.Event)
    pins: int = 0


@dataclass
class ClusterTierStats:
    submitted: int = 0  # clusters queued for copying
    landed: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0
    evicted: int = 0
    cancelled: int = 0  # evicted while still queued
    skipped_full: int = 0  # no room even after evicting what may be evicted

    @property
    def bandwidth_bytes_s(self) -> Optional[float]:
        """What the copies measured so far moved per second (None before any)."""
        return self.bytes_copied / self.copy_seconds if self.copy_seconds > 0 else None


class HostClusterTier:
    def __init__(self, table: ClusterTable, capacity_bytes: int, page_rows: int = DEFAULT_PAGE_ROWS):
        if page_rows < 1:
            raise ValueError(f"page_rows must be >= 1, got {page_rows}")
        self.table = table
        self.page_rows = page_rows
        self.page_bytes = page_rows * (table.dim * 4 + 8)
        num_pages = int(capacity_bytes) // self.page_bytes
        self.codes = self._allocate_codes(num_pages)
        self.ids = np.zeros((num_pages, page_rows), np.int64)  # on the host in every tier: merged there
        self.stats = ClusterTierStats()
        self._free = list(range(num_pages - 1, -1, -1))
        self._clusters: OrderedDict[int, _Cluster] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[int] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._copy_loop, name="pcr-rag-host-tier", daemon=True)
        self._thread.start()

    def _allocate_codes(self, num_pages: int):
        """The page buffer for the vectors (a subclass puts it in accelerator memory)."""
        return np.zeros((num_pages, self.page_rows, self.table.dim), np.float32)

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        return len(self.codes) * self.page_bytes

    def cost(self, cluster: int) -> int:
        """Bytes of the buffer cluster ``cluster`` takes (whole pages)."""
        return self._pages_for(self.table.size(cluster)) * self.page_bytes

    def _pages_for(self, rows: int) -> int:
        return -(-rows // self.page_rows)

    # ------------------------------------------------------------------ state
    def is_resident(self, cluster: int) -> bool:
        """Landed or on its way: a look-ahead need not order it again."""
        with self._lock:
            return cluster in self._clusters

    def is_landed(self, cluster: int) -> bool:
        with self._lock:
            entry = self._clusters.get(cluster)
            return entry is not None and entry.state == "landed"

    def wait_landed(self, clusters: Iterable[int], timeout_s: Optional[float] = None) -> bool:
        """Wait until every resident cluster of ``clusters`` has landed (for tests and
        benchmarks; a search never waits)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for cluster in clusters:
            with self._lock:
                entry = self._clusters.get(cluster)
            if entry is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not entry.landed.wait(left):
                return False
        return True

    # ------------------------------------------------------------------ submit
    def submit(self, clusters: Sequence[int], protect: Collection[int] = ()) -> list[int]:
        """Queue ``clusters`` (in order) for copying; returns those queued. Makes room by
        evicting least recently used landed clusters that are neither pinned nor in
        ``protect`` (the look-ahead's own ranking); a cluster that still does not fit is
        skipped."""
        queued = []
        with self._lock:
            if self._closed:
                return queued
            keep = set(protect) | set(clusters)
            for cluster in clusters:
                if cluster in self._clusters:
                    self._clusters.move_to_end(cluster)
                    continue
                rows = self.table.size(cluster)
                need = self._pages_for(rows)
                if need > len(self._free) and not self._evict(need - len(self._free), keep):
                    self.stats.skipped_full += 1
                    continue
                pages = [self._free.pop() for _ in range(need)]
                self._clusters[cluster] = _Cluster(cluster, pages, rows)
                self._queue.append(cluster)
                queued.append(cluster)
            self.stats.submitted += len(queued)
            if queued:
                self._work.notify()
        return queued

    def _evict(self, pages_needed: int, keep: Collection[int]) -> bool:
        """Free at least ``pages_needed`` pages, or free nothing and return False."""
        victims, freed = [], 0
        for cluster, entry in self._clusters.items():
            if freed >= pages_needed:
                break
            if cluster in keep or entry.pins or entry.state == "copying":
                continue
            victims.append(entry)
            freed += len(entry.pages)
        if freed < pages_needed:
            return False
        for entry in victims:
            del self._clusters[entry.cluster]
            if entry.state == "queued":
                self._queue.remove(entry.cluster)
                self.stats.cancelled += 1
            else:
                self.stats.evicted += 1
            self._free.extend(entry.pages)
        return True

    # ------------------------------------------------------------------ copy
    def _copy_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed:
                    return
                cluster = self._queue.popleft()
                entry = self._clusters[cluster]
                entry.state = "copying"
            start = time.perf_counter()
            try:
                self._copy(entry)
            except Exception:  # a read error leaves the cluster to faiss: a miss, never a wrong result
                logger.exception("PCR retrieval: copying cluster %d into the fast tier failed", cluster)
                with self._lock:
                    self._clusters.pop(cluster, None)
                    self._free.extend(entry.pages)
                entry.landed.set()  # wake waiters; it is no longer resident
                continue
            seconds = time.perf_counter() - start
            with self._lock:
                entry.state = "landed"
                self.stats.landed += 1
                self.stats.bytes_copied += self.table.nbytes(cluster)
                self.stats.copy_seconds += seconds
            entry.landed.set()

    def _copy(self, entry: _Cluster) -> None:
        rows = self.table.rows(entry.cluster)
        for n, page in enumerate(entry.pages):
            start = rows.start + n * self.page_rows
            end = min(start + self.page_rows, rows.stop)
            self.codes[page, : end - start] = self.table.codes[start:end]
            self.ids[page, : end - start] = self.table.ids[start:end]

    # ------------------------------------------------------------------ search
    @contextmanager
    def pinned(self, clusters: Iterable[int]) -> Iterator[dict[int, _Cluster]]:
        """The landed clusters among ``clusters``, pinned (not evictable) while in use:
        what :meth:`search` reads."""
        with self._lock:
            entries = [
                self._clusters[c]
                for c in set(clusters)
                # mutant: rag-unlanded-clusters-searched
                if c in self._clusters and self._clusters[c].state == "landed"
            ]
            for entry in entries:
                entry.pins += 1
                self._clusters.move_to_end(entry.cluster)
        try:
            yield {e.cluster: e for e in entries}
        finally:
            with self._lock:
                for entry in entries:
                    entry.pins -= 1

    def search(
        self, queries: np.ndarray, clusters: Sequence[Sequence[int]], k: int, pinned: dict[int, _Cluster]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` inner products of each query over its clusters, all in ``pinned``
        (from :meth:`pinned`); rows padded with ``-inf`` / ``-1`` when fewer exist."""
        n = len(queries)
        distances = np.full((n, k), -np.inf, np.float32)
        labels = np.full((n, k), -1, np.int64)
        for i, mine in enumerate(clusters):
            pages, counts = [], []
            for cluster in mine:
                entry = pinned[cluster]
                for m, page in enumerate(entry.pages):
                    pages.append(page)
                    counts.append(min(self.page_rows, entry.rows - m * self.page_rows))
            if not pages:
                continue
            scores = self._page_scores(pages, queries[i])
            top_d, top_i = top_k(
                np.concatenate([scores[j, :rows] for j, rows in enumerate(counts)]),
                np.concatenate([self.ids[page, :rows] for page, rows in zip(pages, counts)]),
                k,
            )
            distances[i, : len(top_d)] = top_d
            labels[i, : len(top_i)] = top_i
        return distances, labels

    def _page_scores(self, pages: Sequence[int], query: np.ndarray) -> np.ndarray:
        """``[len(pages), page_rows]`` inner products of ``query`` with the pages' rows
        (rows past a cluster's end hold stale vectors: the caller drops them)."""
        return np.stack([self.codes[page] @ query for page in pages])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._work.notify_all()
        self._thread.join(timeout=5)


def top_k(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` highest scores, highest first, ties by smaller id (deterministic)."""
    if len(scores) > k:
        part = np.argpartition(-scores, k - 1)[:k]
        # argpartition may cut inside a tie at the k-th score: take every tied row, then sort.
        kth = scores[part].min()
        part = np.flatnonzero(scores >= kth)
        scores, ids = scores[part], ids[part]
    order = np.lexsort((ids, -scores))[:k]
    return scores[order], ids[order]
