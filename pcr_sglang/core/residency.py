"""CacheState: the one owner of where every chunk's KV lives and what every host slot holds.

Every change of residency (device, host, SSD and the remote tier behind it) and of host-slot state happens here, and
nowhere else (the SSD tier's part of the class is its base, :class:`~pcr_sglang.core.ssd_residency.SsdResidency`,
in a module of its own). Decisions that need work done (copy a chunk to host memory, free device
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
from typing import Any, Callable, Iterable, Optional, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree, InsertOutcome
from pcr_sglang.core.cost_model import LoadOrRecompute
from pcr_sglang.core.effects import ChainMatch, Effects
from pcr_sglang.core.hint_chains import HintedChain, HintedChains
from pcr_sglang.core.host_slots import HostSlots, SlotState
from pcr_sglang.core.keys import ChunkKey
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_sglang.core.orders import DeleteChunk
from pcr_sglang.core.prefetch import UnusedReads
from pcr_sglang.core.ssd_residency import PendingIo, SsdResidency
from pcr_sglang.core.state_config import DECODE_OFFLOAD_SHARE, CacheStateConfig
from pcr_sglang.core.stats import CacheStats, SSDStats

logger = logging.getLogger(__name__)

__all__ = ["DECODE_OFFLOAD_SHARE", "CacheState", "CacheStateConfig"]


class CacheState(SsdResidency):
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
        self._pending: dict[int, PendingIo] = {}
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

    # ------------------------------------------------------------------ KV hints to the device
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

    # ------------------------------------------------------------------ reset
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

