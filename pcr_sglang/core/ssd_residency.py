"""The SSD tier: write-back, reads, the I/O process's outcomes, and what a restart or a remote
probe brings back.

A part of :class:`~pcr_sglang.core.residency.CacheState`, on its tree. It orders reads and
writes (each recorded once, in the :class:`~pcr_sglang.core.io_ledger.IoLedger`), applies
their outcomes, evicts SSD leaves and enters persisted or remote chunks. It takes host slots
from, and gives them back to, the :class:`~pcr_sglang.core.host_tier.HostTier` below which
it sits, and is that tier's :class:`~pcr_sglang.core.host_tier.WriteBack`. Every order it
decides goes into the caller's :class:`~pcr_sglang.core.effects.Effects`; nothing here
touches a file or a byte. What to read ahead is the prefetch planner's
(:mod:`pcr_sglang.core.prefetch_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree
from pcr_sglang.core.cost_model import LoadOrRecompute
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.hint_chains import HintedChains
from pcr_sglang.core.host_slots import SlotState
from pcr_sglang.core.host_tier import HostTier
from pcr_sglang.core.io_ledger import IoLedger, PendingIo
from pcr_sglang.core.keys import NO_PARENT, ChunkKey
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_sglang.core.orders import DeleteChunk, IoOutcome, ReadChunk, Reorder, WriteChunk
from pcr_sglang.core.prefetch import UnusedReads
from pcr_sglang.core.state_config import CacheStateConfig
from pcr_sglang.core.stats import SSDStats

__all__ = ["PendingIo", "PersistedChunk", "SsdTier"]


@dataclass(frozen=True)
class PersistedChunk:
    """A record found in the SSD store (or kept across a cache reset)."""

    key: ChunkKey
    parent_key: ChunkKey
    depth: int


class SsdTier:
    def __init__(
        self,
        config: CacheStateConfig,
        tree: ChunkTree,
        host: HostTier,
        ledger: IoLedger,
        lookahead: LookaheadProtection,
        cost_model: LoadOrRecompute,
        ssd_stats: SSDStats,
        unused: UnusedReads,
        hint_chains: HintedChains,
    ):
        self.config = config  # replaced when the SSD tier is resized (the one setting that changes)
        self.tree = tree
        self.host = host
        self.ledger = ledger
        self.lookahead = lookahead
        self.cost_model = cost_model
        self.ssd_stats = ssd_stats
        self.unused = unused
        self.hint_chains = hint_chains
        self.bad: list[ChunkNode] = []  # SSD records found bad while their chain was locked
        # Agreed across TP ranks each scheduler step (on one rank: this rank's own view).
        self.io_healthy = True
        # Off after a write fails (an agreed outcome, so the same on every rank).
        self.writes_enabled = True

    @property
    def enabled(self) -> bool:
        return self.config.ssd_capacity_chunks > 0

    # ------------------------------------------------------------------ SSD writes (the host tier's WriteBack)
    def may_write(self) -> bool:
        return self.enabled and self.writes_enabled and self.io_healthy

    def writing(self, node: ChunkNode) -> bool:
        return self.ledger.writing(node)

    def persist(self, node: ChunkNode, effects: Effects) -> None:
        if node.on_ssd or self.ledger.writing(node) or not node.on_host or node.parent is None:
            return
        if self.tree.ssd_chunks + self.ledger.writes_in_flight >= self.config.ssd_capacity_chunks:
            self.tree.lock(node)  # the SSD eviction may drop chunks, never this chain
            try:
                room = self.evict(1, effects)
            finally:
                self.tree.unlock(node)
            if not room:
                return
        assert node.host_slot is not None
        parent = node.parent
        seq = self.ledger.begin_write(node, node.host_slot)
        self.tree.pin_host(node)  # its host copy stays until the write is done
        effects.orders.append(
            WriteChunk(
                seq,
                node.key,
                parent.key if parent.depth else NO_PARENT,
                node.depth,
                self.config.chunk_size,
                node.host_slot,
            )
        )

    def evict(self, num_chunks: int, effects: Effects) -> int:
        evicted = self.tree.evict_ssd(
            num_chunks,
            on_evict=lambda n: self.forget(n, effects),
            is_protected=lambda n: n in self.lookahead or self.ledger.reading(n),
            on_drop_host=lambda n: self.host.release(n, effects),
            on_drop_ssd=lambda n: self.forget(n, effects),
        )
        self.ssd_stats.evicted_chunks += len(evicted)
        return len(evicted)

    def forget(self, node: ChunkNode, effects: Effects) -> None:
        effects.orders.append(DeleteChunk(node.key))

    # ------------------------------------------------------------------ SSD reads
    def order_reads(
        self, nodes: Sequence[ChunkNode], effects: Effects, *, urgent: bool, limit: int, hint: bool = False
    ) -> int:
        """Order reads of the SSD-only chunks among ``nodes`` (a chain, in order), at most
        ``limit`` new ones; reads already in flight are moved ahead when ``urgent``.
        Returns how many were ordered. The chain is locked meanwhile, so making room in
        host memory never evicts the chain itself."""
        if not nodes or not self.enabled or not self.io_healthy:
            return 0
        ordered = 0
        self.tree.lock(nodes[-1])
        try:
            for node in nodes:
                if self.ledger.reading(node):
                    seq = self.ledger.expedite(node) if urgent else None
                    if seq is not None:
                        effects.orders.append(Reorder(seq, cancel=False))
                    continue
                if ordered >= limit and not urgent:
                    break  # nothing further to order, nor to move ahead
                if node.on_host or node.on_device or not node.on_ssd or ordered >= limit:
                    continue
                slot = self.host.take_slot(SlotState.FILLING, node, effects)
                if slot is None:
                    break
                seq = self.ledger.begin_read(node, slot, urgent=urgent)
                effects.orders.append(ReadChunk(seq, node.key, slot, urgent))
                ordered += 1
                if hint:
                    self.unused.hinted.add(node)
        finally:
            self.tree.unlock(nodes[-1])
        if not urgent and not hint:  # a hint's reads are counted as hint_issued
            self.ssd_stats.prefetch_issued += ordered
        return ordered

    def abandon_reads(self, nodes: Iterable[ChunkNode]) -> None:
        """The request waiting for these reads left (aborted, or finished without them):
        they are no longer urgent, so the next prefetch plan cancels those no waiting
        request needs (reads already started still land and are cached)."""
        for node in nodes:
            if self.ledger.abandon(node):
                self.ssd_stats.abandoned_reads += 1

    # ------------------------------------------------------------------ I/O outcomes
    def apply_outcomes(self, outcomes: Iterable[tuple[int, IoOutcome, float]], effects: Effects) -> None:
        """Apply finished orders: ``(seq, outcome, seconds)``, the same on every rank."""
        for seq, outcome, seconds in outcomes:
            if outcome is IoOutcome.PENDING:
                continue
            op = self.ledger.finish(seq)
            if op is None:
                continue
            if op.is_read:
                self._read_done(op, outcome, seconds)
            else:
                self._write_done(op, outcome, effects)
            self.ledger.slot_done(op)
        self.drop_bad_records(effects)

    def _read_done(self, op: PendingIo, outcome: IoOutcome, seconds: float) -> None:
        node, slot = op.node, op.slot
        if outcome is IoOutcome.OK:
            # The local SSD's read time (a remote read's outcome carries 0: its time is
            # timed apart, IOSupervisor.take_remote_read_seconds). A chunk read from the
            # remote tier is local from now on: in host memory, and the I/O process keeps
            # a copy on the local SSD.
            self.cost_model.observe_read(seconds)
            self.tree.mark_ssd_local(node)
            if op.prefetch:
                self.ssd_stats.prefetch_completed += 1
                self.ssd_stats.bytes_read_prefetch += self.config.chunk_bytes
            else:
                self.ssd_stats.bytes_read_on_demand += self.config.chunk_bytes
        elif outcome is IoOutcome.CANCELLED:
            self.ssd_stats.cancelled_reads += 1
            if op.prefetch:
                self.ssd_stats.prefetch_cancelled += 1
        slots = self.host.slots
        assert slots is not None
        if op.orphaned:
            return  # the reset already gave up the slot; io_end frees it
        landed = outcome is IoOutcome.OK and node.parent is not None and node.on_ssd and not node.on_host
        if landed:
            slots.bind(slot, node)
            self.tree.set_host(node, slot)
            self.unused.landed.add(node)
            return
        slots.release(slot)
        self.hint_chains.residency_changed(node)  # not read after all: a hint may read it again
        if outcome is IoOutcome.BAD:
            self.ssd_stats.read_failures += 1
            if node.parent is not None and node.on_ssd:
                self.bad.append(node)

    def _write_done(self, op: PendingIo, outcome: IoOutcome, effects: Effects) -> None:
        node = op.node
        if not op.orphaned:
            self.tree.unpin_host(node)
        if outcome is IoOutcome.CANCELLED:
            self.ssd_stats.cancelled_writes += 1  # the chunk stays in host memory
        elif outcome is IoOutcome.BAD:
            self.ssd_stats.write_errors += 1
            self.writes_enabled = False  # write-back stops (an agreed outcome: on every rank)
        elif not op.orphaned and node.parent is not None and not node.on_ssd:
            self.tree.set_ssd(node)
            self.ssd_stats.written_chunks += 1
        elif node.parent is None or op.orphaned:
            # The chunk left the tree while its record was being written.
            if not self.ledger.writing_key(node.key):
                effects.orders.append(DeleteChunk(node.key))

    def drop_bad_records(self, effects: Effects) -> None:
        bad, self.bad = self.bad, []
        for node in bad:
            if node.parent is None or not node.on_ssd:
                continue
            if node.lock_ref:  # in a chain being served: retried at the next outcome
                self.bad.append(node)
                continue
            self.tree.drop_ssd(
                node,
                on_drop_host=lambda n: self.host.release(n, effects),
                on_drop_ssd=lambda n: self.forget(n, effects),
            )

    # ------------------------------------------------------------------ restore
    def restore(self, records: Iterable[PersistedChunk]) -> list[ChunkKey]:
        """Put persisted chunks back in the (empty) tree, parents first; returns the keys
        of records that cannot be reached (their parent chain is not persisted) or do not
        fit the capacity, for the caller to delete."""
        unreachable: list[ChunkKey] = []
        by_key: dict[ChunkKey, ChunkNode] = {}
        # Parents first, and in key order: every TP rank then builds the same tree, with the
        # same eviction order among chunks of equal recency.
        for record in sorted(records, key=lambda r: (r.depth, r.key)):
            parent = None if record.depth == 1 else by_key.get(record.parent_key)
            if record.depth > 1 and (parent is None or parent.depth != record.depth - 1):
                unreachable.append(record.key)
                continue
            if record.key in (parent or self.tree.root).children:
                continue
            by_key[record.key] = self.tree.add_persisted(parent, record.key)
        self.ssd_stats.restored_chunks += len(by_key)
        self.ssd_stats.orphaned_records += len(unreachable)
        excess = self.tree.ssd_chunks - self.config.ssd_capacity_chunks
        if excess > 0:
            effects = Effects()
            self.evict(excess, effects)
            unreachable.extend(o.key for o in effects.orders if isinstance(o, DeleteChunk))
        return unreachable

    def adopt_remote(self, keys: Sequence[ChunkKey], start: int, present: int, effects: Effects) -> int:
        """A probe found ``keys[start:start + present]`` in the remote tier (``keys`` a
        chain from the root): enter those past the tree's match at the SSD level, where
        reads, prefetch and eviction treat them as any SSD chunk (the I/O process reads
        them from the remote tier when the local SSD has no record; their eviction deletes
        nothing remote). Only an extension of the current match is entered: a chain that
        lost chunks below ``start`` since the probe is left as it is. Returns how many."""
        if not self.enabled or present <= 0:
            return 0
        end = start + present
        nodes = self.tree.match(keys[:end], touch=False).nodes
        if len(nodes) < start:
            return 0
        parent = nodes[-1] if nodes else None
        for key in keys[len(nodes) : end]:
            parent = self.tree.add_persisted(parent, key, remote_only=True)
        added = end - len(nodes)
        # mutant: remote-adopted-chunks-not-made-recent
        self.tree.match(iter(keys[:end]))  # the most recent now: a request is about to read them
        self.ssd_stats.remote_adopted_chunks += added
        excess = self.tree.ssd_chunks - self.config.ssd_capacity_chunks
        if excess > 0:
            self.evict(excess, effects)
        return added

    def persisted_chunks(self) -> list[PersistedChunk]:
        return [
            PersistedChunk(n.key, n.parent.key if n.parent.depth else NO_PARENT, n.depth)
            for n in self.tree.iter_nodes()
            if n.on_ssd and n.parent is not None
        ]  # the root holds no KV

    def resize(self, capacity_chunks: int) -> None:
        """The SSD tier is another store now (the namespace moved with the weights), of
        this capacity; called right after a reset that kept nothing persisted."""
        if not self.enabled or capacity_chunks <= 0:
            raise ValueError("the SSD tier cannot be added, removed or emptied of capacity at run time")
        self.config = replace(self.config, ssd_capacity_chunks=capacity_chunks)

    def reset(self) -> None:
        self.bad = []
