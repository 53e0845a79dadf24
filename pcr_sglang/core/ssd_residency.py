"""The SSD tier's half of :class:`~pcr_sglang.core.residency.CacheState`: write-back, reads and
prefetch, the I/O process's outcomes, and what a restart or a remote probe brings back.

Not an owner of its own: :class:`SsdResidency` is a base of ``CacheState``, so these methods
run on the one state object and change residency as its other methods do (the split is by
topic, to keep each module readable, as SGLang's ``HiRadixCache`` extends ``RadixCache``). It
reads the host tier through ``CacheState``'s ``_take_slot`` and ``_release_host`` (declared
below for the type checker). Every order it decides goes into the caller's
:class:`~pcr_sglang.core.effects.Effects`; nothing here touches a file or a byte.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree
from pcr_sglang.core.cost_model import LoadOrRecompute
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.hint_chains import HintedChains, LiveHint
from pcr_sglang.core.host_slots import HostSlots, SlotState
from pcr_sglang.core.keys import NO_PARENT, ChunkKey
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_sglang.core.orders import DeleteChunk, IoOutcome, ReadChunk, Reorder, WriteChunk
from pcr_sglang.core.prefetch import UnusedReads, prefetch_budgets
from pcr_sglang.core.state_config import CacheStateConfig
from pcr_sglang.core.stats import SSDStats


@dataclass(frozen=True)
class PersistedChunk:
    """A record found in the SSD store (or kept across a cache reset)."""

    key: ChunkKey
    parent_key: ChunkKey
    depth: int


@dataclass
class PendingIo:
    """A read or write the state ordered and has not yet seen finish (one per sequence number)."""

    is_read: bool
    node: ChunkNode
    slot: int
    urgent: bool = False  # a request waits for it (ordered on demand, or a prefetch expedited)
    prefetch: bool = False  # ordered by the prefetcher
    orphaned: bool = False  # ordered for a tree that has been reset since


class SsdResidency:
    # The state it shares with CacheState (set in CacheState.__init__).
    config: CacheStateConfig
    chunk_size: int
    tree: ChunkTree
    slots: Optional[HostSlots]
    lookahead: LookaheadProtection
    cost_model: LoadOrRecompute
    ssd_stats: SSDStats
    unused: UnusedReads
    hint_chains: HintedChains
    io_healthy: bool
    writes_enabled: bool
    _seq: itertools.count[int]
    _pending: dict[int, PendingIo]
    _reading: dict[ChunkNode, int]
    _writing: dict[ChunkNode, int]
    _cancelling: set[int]
    _bad: list[ChunkNode]

    if TYPE_CHECKING:  # CacheState's host tier
        def _take_slot(self, state: SlotState, owner: Any, effects: Effects,
                       may_evict: bool = True) -> Optional[int]: ...

        def _release_host(self, node: ChunkNode, effects: Effects) -> None: ...

    @property
    def ssd_enabled(self) -> bool:
        return self.config.ssd_capacity_chunks > 0

    # ------------------------------------------------------------------ SSD writes
    def _may_write(self) -> bool:
        return self.ssd_enabled and self.writes_enabled and self.io_healthy

    def _persist(self, node: ChunkNode, effects: Effects) -> None:
        if node.on_ssd or node in self._writing or not node.on_host or node.parent is None:
            return
        if self.tree.ssd_chunks + len(self._writing) >= self.config.ssd_capacity_chunks:
            self.tree.lock(node)  # the SSD eviction may drop chunks, never this chain
            try:
                room = self._evict_ssd(1, effects)
            finally:
                self.tree.unlock(node)
            if not room:
                return
        assert self.slots is not None and node.host_slot is not None
        parent = node.parent
        seq = next(self._seq)
        self.slots.io_begin(node.host_slot)
        self.tree.pin_host(node)  # its host copy stays until the write is done
        self._pending[seq] = PendingIo(False, node, node.host_slot)
        self._writing[node] = seq
        effects.orders.append(WriteChunk(seq, node.key, parent.key if parent.depth else NO_PARENT, node.depth,
                                         self.chunk_size, node.host_slot))

    def _evict_ssd(self, num_chunks: int, effects: Effects) -> int:
        evicted = self.tree.evict_ssd(num_chunks, on_evict=lambda n: self._forget_record(n, effects),
                                      is_protected=lambda n: n in self.lookahead or n in self._reading,
                                      on_drop_host=lambda n: self._release_host(n, effects),
                                      on_drop_ssd=lambda n: self._forget_record(n, effects))
        self.ssd_stats.evicted_chunks += len(evicted)
        return len(evicted)

    def _forget_record(self, node: ChunkNode, effects: Effects) -> None:
        effects.orders.append(DeleteChunk(node.key))

    # ------------------------------------------------------------------ SSD reads
    def order_reads(self, nodes: Sequence[ChunkNode], effects: Effects, *, urgent: bool, limit: int,
                    hint: bool = False) -> int:
        """Order reads of the SSD-only chunks among ``nodes`` (a chain, in order), at most
        ``limit`` new ones; reads already in flight are moved ahead when ``urgent``.
        Returns how many were ordered. The chain is locked meanwhile, so making room in
        host memory never evicts the chain itself."""
        if not nodes or not self.ssd_enabled or not self.io_healthy:
            return 0
        ordered = 0
        self.tree.lock(nodes[-1])
        try:
            for node in nodes:
                seq = self._reading.get(node)
                if seq is not None:
                    op = self._pending[seq]
                    if urgent and not op.urgent and seq not in self._cancelling:
                        op.urgent = True
                        effects.orders.append(Reorder(seq, cancel=False))
                    continue
                if ordered >= limit and not urgent:
                    break  # nothing further to order, nor to move ahead
                if node.on_host or node.on_device or not node.on_ssd or ordered >= limit:
                    continue
                slot = self._take_slot(SlotState.FILLING, node, effects)
                if slot is None:
                    break
                assert self.slots is not None  # _take_slot found one
                seq = next(self._seq)
                self.slots.io_begin(slot)
                self._pending[seq] = PendingIo(True, node, slot, urgent=urgent, prefetch=not urgent)
                self._reading[node] = seq
                effects.orders.append(ReadChunk(seq, node.key, slot, urgent))
                ordered += 1
                if hint:
                    self.unused.hinted.add(node)
        finally:
            self.tree.unlock(nodes[-1])
        if not urgent and not hint:  # a hint's reads are counted as hint_issued
            self.ssd_stats.prefetch_issued += ordered
        return ordered

    def reading(self, node: ChunkNode) -> bool:
        return node in self._reading

    def abandon_reads(self, nodes: Iterable[ChunkNode]) -> None:
        """The request waiting for these reads left (aborted, or finished without them):
        they are no longer urgent, so the next prefetch plan cancels those no waiting
        request needs (reads already started still land and are cached)."""
        for node in nodes:
            seq = self._reading.get(node)
            if seq is not None and self._pending[seq].urgent:
                self._pending[seq].urgent = False
                self.ssd_stats.abandoned_reads += 1

    @property
    def reads_in_flight(self) -> int:
        return len(self._reading)

    @property
    def writes_in_flight(self) -> int:
        return len(self._writing)

    def landed(self, node: ChunkNode) -> bool:
        """``node`` was read from SSD and no admitted request has used it yet."""
        return node in self.unused

    def plan_prefetch(self, chains: Sequence[Sequence[ChunkNode]], keep: Iterable[ChunkNode],
                      effects: Effects, queue_depth: int, hinted: Sequence[LiveHint] = ()) -> None:
        """Each scheduler step: order the SSD-only chunks of the waiting requests' chains
        (earliest request first) within the prefetch budget and half the host tier, then
        those of the ``hinted`` hints' chains (the live KV hints, in reading order) with
        what is left, holding at most ``hint_budget_chunks`` hinted chunks (in flight or
        landed, at most a quarter of the host tier); and stop protecting (and cancel the
        reads of) chunks neither needs now. ``keep`` are other chunks still wanted (those of
        requests waiting for reads). The hints' chains are kept matched across steps
        (:mod:`pcr_sglang.core.hint_chains`): O(1) per hint while its chain is unchanged."""
        if not self.ssd_enabled:
            return
        tracked = self.hint_chains.sync(hinted)
        self.ssd_stats.max_queue_depth = max(self.ssd_stats.max_queue_depth, queue_depth)
        needed = set(keep)
        hinted_held = len(self.unused.hinted)
        budgets = prefetch_budgets(
            host_slots=self.config.host_slots, prefetch_budget=self.config.prefetch_budget_chunks,
            hint_budget=self.config.hint_budget_chunks, reads_in_flight=len(self._reading),
            unused=len(self.unused.landed), hinted_held=hinted_held,
            queue_reads_in_flight=sum(1 for op in self._pending.values()
                                      if op.is_read and not op.urgent and op.node not in self.unused.hinted))
        budget = budgets.queue
        for chain in chains:
            needed.update(chain)
            if budget > 0:
                budget -= self.order_reads(chain, effects, urgent=False, limit=budget)
        hint_room = min(budget, budgets.hint_cap)
        for hint_chain in tracked:
            if hint_room <= 0:
                break
            start = self.hint_chains.first_readable(hint_chain, self._needs_read)
            if start is None:
                continue
            # From the first chunk to read (none before it is): the chain's tail is locked
            # meanwhile, as for any read, so making room never evicts the chain itself.
            ordered = self.order_reads(hint_chain.nodes[start:], effects, urgent=False, limit=hint_room, hint=True)
            hint_room -= ordered
            self.ssd_stats.hint_issued += ordered
        hinted_chain = self.hint_chains.covers  # an index of the hinted chains, not a walk of them
        for node, seq in self._reading.items():
            op = self._pending[seq]
            if not op.urgent and node not in needed and not hinted_chain(node) and seq not in self._cancelling:
                self._cancelling.add(seq)
                effects.orders.append(Reorder(seq, cancel=True))
        self.unused.drop_unneeded(needed, hinted_chain, self.reading)

    def _needs_read(self, node: ChunkNode) -> bool:
        return node.on_ssd and not node.on_host and not node.on_device and node not in self._reading

    # ------------------------------------------------------------------ I/O outcomes
    def outstanding(self) -> list[int]:
        """Sequence numbers of reads and writes ordered and not yet applied, ascending."""
        return sorted(self._pending)

    def apply_outcomes(self, outcomes: Iterable[tuple[int, IoOutcome, float]], effects: Effects) -> None:
        """Apply finished orders: ``(seq, outcome, seconds)``, the same on every rank."""
        for seq, outcome, seconds in outcomes:
            op = self._pending.pop(seq, None)
            if op is None or outcome is IoOutcome.PENDING:
                if op is not None:
                    self._pending[seq] = op
                continue
            self._cancelling.discard(seq)
            if op.is_read:
                self._read_done(seq, op, outcome, seconds)
            else:
                self._write_done(seq, op, outcome, effects)
            assert self.slots is not None
            self.slots.io_end(op.slot)
        self._drop_bad_records(effects)

    def _read_done(self, seq: int, op: PendingIo, outcome: IoOutcome, seconds: float) -> None:
        node, slot = op.node, op.slot
        if not op.orphaned and self._reading.get(node) == seq:
            del self._reading[node]
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
        assert self.slots is not None
        if op.orphaned:
            return  # the reset already gave up the slot; io_end frees it
        landed = (outcome is IoOutcome.OK and node.parent is not None and node.on_ssd and not node.on_host)
        if landed:
            self.slots.bind(slot, node)
            self.tree.set_host(node, slot)
            self.unused.landed.add(node)
            return
        self.slots.release(slot)
        self.hint_chains.residency_changed(node)  # not read after all: a hint may read it again
        if outcome is IoOutcome.BAD:
            self.ssd_stats.read_failures += 1
            if node.parent is not None and node.on_ssd:
                self._bad.append(node)

    def _write_done(self, seq: int, op: PendingIo, outcome: IoOutcome, effects: Effects) -> None:
        node = op.node
        if not op.orphaned:
            self.tree.unpin_host(node)
            if self._writing.get(node) == seq:
                del self._writing[node]
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
            if not any(n.key == node.key for n in self._writing):
                effects.orders.append(DeleteChunk(node.key))

    def _drop_bad_records(self, effects: Effects) -> None:
        bad, self._bad = self._bad, []
        for node in bad:
            if node.parent is None or not node.on_ssd:
                continue
            if node.lock_ref:  # in a chain being served: retried at the next outcome
                self._bad.append(node)
                continue
            self.tree.drop_ssd(node, on_drop_host=lambda n: self._release_host(n, effects),
                               on_drop_ssd=lambda n: self._forget_record(n, effects))

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
            self._evict_ssd(excess, effects)
            unreachable.extend(o.key for o in effects.orders if isinstance(o, DeleteChunk))
        return unreachable

    def adopt_remote(self, keys: Sequence[ChunkKey], start: int, present: int, effects: Effects) -> int:
        """A probe found ``keys[start:start + present]`` in the remote tier (``keys`` a
        chain from the root): enter those past the tree's match at the SSD level, where
        reads, prefetch and eviction treat them as any SSD chunk (the I/O process reads
        them from the remote tier when the local SSD has no record; their eviction deletes
        nothing remote). Only an extension of the current match is entered: a chain that
        lost chunks below ``start`` since the probe is left as it is. Returns how many."""
        if not self.ssd_enabled or present <= 0:
            return 0
        end = start + present
        nodes = self.tree.match(keys[:end], touch=False).nodes
        if len(nodes) < start:
            return 0
        parent = nodes[-1] if nodes else None
        for key in keys[len(nodes):end]:
            parent = self.tree.add_persisted(parent, key, remote_only=True)
        added = end - len(nodes)
        self.tree.match(iter(keys[:end]))  # the most recent now: a request is about to read them
        self.ssd_stats.remote_adopted_chunks += added
        excess = self.tree.ssd_chunks - self.config.ssd_capacity_chunks
        if excess > 0:
            self._evict_ssd(excess, effects)
        return added

    def persisted_chunks(self) -> list[PersistedChunk]:
        return [PersistedChunk(n.key, n.parent.key if n.parent.depth else NO_PARENT, n.depth)
                for n in self.tree.iter_nodes() if n.on_ssd and n.parent is not None]  # the root holds no KV

    def resize_ssd(self, capacity_chunks: int) -> None:
        """The SSD tier is another store now (the namespace moved with the weights), of
        this capacity; called right after a reset that kept nothing persisted."""
        if not self.ssd_enabled or capacity_chunks <= 0:
            raise ValueError("the SSD tier cannot be added, removed or emptied of capacity at run time")
        self.config = replace(self.config, ssd_capacity_chunks=capacity_chunks)
