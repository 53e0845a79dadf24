"""The SSD level of the chunk tree: which chunks are persisted, and keeping that true.

The tree records residency (``node.on_ssd``); the store holds the bytes; the I/O
process (:mod:`pcr_sglang.io`) moves them, so the scheduler process does no disk I/O
once it has started (it scans the store's headers at startup). This class is the glue
the prefix cache calls at the few points where the SSD tier is involved:

* a chunk reached host memory -> :meth:`persist` orders its write
  (``--pcr-ssd-write through``), making room by evicting SSD leaves (look-ahead LRU)
  within the store's capacity;
* each scheduler step -> :meth:`prefetch` orders reads of the SSD-only chunks the first
  ``--pcr-prefetch-window`` waiting requests will need, earliest request first, within
  a budget of bytes in flight; :meth:`poll` applies completions: a written chunk becomes
  SSD-resident (only durable records are claimed), a prefetched one host-resident; on
  ENOSPC/EIO write-back stops and serving goes on;
* a host slot is about to be freed -> :meth:`before_host_free` waits for a write still
  reading it, or (``on-evict``) writes the chunk first;
* a match reaches SSD-only chunks -> :meth:`load_into_host` waits (boundedly) for a
  prefetch in flight or reads on demand; a failed read drops the chunk (recomputed);
* startup (and a cache flush) -> :meth:`restore` rebuilds the tree's SSD level from the
  store: every verified record whose whole parent chain is persisted.

If the I/O process dies or hangs, its orders come back cancelled (their slots are
released), the tier serves as if it had no SSD until the process is back, and the
supervisor restarts it with back-off.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree, NodePredicate
from pcr_sglang.core.cost_model import LoadOrRecompute
from pcr_sglang.io.client import Completion, IOProcess
from pcr_sglang.io.protocol import ReadChunk, WorkerConfig, WriteChunk
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.ssd_store import ChunkFileStore

logger = logging.getLogger(__name__)

_NO_PARENT = bytes(16)  # parent key recorded for a first chunk (its parent is the root)
NodeCallback = Callable[[ChunkNode], None]


@dataclass
class SSDTierStats:
    hit_chunks: int = 0  # chunks read back from SSD for requests (prefetched or on demand)
    read_failures: int = 0  # reads that failed or did not verify (chunk recomputed)
    written_chunks: int = 0  # writes completed and claimed by the tree
    write_errors: int = 0
    evicted_chunks: int = 0
    restored_chunks: int = 0  # found in the store at startup and put back in the tree
    orphaned_records: int = 0  # records whose parent chain was not persisted (deleted)
    recompute_chosen_chunks: int = 0  # SSD hits the cost model left to recomputation
    # Prefetch (reads ordered for waiting requests) and its timeliness.
    prefetch_issued: int = 0
    prefetch_completed: int = 0
    prefetch_in_time: int = 0  # in host memory before its request was scheduled
    prefetch_late: int = 0  # still in flight when its request was admitted
    prefetch_wasted: int = 0  # loaded, then left host memory or the window unused
    prefetch_cancelled: int = 0  # in flight when the I/O process failed
    on_demand_reads: int = 0  # read when its request was scheduled, no prefetch
    bytes_read_prefetch: int = 0
    bytes_read_on_demand: int = 0
    max_queue_depth: int = 0  # longest waiting queue seen by the prefetcher
    io_failures: int = 0
    io_restarts: int = 0
    cancelled_writes: int = 0


class SSDTier:
    def __init__(self, tree: ChunkTree, store: ChunkFileStore, host_pool: HostChunkPool,
                 chunk_size: int, write_through: bool = True, prefetch_window: int = 16,
                 prefetch_budget_bytes: int = 256 << 20, wait_budget_s: float = 2.0):
        self.tree = tree
        self.store = store
        self.host_pool = host_pool
        self.chunk_size = chunk_size
        self.write_through = write_through
        self.prefetch_window = prefetch_window
        self.prefetch_budget_chunks = max(prefetch_budget_bytes // store.record_bytes, 1)
        self.wait_budget_s = wait_budget_s
        self.writes_enabled = True
        self.stats = SSDTierStats()
        self.cost_model = LoadOrRecompute()
        self._writing: dict[ChunkNode, int] = {}  # node -> seq of its write (reads its host slot)
        # node -> (seq, host slot being filled, whether a request is waiting for it now)
        self._reading: dict[ChunkNode, tuple[int, int, bool]] = {}
        self._prefetched: set[ChunkNode] = set()  # landed by prefetch, not yet used by a request
        self._bad: list[ChunkNode] = []  # SSD-resident nodes whose record failed to read
        self._cancelling: set[ChunkNode] = set()  # prefetch reads asked to be dropped
        layout = host_pool.layout
        self.io = IOProcess(WorkerConfig(
            store_root=str(store.root), namespace_hex=store.namespace.hex(), dtype=store.dtype,
            num_slots=layout.num_slots, num_layers=layout.num_layers, chunk_size=layout.chunk_size,
            row_bytes=layout.row_bytes, reserve_bytes=store.low_watermark_bytes,
            shm_name=host_pool.info().shm_name, orders_endpoint="", replies_endpoint="", parent_pid=0,
        ))
        if not self.io.wait_ready():
            logger.warning("PCR I/O process did not start; the SSD tier waits for its restart")
        # Set by the owner: how to free a host slot (SSD eviction can drop host copies),
        # and how to make sure no device copy still touches host memory (on CUDA the
        # copies are asynchronous; the I/O process reads and writes the same bytes).
        self.free_host_slot: NodeCallback = lambda node: None
        self.host_fence: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ startup
    def restore(self) -> int:
        """Put the store's verified records back in the (empty) tree, parents first."""
        records = sorted(self.store.scan(), key=lambda r: r.depth)
        by_key: dict[bytes, ChunkNode] = {}
        for record in records:
            parent = None if record.depth == 1 else by_key.get(record.parent_key)
            if record.depth > 1 and (parent is None or parent.depth != record.depth - 1):
                self.store.delete(record.key)  # unreachable: its prefix was never persisted
                self.stats.orphaned_records += 1
                continue
            if record.key in (parent or self.tree.root).children:
                continue
            by_key[record.key] = self.tree.add_persisted(parent, record.key)
        self.stats.restored_chunks += len(by_key)
        excess = self.tree.ssd_chunks - self.store.capacity_chunks
        if excess > 0:
            self.evict(excess, None)
        if by_key or self.stats.orphaned_records:
            logger.info("PCR SSD tier: restored %d chunks from %s (%d unreachable records deleted)",
                        len(by_key), self.store.dir, self.stats.orphaned_records)
        return len(by_key)

    # ------------------------------------------------------------------ completions
    def poll(self) -> None:
        """Apply the I/O process's completions (and cancellations after a failure)."""
        for completion in self.io.poll():
            if isinstance(completion.order, WriteChunk):
                self._write_done(completion)
            elif isinstance(completion.order, ReadChunk):
                self._read_done(completion)
        self.stats.io_failures = self.io.failures
        self.stats.io_restarts = self.io.restarts

    def _write_done(self, completion: Completion) -> None:
        node: ChunkNode = completion.handle
        self._writing.pop(node, None)
        if completion.done is None:
            self.stats.cancelled_writes += 1  # the chunk stays host-resident; may be written later
            return
        if not completion.done.ok:
            self.stats.write_errors += 1
            if self.writes_enabled:
                self.writes_enabled = False
                logger.warning(
                    "PCR SSD tier: writing to %s failed (%s); SSD write-back is stopped, serving "
                    "continues from device and host memory (chunks already on SSD stay readable)",
                    self.store.dir, completion.done.error,
                )
            return
        if node.parent is not None and not node.on_ssd:
            self.tree.set_ssd(node)
            self.stats.written_chunks += 1
        elif node.parent is None and not any(n.key == node.key for n in self._writing):
            # The chunk left the tree while it was being written (and no chunk with the
            # same key, re-created since, has a write of its own in flight).
            self.store.delete(completion.order.key)

    def _read_done(self, completion: Completion) -> None:
        node: ChunkNode = completion.handle
        _, slot, on_demand = self._reading.pop(node)
        self._cancelling.discard(node)
        landed = completion.ok and node.parent is not None and node.on_ssd and not node.on_host
        if completion.done is None or completion.done.cancelled:
            if not on_demand:
                self.stats.prefetch_cancelled += 1
            self.host_pool.free([slot])
            return
        if completion.ok:
            self.cost_model.observe_read(completion.done.seconds)
            if on_demand:
                self.stats.bytes_read_on_demand += self.store.record_bytes
            else:
                self.stats.prefetch_completed += 1
                self.stats.bytes_read_prefetch += self.store.record_bytes
        if landed:
            self.tree.set_host(node, slot)
            if not on_demand:
                self._prefetched.add(node)
            return
        self.host_pool.free([slot])
        if completion.done is not None and not completion.done.ok:
            self.stats.read_failures += 1
            if node.parent is not None and node.on_ssd:
                self._bad.append(node)  # dropped by the owner once no lock holds it

    # ------------------------------------------------------------------ writes
    def persist(self, node: ChunkNode, is_protected: Optional[NodePredicate]) -> bool:
        """Order ``node``'s (host-resident) write to the store."""
        if (not self.writes_enabled or not self.io.healthy or node.on_ssd or node in self._writing
                or not node.on_host or node.parent is None):
            return False
        if self.tree.ssd_chunks + len(self._writing) >= self.store.capacity_chunks:
            # Locked meanwhile: the SSD eviction may drop chunks, but never this chain.
            self.tree.lock(node)
            try:
                evicted = self.evict(1, is_protected)
            finally:
                self.tree.unlock(node)
            if not evicted:
                return False
        self.host_fence()
        parent = node.parent
        parent_key = parent.key if parent.depth > 0 else _NO_PARENT
        seq = self.io.submit_write(node.key, parent_key, node.depth, self.chunk_size, node.host_slot, handle=node)
        if seq is None:
            return False
        self._writing[node] = seq
        return True

    def writing(self, node: ChunkNode) -> bool:
        return node in self._writing

    def before_host_evict(self, node: ChunkNode) -> None:
        """``node`` is being evicted from host memory: with ``on-evict`` it is written
        first (so it stays in the tree, on SSD), then its slot is released as below."""
        if node not in self._writing and not self.write_through:
            self.persist(node, None)
        self.before_host_free(node)

    def before_host_free(self, node: ChunkNode) -> None:
        """``node``'s host slot is about to be freed: no write may still read it."""
        seq = self._writing.get(node)
        if seq is not None:
            # Bounded: a hung process is killed by the health check inside wait(), which
            # cancels the order, so the slot is never freed under a live write.
            while self.io.is_pending(seq):
                self.io.wait(seq, timeout_s=1.0)
            self.poll()
        self._prefetched.discard(node)

    # ------------------------------------------------------------------ reads
    def prefetch(self, window_chains: Iterable[list[ChunkNode]], queue_depth: int,
                 alloc_host_slot: Callable[[], Optional[int]]) -> None:
        """Order reads of the SSD-only chunks of the waiting requests' matched chains
        (earliest request first, each chain in order) within the in-flight budget."""
        self.stats.max_queue_depth = max(self.stats.max_queue_depth, queue_depth)
        needed: set[ChunkNode] = set()
        # In flight and landed-but-unused prefetches may fill at most half the host tier:
        # past that, each new read would evict an earlier prefetch before its request ran.
        room = self.host_pool.layout.num_slots // 2 - len(self._reading) - len(self._prefetched)
        budget = min(self.prefetch_budget_chunks - len(self._reading), room)
        for chain in window_chains:
            for node in chain:
                needed.add(node)
                if node.on_host or node.on_device or node in self._reading or not node.on_ssd:
                    continue
                if budget <= 0 or not self.io.healthy:
                    continue
                slot = alloc_host_slot()
                if slot is None:
                    budget = 0
                    continue
                self.host_fence()
                seq = self.io.submit_read(node.key, slot, handle=node)
                if seq is None:
                    self.host_pool.free([slot])
                    budget = 0
                    continue
                self._reading[node] = (seq, slot, False)
                self.stats.prefetch_issued += 1
                budget -= 1
        # Prefetched chunks no waiting request in the window needs any more: unprotected;
        # reads for them that have not started are cancelled (their slots come back).
        stale = [n for n in self._prefetched if n not in needed]
        for node in stale:
            self._prefetched.discard(node)
            self.stats.prefetch_wasted += 1
        for node, (seq, _, on_demand) in self._reading.items():
            if not on_demand and node not in needed and node not in self._cancelling:
                self._cancelling.add(node)
                self.io.cancel(seq)

    def protected(self, node: ChunkNode) -> bool:
        """Evicted from host memory last: being written, or prefetched and not yet used."""
        return node in self._writing or node in self._prefetched

    def worth_loading(self) -> bool:
        """The cost model's verdict for the next SSD-only chunk of a match."""
        if self.cost_model.should_load(self.chunk_size):
            return True
        self.stats.recompute_chosen_chunks += 1
        return False

    def note_used(self, node: ChunkNode) -> bool:
        """A request's match is about to use host-resident ``node``: True if a prefetch
        brought it from SSD (in time)."""
        if node not in self._prefetched:
            return False
        self._prefetched.discard(node)
        self.stats.prefetch_in_time += 1
        self.stats.hit_chunks += 1
        return True

    def retry_bad_later(self, node: ChunkNode) -> None:
        self._bad.append(node)

    def prefetching(self, node: ChunkNode) -> bool:
        """A prefetch read of ``node`` is in flight."""
        return node in self._reading and not self._reading[node][2]

    def count_late(self, chunks: int) -> None:
        """``chunks`` prefetches were still in flight when the request that needed them was
        admitted. Counted by the owner at admission, not when a match finds them in flight:
        SGLang matches a waiting request in passes that do not admit it, and a read in
        flight then may land before the pass that does."""
        self.stats.prefetch_late += chunks

    def load_into_host(self, node: ChunkNode, alloc_host_slot: Callable[[], Optional[int]]) -> str:
        """Bring SSD-only ``node`` into host memory for a request being scheduled.

        A prefetch still in flight is moved to the front of the I/O queue and waited for
        (the caller counts it late if its request is admitted). Returns "ok"
        (host-resident now), "skip" (not worth or not possible now: the caller recomputes
        from here) or "bad" (the record failed: the caller drops it).
        """
        if not self.io.healthy:
            return "skip"
        if node in self._cancelling:
            # Its prefetch is being cancelled: let that settle, then read it on demand.
            self.io.wait(self._reading[node][0], self.wait_budget_s)
            self.poll()
            if node in self._reading:
                return "skip"
        if node.on_host:  # the cancelled read had finished after all
            self._prefetched.discard(node)
            self.stats.hit_chunks += 1
            return "ok"
        if node in self._reading:
            seq = self._reading[node][0]
            self.io.expedite(seq)  # ahead of the other prefetches: a request waits for it
        else:
            if not self.worth_loading():
                return "skip"
            slot = alloc_host_slot()
            if slot is None:
                return "skip"
            self.host_fence()
            seq = self.io.submit_read(node.key, slot, handle=node, urgent=True)
            if seq is None:
                self.host_pool.free([slot])
                return "skip"
            self._reading[node] = (seq, slot, True)
            self.stats.on_demand_reads += 1
        budget = self._wait_budget_s()
        self.io.wait(seq, budget)
        self.poll()
        if node.on_host:
            self._prefetched.discard(node)
            self.stats.hit_chunks += 1
            return "ok"
        if node in self._bad:
            return "bad"
        return "skip"  # still in flight past the budget: recompute; the read lands later

    def take_bad_records(self) -> list[ChunkNode]:
        """Nodes whose SSD record failed to read, for the owner to drop (when unlocked)."""
        bad, self._bad = self._bad, []
        return bad

    def _wait_budget_s(self) -> float:
        """How long a scheduled request may wait for one chunk: what recomputing the
        chunk would cost, within ``wait_budget_s``."""
        speed = self.cost_model.prefill_tokens_per_second
        if speed is None:
            return self.wait_budget_s
        return min(self.wait_budget_s, max(self.chunk_size / speed, 0.005))

    # ------------------------------------------------------------------ eviction
    def delete_record(self, node: ChunkNode) -> None:
        """The tree drops ``node``'s SSD residency: delete its record."""
        self.store.delete(node.key)

    def evict(self, num_chunks: int, is_protected: Optional[NodePredicate]) -> int:
        evicted = self.tree.evict_ssd(num_chunks, on_evict=self.delete_record, is_protected=is_protected,
                                      on_drop_host=self.free_host_slot, on_drop_ssd=self.delete_record)
        self.stats.evicted_chunks += len(evicted)
        return len(evicted)

    # ------------------------------------------------------------------ lifecycle
    def forget_pending(self) -> None:
        """Before the tree is reset: let outstanding orders finish and drop their claims."""
        if not self.io.wait_idle(timeout_s=60):
            self.io.fail("did not finish its orders before a cache reset")  # cancels them
        for completion in self.io.poll():
            if isinstance(completion.order, ReadChunk):
                self.host_pool.free([completion.order.host_slot])
        self._writing, self._reading, self._prefetched, self._bad = {}, {}, set(), []
        self._cancelling = set()

    @property
    def io_slots(self) -> int:
        """Host slots being filled by reads (owned by no node yet)."""
        return len(self._reading)

    def timeliness(self) -> Optional[float]:
        """Share of SSD chunks needed by scheduled requests that were already in host
        memory when their request was scheduled."""
        needed = self.stats.prefetch_in_time + self.stats.prefetch_late + self.stats.on_demand_reads
        return self.stats.prefetch_in_time / needed if needed else None

    def report(self) -> dict[str, Any]:
        return {
            "dir": str(self.store.dir),
            "capacity_chunks": self.store.capacity_chunks,
            "capacity_bytes": self.store.capacity_bytes,
            "chunks": self.tree.ssd_chunks,
            "writes_in_flight": len(self._writing),
            "reads_in_flight": len(self._reading),
            "writes_enabled": self.writes_enabled,
            "write_policy": "through" if self.write_through else "on-evict",
            "prefetch_window": self.prefetch_window,
            "prefetch_timeliness": self.timeliness(),
            "io_process": {"pid": self.io.pid, "healthy": self.io.healthy},
            "counters": asdict(self.stats),
            "cost_model": asdict(self.cost_model),
            "store": asdict(self.store.stats),  # this process's own store I/O (startup scan)
        }

    def close(self) -> None:
        self.io.close()
