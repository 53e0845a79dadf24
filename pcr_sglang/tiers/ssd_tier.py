"""The SSD level of the chunk tree: which chunks are persisted, and keeping that true.

The tree records residency (``node.on_ssd``); the store holds the bytes; this class is
the glue the prefix cache calls at the few points where the SSD tier is involved:

* a chunk reached host memory -> :meth:`persist` submits it to the background writer
  (``--pcr-ssd-write through``), making room by evicting SSD leaves (look-ahead LRU)
  within the store's capacity;
* each scheduler step -> :meth:`drain` marks completed writes SSD-resident (only durable
  records are ever claimed) and, on ENOSPC/EIO, stops write-back and keeps serving;
* a host slot is about to be freed -> :meth:`before_host_free` waits for a write still
  reading it, or (``on-evict``) writes the chunk first;
* a match reaches SSD-only chunks -> :meth:`read_into_host` reads and verifies one; a
  failed read drops the chunk (it is recomputed), never returns wrong bytes;
* startup (and a cache flush) -> :meth:`restore` rebuilds the tree's SSD level from the
  store: every verified record whose whole parent chain is persisted.

Scheduler thread only; the write-back thread touches nothing here but the store and
the host pool's bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree, NodePredicate
from pcr_sglang.core.cost_model import LoadOrRecompute
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_sglang.tiers.write_back import WriteBack

logger = logging.getLogger(__name__)

_NO_PARENT = bytes(16)  # parent key recorded for a first chunk (its parent is the root)


@dataclass
class SSDTierStats:
    hit_chunks: int = 0  # chunks read back from SSD for requests
    read_failures: int = 0  # reads that failed or did not verify (chunk recomputed)
    written_chunks: int = 0  # writes completed and claimed by the tree
    write_errors: int = 0
    evicted_chunks: int = 0
    restored_chunks: int = 0  # found in the store at startup and put back in the tree
    orphaned_records: int = 0  # records whose parent chain was not persisted (deleted)
    recompute_chosen_chunks: int = 0  # SSD hits the cost model left to recomputation


class SSDTier:
    def __init__(self, tree: ChunkTree, store: ChunkFileStore, host_pool: HostChunkPool,
                 chunk_size: int, write_through: bool = True):
        self.tree = tree
        self.store = store
        self.host_pool = host_pool
        self.chunk_size = chunk_size
        self.write_through = write_through
        self.writer = WriteBack(store, host_pool)
        self.writes_enabled = True
        self.stats = SSDTierStats()
        self.cost_model = LoadOrRecompute()
        self._writing: dict[ChunkNode, int] = {}  # node -> host slot its pending write reads

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
            self.evict(excess, None, None)
        if by_key or self.stats.orphaned_records:
            logger.info("PCR SSD tier: restored %d chunks from %s (%d unreachable records deleted)",
                        len(by_key), self.store.dir, self.stats.orphaned_records)
        return len(by_key)

    # ------------------------------------------------------------------ writes
    def persist(self, node: ChunkNode, is_protected: Optional[NodePredicate],
                free_host_slot: Callable[[ChunkNode], None]) -> bool:
        """Write ``node`` (host-resident) to the store in the background."""
        if (not self.writes_enabled or node.on_ssd or node in self._writing or not node.on_host
                or node.parent is None):
            return False
        if self.tree.ssd_chunks + len(self._writing) >= self.store.capacity_chunks:
            if not self.evict(1, is_protected, free_host_slot):
                return False
        parent = node.parent
        parent_key = parent.key if parent.depth > 0 else _NO_PARENT
        self.writer.submit(node.key, parent_key, node.depth, self.chunk_size, node.host_slot, handle=node)
        self._writing[node] = node.host_slot
        return True

    def drain(self) -> None:
        """Claim completed writes for the tree; stop write-back on a disk fault."""
        for result in self.writer.drain():
            node: ChunkNode = result.order.handle
            self._writing.pop(node, None)
            if result.error is not None:
                self.stats.write_errors += 1
                if self.writes_enabled:
                    self.writes_enabled = False
                    logger.warning(
                        "PCR SSD tier: writing to %s failed (%s); SSD write-back is stopped, serving "
                        "continues from device and host memory (chunks already on SSD stay readable)",
                        self.store.dir, result.error,
                    )
                continue
            if node.parent is not None and not node.on_ssd:
                self.tree.set_ssd(node)
                self.stats.written_chunks += 1
            else:  # the chunk left the tree while it was being written
                self.store.delete(result.order.key)

    def writing(self, node: ChunkNode) -> bool:
        return node in self._writing

    def before_host_free(self, node: ChunkNode) -> None:
        """``node``'s host slot is about to be freed: no write may still read it, and with
        ``on-evict`` the chunk is written first (so it stays in the tree, on SSD)."""
        if node in self._writing:
            self.writer.wait_slot(self._writing[node])
            self.drain()
        elif not self.write_through and self.writes_enabled and not node.on_ssd and node.parent is not None:
            if self.persist(node, None, lambda n: None):
                self.writer.wait_slot(node.host_slot)
                self.drain()

    # ------------------------------------------------------------------ reads
    def worth_loading(self) -> bool:
        """The cost model's verdict for the next SSD-only chunk of a match."""
        if self.cost_model.should_load(self.chunk_size):
            return True
        self.stats.recompute_chosen_chunks += 1
        return False

    def read_into_host(self, node: ChunkNode, slot: int) -> bool:
        """Read ``node``'s record into host slot ``slot``; False (and the chunk is to be
        dropped by the caller) if it is missing or fails verification."""
        start = time.perf_counter()
        ok = self.store.read_into(node.key, self.host_pool.slot_view(slot).numpy())
        if ok:
            self.cost_model.observe_read(time.perf_counter() - start)
            self.stats.hit_chunks += 1
        else:
            self.stats.read_failures += 1
        return ok

    # ------------------------------------------------------------------ eviction
    def delete_record(self, node: ChunkNode) -> None:
        """The tree drops ``node``'s SSD residency: delete its record."""
        self.store.delete(node.key)

    def evict(self, num_chunks: int, is_protected: Optional[NodePredicate],
              free_host_slot: Optional[Callable[[ChunkNode], None]]) -> int:
        def delete(node: ChunkNode) -> None:
            self.store.delete(node.key)

        evicted = self.tree.evict_ssd(num_chunks, on_evict=delete, is_protected=is_protected,
                                      on_drop_host=free_host_slot)
        self.stats.evicted_chunks += len(evicted)
        return len(evicted)

    # ------------------------------------------------------------------ lifecycle
    def forget_pending(self) -> None:
        """Before the tree is reset: let pending writes finish and drop their claims."""
        self.writer.wait_idle(timeout_s=60)
        self.writer.drain()
        self._writing = {}

    def report(self) -> dict[str, Any]:
        return {
            "dir": str(self.store.dir),
            "capacity_chunks": self.store.capacity_chunks,
            "capacity_bytes": self.store.capacity_bytes,
            "chunks": self.tree.ssd_chunks,
            "writes_in_flight": len(self._writing),
            "writes_enabled": self.writes_enabled,
            "write_policy": "through" if self.write_through else "on-evict",
            "counters": asdict(self.stats),
            "cost_model": asdict(self.cost_model),
            "store": asdict(self.store.stats),
        }

    def close(self) -> None:
        self.writer.close()
