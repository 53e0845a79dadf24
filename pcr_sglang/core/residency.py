"""CacheState: the one owner of where every chunk's KV lives and what every host slot holds.

Every change of residency (device, host, SSD and the remote tier behind it) and of host-slot state happens here, and
nowhere else. Decisions that need work done (copy a chunk to host memory, free device
slots, read or write a record) return it as :class:`~pcr_sglang.core.effects.Effects`;
the I/O process's results come back through :meth:`CacheState.apply_outcomes`. The
state knows nothing of SGLang, torch or files, and is deterministic given its inputs:
with tensor parallelism every rank drives its own copy with the same agreed inputs
(:mod:`pcr_sglang.core.agreement`), so all ranks decide the same prefix lengths.

Eviction order per tier: unlocked leaves, least recently used first; chunks the
look-ahead window protects go last, and in host memory so do chunks read from SSD that
their request has not used yet. A chunk leaving the device is copied to host memory (if
there is a host tier; if host memory has no slot to give, the chunk is dropped); with
``write_through`` a chunk reaching host memory is written to SSD in the background,
otherwise it is written when host eviction first picks it (with the host-resident chain
above it, which eviction takes next). A chunk being written stays in host memory until
the write is done: eviction never waits for the disk. Offloads planned by decode steps
take free host slots only, never a tree chunk's, and at most ``DECODE_OFFLOAD_SHARE`` of
the tier (:meth:`CacheState.reserve_offload_slot`).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree, InsertOutcome
from pcr_sglang.core.cost_model import LoadOrRecompute
from pcr_sglang.core.effects import ChainMatch, Effects
from pcr_sglang.core.hint_chains import HintedChain, HintedChains, LiveHint
from pcr_sglang.core.host_slots import HostSlots, SlotState
from pcr_sglang.core.keys import NO_PARENT, ChunkKey
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_sglang.core.orders import DeleteChunk, IoOutcome, ReadChunk, Reorder, WriteChunk
from pcr_sglang.core.prefetch import UnusedReads, prefetch_budgets
from pcr_sglang.core.stats import CacheStats, SSDStats

logger = logging.getLogger(__name__)

# Share of the host tier that decode-time offloads may hold reserved at once. A chunk a
# decode step completes enters the tree only when its request finishes, so its slot is
# outside the tree (not evictable) for the rest of the generation: unbounded, long
# generations would take every free slot. A quarter, next to prefetch reads' half
# (:meth:`CacheState.plan_prefetch`), leaves at least a quarter to the tree's host chunks,
# prefill offloads and demotions. A chunk over the share is simply not offloaded: it stays
# device-resident in the tree when its request ends (as with the radix cache) and is
# copied to host memory if eviction takes it off the device later.
DECODE_OFFLOAD_SHARE = 0.25


@dataclass(frozen=True)
class CacheStateConfig:
    chunk_size: int
    lookahead_window: int = 8
    host_slots: int = 0  # 0: no host tier
    chunk_bytes: int = 0  # bytes of one chunk in host memory (for the transfer counters)
    ssd_capacity_chunks: int = 0  # 0: no SSD tier
    write_through: bool = True
    prefetch_budget_chunks: int = 0
    hint_budget_chunks: int = 0  # most chunks read for KV hints and held (in flight or landed, unused)
    decode_offload_share: float = DECODE_OFFLOAD_SHARE


@dataclass(frozen=True)
class PersistedChunk:
    """A record found in the SSD store (or kept across a cache reset)."""

    key: ChunkKey
    parent_key: ChunkKey
    depth: int


@dataclass
class _PendingIo:
    is_read: bool
    node: ChunkNode
    slot: int
    urgent: bool = False  # a request waits for it (ordered on demand, or a prefetch expedited)
    prefetch: bool = False  # ordered by the prefetcher
    orphaned: bool = False  # ordered for a tree that has been reset since


class CacheState:
    def __init__(self, config: CacheStateConfig):
        if config.ssd_capacity_chunks and not config.host_slots:
            raise ValueError("the SSD tier needs the host tier")
        self.config = config
        self.chunk_size = config.chunk_size
        self.tree = ChunkTree()
        self.slots = HostSlots(config.host_slots) if config.host_slots else None
        self.lookahead = LookaheadProtection(self.tree, config.lookahead_window)
        self.cost_model = LoadOrRecompute()
        self.stats = CacheStats()
        self.ssd_stats = SSDStats()
        self._seq = itertools.count(1)
        self._pending: dict[int, _PendingIo] = {}
        self._reading: dict[ChunkNode, int] = {}
        self._writing: dict[ChunkNode, int] = {}
        self._cancelling: set[int] = set()
        self.unused = UnusedReads(self.ssd_stats)  # reads landed that no request has used yet
        self.hint_chains = HintedChains(self.tree)  # the live KV hints' matched chains
        self._bad: list[ChunkNode] = []  # SSD records found bad while their chain was locked
        self._decode_reserved: set[int] = set()  # host slots reserved by decode-time offloads
        self.decode_offload_limit = int(config.host_slots * config.decode_offload_share)
        # Agreed across TP ranks each scheduler step (on one rank: this rank's own view).
        self.io_healthy = True
        self.prefer_load = True
        # Off after a write fails (an agreed outcome, so the same on every rank).
        self.writes_enabled = True

    @property
    def ssd_enabled(self) -> bool:
        return self.config.ssd_capacity_chunks > 0

    # ------------------------------------------------------------------ matching
    def match(self, keys: Iterable[ChunkKey], touch: bool = True) -> ChainMatch:
        """The cached chain of ``keys``, split by tier. Changes nothing but recency."""
        nodes = self.tree.match(keys, touch=touch).nodes
        device = 0
        while device < len(nodes) and nodes[device].on_device:
            device += 1
        host = device
        while host < len(nodes) and self._loadable(nodes[host]):
            host += 1
        ssd = host
        while ssd < len(nodes) and nodes[ssd].on_ssd and not nodes[ssd].on_host:
            ssd += 1
        return ChainMatch(nodes, device, host - device, ssd - host)

    def _loadable(self, node: ChunkNode) -> bool:
        slot = node.host_slot  # on_host
        return slot is not None and self.slots is not None and self.slots.state(slot) is SlotState.RESIDENT

    def lock(self, node: ChunkNode) -> int:
        return self.tree.lock(node)

    def unlock(self, node: ChunkNode) -> int:
        return self.tree.unlock(node)

    # ------------------------------------------------------------------ device tier
    def insert(self, keys: Sequence[ChunkKey], device_values: Sequence[Any]) -> InsertOutcome:
        outcome = self.tree.insert(keys, device_values)
        self.stats.inserted_chunks += len(outcome.new_nodes)
        return outcome

    def evict_device(self, num_chunks: int, effects: Effects) -> int:
        """Take up to ``num_chunks`` chunks off the device (demoting them to host memory)."""
        protected = self._lookahead_predicate()
        evicted = self.tree.evict(num_chunks, on_evict=lambda n: self._leave_device(n, effects),
                                  is_protected=protected, on_drop_host=lambda n: self._release_host(n, effects),
                                  on_drop_ssd=lambda n: self._forget_record(n, effects))
        if protected is not None:
            self.stats.evicted_protected_chunks += sum(1 for n in evicted if protected(n))
        self.stats.evicted_chunks += len(evicted)
        return len(evicted)

    def _leave_device(self, node: ChunkNode, effects: Effects) -> None:
        self.hint_chains.residency_changed(node)
        if self.slots is not None and not node.on_host:
            slot = self._take_slot(SlotState.RESIDENT, node, effects)
            if slot is None:
                self.stats.dropped_chunks += 1
            else:
                effects.demotions[node] = (node.device_value, slot)
                self.tree.set_host(node, slot)
                self.stats.demoted_chunks += 1
                self.stats.bytes_device_to_host += self.config.chunk_bytes
                self._became_host_resident(node, effects)
        effects.device_frees.append(node.device_value)

    # ------------------------------------------------------------------ host tier
    def _take_slot(self, state: SlotState, owner: Any, effects: Effects, may_evict: bool = True) -> Optional[int]:
        assert self.slots is not None
        slot = self.slots.alloc(state, owner)
        if slot is None and may_evict and self._evict_host(1, effects):
            slot = self.slots.alloc(state, owner)
        return slot

    def _evict_host(self, num_chunks: int, effects: Effects) -> int:
        """Free host slots of LRU host leaves. A chunk being written to SSD is pinned (not a
        leaf) until the write is done: eviction never waits for the disk. With the
        ``on-evict`` write policy, the first unpersisted leaf eviction meets is written
        (with the host-resident chain above it, which eviction takes next) and stays, and
        the walk ends at the next one: no eviction orders writes for the whole tier."""
        on_evict_writes = [1] if not self.config.write_through and self._may_write() else [0]

        def take(node: ChunkNode) -> Optional[bool]:
            if node.on_ssd or self.config.write_through or not self._may_write():
                return True
            if not on_evict_writes[0]:
                return None
            on_evict_writes[0] -= 1
            above: Optional[ChunkNode] = node
            while above is not None and above.parent is not None and above.on_host and not above.on_ssd:
                self._persist(above, effects)
                above = above.parent
            return node not in self._writing  # not written (no room on SSD): it may go

        release = lambda n: self._release_host(n, effects)  # noqa: E731
        evicted = self.tree.evict_host(num_chunks, on_evict=release, is_protected=self._host_protected,
                                       on_drop_host=release,
                                       on_drop_ssd=lambda n: self._forget_record(n, effects), take=take)
        self.stats.host_evicted_chunks += len(evicted)
        return len(evicted)

    def _host_protected(self, node: ChunkNode) -> bool:
        return node in self.lookahead or node in self.unused

    def _release_host(self, node: ChunkNode, effects: Effects) -> None:
        """``node`` is leaving host memory (the tree clears ``host_slot`` right after). If
        this decision demoted it, that copy is not made: the slot may go to another chunk."""
        assert self.slots is not None and node.host_slot is not None
        self.hint_chains.residency_changed(node)
        if effects.demotions.pop(node, None) is not None:
            self.stats.demoted_chunks -= 1
            self.stats.bytes_device_to_host -= self.config.chunk_bytes
        self.slots.release(node.host_slot)
        self.unused.used(node)

    def _became_host_resident(self, node: ChunkNode, effects: Effects) -> None:
        if self.config.write_through and self._may_write():
            self._persist(node, effects)

    def reserve_offload_slot(self, owner: Any, effects: Effects, *, decode: bool) -> Optional[int]:
        """A host slot for a chunk a forward will compute (copied there as it is written).
        A prefill's chunk enters the tree at the checkpoint right after its forward, and
        may evict host chunks for its slot. A decode step's chunk waits for its request to
        finish: it takes only a free slot, never a tree chunk's, and only while decode
        offloads hold less than their share (``decode_offload_limit``); None otherwise."""
        if self.slots is None:
            return None
        if not decode:
            return self._take_slot(SlotState.RESERVED, owner, effects)
        if len(self._decode_reserved) >= self.decode_offload_limit:
            return None
        slot = self._take_slot(SlotState.RESERVED, owner, effects, may_evict=False)
        if slot is not None:
            self._decode_reserved.add(slot)
        return slot

    @property
    def decode_reserved_slots(self) -> int:
        """Host slots decode-time offloads hold reserved now (at most ``decode_offload_limit``)."""
        return len(self._decode_reserved)

    def adopt_offload(self, node: ChunkNode, slot: int, effects: Effects) -> None:
        """The chunk computed into reserved ``slot`` is ``node``: it is host-resident now,
        unless the tree already had a host copy (the reserved slot is released)."""
        assert self.slots is not None
        self._decode_reserved.discard(slot)
        if node.on_host or node.parent is None:
            self.slots.release(slot)
            return
        self.slots.bind(slot, node)
        self.tree.set_host(node, slot)
        self.stats.offloaded_chunks += 1
        self.stats.bytes_device_to_host += self.config.chunk_bytes
        self._became_host_resident(node, effects)

    def release_reserved(self, slot: int) -> None:
        assert self.slots is not None
        self._decode_reserved.discard(slot)
        self.slots.release(slot)

    def commit_load(self, nodes: Sequence[ChunkNode], device_values: Sequence[Any]) -> int:
        """Host-resident ``nodes`` (a chain continuing the device prefix) were copied into
        ``device_values``; returns how many of them had been read from SSD for it."""
        from_ssd = 0
        for node, value in zip(nodes, device_values):
            if node.on_device or not self._loadable(node):
                raise RuntimeError(f"{node!r} is not a host-only chunk: it cannot be loaded")
            self.tree.set_device(node, value)
            if self.unused.used(node):
                from_ssd += 1
        self.stats.bytes_host_to_device += len(nodes) * self.config.chunk_bytes
        return from_ssd

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
        self._pending[seq] = _PendingIo(False, node, node.host_slot)
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
                self._pending[seq] = _PendingIo(True, node, slot, urgent=urgent, prefetch=not urgent)
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

    def hint_promotable(self, chain: HintedChain, most: int) -> list[ChunkNode]:
        """``--pcr-hint-to-device``: what a live hint's chain would load on to the device
        now, the host-resident run right after its device prefix (:meth:`promotable`
        cuts it), or nothing when that is more than ``most`` chunks. Costs the run's
        length, never the chain's."""
        nodes, start = chain.nodes, self.hint_chains.device_end(chain)
        if start == len(nodes) or nodes[start].host_slot is None:
            return []  # no host-resident run (the usual case)
        run: list[ChunkNode] = []
        for i in range(start, len(nodes)):
            node = nodes[i]
            if not self._loadable(node) or self.unused.queue_read(node):
                break
            if len(run) >= most:
                return []
            run.append(node)
        return run

    def promotable(self, nodes: Sequence[ChunkNode]) -> Sequence[ChunkNode]:
        """The leading run of host-resident ``nodes`` a hint may load on to the device (:class:`UnusedReads`)."""
        return self.unused.promotable(nodes)

    def promote(self, nodes: Sequence[ChunkNode], device_values: Sequence[Any]) -> None:
        """KV hints: host-resident ``nodes`` of a hinted chain (continuing its device
        prefix) were copied into free device slots ``device_values`` before any request
        needs them. They are ordinary device chunks from here (evictable, demoted for free:
        their host copy stays); those read for a hint still count as its, in time, when
        their request comes."""
        self.unused.promoted_now(nodes)
        self.commit_load(nodes, device_values)
        self.ssd_stats.hint_promoted += len(nodes)

    def count_hinted(self, nodes: Iterable[ChunkNode]) -> set[ChunkNode]:
        """A request needs ``nodes`` now: those read for a hint count as in time or late,
        once, and only as a hint's (returned; :meth:`UnusedReads.count_hinted`)."""
        return self.unused.count_hinted(nodes, self.reading)

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

    def _read_done(self, seq: int, op: _PendingIo, outcome: IoOutcome, seconds: float) -> None:
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

    def _write_done(self, seq: int, op: _PendingIo, outcome: IoOutcome, effects: Effects) -> None:
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

    # ------------------------------------------------------------------ restore and reset
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

    def reset(self, keep_persisted: bool = True) -> Effects:
        """Forget every chunk but the persisted ones (``/flush_cache``); with
        ``keep_persisted=False`` the persisted ones too (the weights changed: what the SSD
        holds was computed with the old ones). Orders in flight are orphaned: their slots
        are released when they complete. Returns the deletes of persisted chunks whose
        parent chain is not persisted (no longer reachable)."""
        effects = Effects()
        persisted = self.persisted_chunks() if self.ssd_enabled and keep_persisted else []
        for op in self._pending.values():
            op.orphaned = True
        self._reading, self._writing, self._bad = {}, {}, []
        self.unused.clear()
        self.hint_chains.reset()
        self._cancelling = set()
        self._decode_reserved = set()  # the slot table frees every reservation
        self.tree.reset()
        if self.slots is not None:
            self.slots.reset()
        self.lookahead.clear()
        if persisted:
            restored = self.ssd_stats.restored_chunks
            effects.orders.extend(DeleteChunk(key) for key in self.restore(persisted))
            self.ssd_stats.restored_chunks = restored
        return effects

    def resize_ssd(self, capacity_chunks: int) -> None:
        """The SSD tier is another store now (the namespace moved with the weights), of
        this capacity; called right after a reset that kept nothing persisted."""
        if not self.ssd_enabled or capacity_chunks <= 0:
            raise ValueError("the SSD tier cannot be added, removed or emptied of capacity at run time")
        self.config = replace(self.config, ssd_capacity_chunks=capacity_chunks)

    # ------------------------------------------------------------------ accounting
    def count_admission(self, device: int, host: int, ssd: int, in_time: int, late: int, on_demand: int) -> None:
        """A request was admitted with these chunks reused (once per request)."""
        self.stats.device_hit_chunks += device
        self.stats.host_hit_chunks += host
        self.ssd_stats.hit_chunks += ssd
        self.ssd_stats.prefetch_in_time += in_time
        self.ssd_stats.prefetch_late += late
        self.ssd_stats.on_demand_reads += on_demand

    def note_recompute_chosen(self, chunks: int) -> None:
        """The cost model left ``chunks`` SSD hits of an admission to recomputation."""
        self.ssd_stats.recompute_chosen_chunks += chunks

    def note_remote_recompute_chosen(self, chunks: int) -> None:
        """... and ``chunks`` only the remote tier holds."""
        self.ssd_stats.remote_recompute_chosen_chunks += chunks

    def note_duplicates(self, chunks: int) -> None:
        """A request computed ``chunks`` another had cached meanwhile (dropped at its checkpoint)."""
        self.stats.duplicate_chunks += chunks

    def note_io_process(self, failures: int, restarts: int) -> None:
        """The I/O process's failures and restarts so far, as its supervisor counts them."""
        self.ssd_stats.io_failures = failures
        self.ssd_stats.io_restarts = restarts

    # ------------------------------------------------------------------ agreed run flags
    def apply_agreement(self, io_healthy: bool, prefer_load: bool) -> None:
        """What the TP ranks agreed this step (on one rank: this rank's own view)."""
        self.io_healthy = io_healthy
        self.prefer_load = prefer_load

    def stop_io(self) -> None:
        """The ranks' I/O views were inconsistent: nothing is read or written any more."""
        self.io_healthy = self.writes_enabled = False

    def stop_writes(self) -> None:
        """No SSD writes from here on (the store could not be opened); reads go on."""
        self.writes_enabled = False

    def timeliness(self) -> Optional[float]:
        """Share of the SSD chunks admitted requests needed that were already in host
        memory when their request was first considered for admission."""
        s = self.ssd_stats
        needed = s.prefetch_in_time + s.prefetch_late + s.on_demand_reads
        return s.prefetch_in_time / needed if needed else None

    # ------------------------------------------------------------------ protection, checks
    def protect(self, chains: Sequence[Sequence[ChunkNode]]) -> None:
        """Look-ahead LRU: the chains of the first waiting requests are evicted last."""
        self.lookahead.protect(chains)
        self.stats.lookahead_refreshes += 1

    def _lookahead_predicate(self) -> Optional[Callable[[ChunkNode], bool]]:
        return self.lookahead.__contains__ if len(self.lookahead) else None

    def check(self) -> None:
        """Verify the tree and the slot table against each other (tests and debugging)."""
        self.tree.check_invariants()
        if self.slots is None:
            return
        resident = {n.host_slot: n for n in self.tree.iter_nodes() if n.host_slot is not None}
        self.slots.check(resident)
        for seq, op in self._pending.items():
            if not self.slots.io_pending(op.slot):
                raise AssertionError(f"order {seq} on host slot {op.slot}, which counts no I/O")
        if len(self._decode_reserved) > self.decode_offload_limit:
            raise AssertionError(f"decode offloads hold {len(self._decode_reserved)} host slots, over their "
                                 f"share of {self.decode_offload_limit}")
        for slot in self._decode_reserved:
            state = self.slots.state(slot)
            if state is not SlotState.RESERVED:
                raise AssertionError(f"host slot {slot} counts as a decode offload but is {state.value}")

