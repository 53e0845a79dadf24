"""CacheState: the one owner of where every chunk's KV lives and what every host slot holds.

Every change of residency (device, host, SSD and the remote tier behind it) and of host-slot
state happens in CacheState or one of its parts, and nowhere else. It keeps the chunk tree
and coordinates four parts, each a class of its own module that takes the tree, returns the
work it decides in the caller's :class:`~pcr_sglang.core.effects.Effects` and checks its own
invariants (:meth:`CacheState.check`):

* ``host``, the :class:`~pcr_sglang.core.host_tier.HostTier`: host slots, host eviction and
  the decode offloads' reservations;
* ``ledger``, the :class:`~pcr_sglang.core.io_ledger.IoLedger`: every read and write in
  flight, stored once;
* ``ssd``, the :class:`~pcr_sglang.core.ssd_residency.SsdTier`: write-back, reads, their
  outcomes, SSD eviction, restore and remote adoption;
* ``prefetch``, the :class:`~pcr_sglang.core.prefetch_plan.PrefetchPlanner`: what is read
  ahead for waiting requests and live KV hints.

CacheState itself keeps the device tier (insert, device eviction, loads), the look-ahead
protection, the counters and the agreed run flags. The I/O process's results come back
through :meth:`CacheState.apply_outcomes`. The state knows nothing of SGLang, torch or
files, and is deterministic given its inputs: with tensor parallelism every rank drives its
own copy with the same agreed inputs (:mod:`pcr_sglang.core.agreement`), so all ranks decide
the same prefix lengths.

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

import logging
from typing import Any, Callable, Iterable, Optional, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree, InsertOutcome
from pcr_sglang.core.cost_model import LoadOrRecompute
from pcr_sglang.core.effects import ChainMatch, Effects
from pcr_sglang.core.hint_chains import HintedChain, HintedChains, LiveHint
from pcr_sglang.core.host_slots import HostSlots, SlotState
from pcr_sglang.core.host_tier import HostTier
from pcr_sglang.core.io_ledger import IoLedger
from pcr_sglang.core.keys import ChunkKey
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_sglang.core.orders import DeleteChunk, IoOutcome
from pcr_sglang.core.prefetch import UnusedReads
from pcr_sglang.core.prefetch_plan import PrefetchPlanner
from pcr_sglang.core.ssd_residency import PersistedChunk, SsdTier
from pcr_sglang.core.state_config import DECODE_OFFLOAD_SHARE, CacheStateConfig
from pcr_sglang.core.stats import CacheStats, SSDStats

logger = logging.getLogger(__name__)

__all__ = ["DECODE_OFFLOAD_SHARE", "CacheState", "CacheStateConfig"]


class CacheState:
    def __init__(self, config: CacheStateConfig):
        if config.ssd_capacity_chunks and not config.host_slots:
            raise ValueError("the SSD tier needs the host tier")
        self.chunk_size = config.chunk_size
        self.tree = ChunkTree()
        self.slots = HostSlots(config.host_slots) if config.host_slots else None
        self.lookahead = LookaheadProtection(self.tree, config.lookahead_window)
        self.cost_model = LoadOrRecompute()
        self.stats = CacheStats()
        self.ssd_stats = SSDStats()
        self.unused = UnusedReads(self.ssd_stats)  # reads landed that no request has used yet
        self.hint_chains = HintedChains(self.tree)  # the live KV hints' matched chains
        self.host = HostTier(config, self.tree, self.slots, self.stats, self.lookahead, self.unused, self.hint_chains)
        self.ledger = IoLedger(self.slots)
        self.ssd = SsdTier(
            config,
            self.tree,
            self.host,
            self.ledger,
            self.lookahead,
            self.cost_model,
            self.ssd_stats,
            self.unused,
            self.hint_chains,
        )
        self.host.write_back = self.ssd
        self.prefetch = PrefetchPlanner(self.ssd, self.host, self.ledger, self.unused, self.hint_chains, self.ssd_stats)
        self.prefer_load = True  # agreed across TP ranks each scheduler step, as the SSD tier's io_healthy

    @property
    def config(self) -> CacheStateConfig:
        """The settings (the SSD tier holds them: its capacity is the one that changes at run time)."""
        return self.ssd.config

    # ------------------------------------------------------------------ matching
    def match(self, keys: Iterable[ChunkKey], touch: bool = True) -> ChainMatch:
        """The cached chain of ``keys``, split by tier. Changes nothing but recency."""
        nodes = self.tree.match(keys, touch=touch).nodes
        device = 0
        while device < len(nodes) and nodes[device].on_device:
            device += 1
        host = device
        while host < len(nodes) and self.host.loadable(nodes[host]):
            host += 1
        ssd = host
        while ssd < len(nodes) and nodes[ssd].on_ssd and not nodes[ssd].on_host:
            ssd += 1
        return ChainMatch(nodes, device, host - device, ssd - host)

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
        evicted = self.tree.evict(
            num_chunks,
            on_evict=lambda n: self._leave_device(n, effects),
            is_protected=protected,
            on_drop_host=lambda n: self.host.release(n, effects),
            on_drop_ssd=lambda n: self.ssd.forget(n, effects),
        )
        if protected is not None:
            self.stats.evicted_protected_chunks += sum(1 for n in evicted if protected(n))
        self.stats.evicted_chunks += len(evicted)
        return len(evicted)

    def _leave_device(self, node: ChunkNode, effects: Effects) -> None:
        self.hint_chains.residency_changed(node)
        if self.slots is not None and not node.on_host:
            slot = self.host.take_slot(SlotState.RESIDENT, node, effects)
            if slot is None:
                self.stats.dropped_chunks += 1
            else:
                effects.demotions[node] = (node.device_value, slot)
                self.tree.set_host(node, slot)
                self.stats.demoted_chunks += 1
                self.stats.bytes_device_to_host += self.config.chunk_bytes
                self.host.became_resident(node, effects)
        effects.device_frees.append(node.device_value)

    def commit_load(self, nodes: Sequence[ChunkNode], device_values: Sequence[Any]) -> int:
        """Host-resident ``nodes`` (a chain continuing the device prefix) were copied into
        ``device_values``; returns how many of them had been read from SSD for it."""
        from_ssd = 0
        for node, value in zip(nodes, device_values):
            if node.on_device or not self.host.loadable(node):
                raise RuntimeError(f"{node!r} is not a host-only chunk: it cannot be loaded")
            self.tree.set_device(node, value)
            if self.unused.used(node):
                from_ssd += 1
        self.stats.bytes_host_to_device += len(nodes) * self.config.chunk_bytes
        return from_ssd

    # ------------------------------------------------------------------ reset
    def reset(self, keep_persisted: bool = True) -> Effects:
        """Forget every chunk but the persisted ones (``/flush_cache``); with
        ``keep_persisted=False`` the persisted ones too (the weights changed: what the SSD
        holds was computed with the old ones). Orders in flight are orphaned: their slots
        are released when they complete. Returns the deletes of persisted chunks whose
        parent chain is not persisted (no longer reachable)."""
        effects = Effects()
        persisted = self.ssd.persisted_chunks() if self.ssd.enabled and keep_persisted else []
        self.ledger.orphan_all()
        self.ssd.reset()
        self.unused.clear()
        self.hint_chains.reset()
        self.tree.reset()
        self.host.reset()  # after the ledger: a slot an orphaned order still touches stays releasing
        self.lookahead.clear()
        if persisted:
            restored = self.ssd_stats.restored_chunks
            effects.orders.extend(DeleteChunk(key) for key in self.ssd.restore(persisted))
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

    def count_hold(self, seconds: float, expired: bool) -> None:
        """A request's hold for its SSD reads ended after ``seconds`` (it goes at this pass);
        ``expired``: its wait ran out before the reads landed."""
        self.ssd_stats.held_requests += 1
        self.ssd_stats.held_expired += int(expired)
        self.ssd_stats.held_ms += round(seconds * 1000)

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
        self.ssd.io_healthy = io_healthy
        self.prefer_load = prefer_load

    def stop_io(self) -> None:
        """The ranks' I/O views were inconsistent: nothing is read or written any more."""
        self.ssd.io_healthy = self.ssd.writes_enabled = False

    def stop_writes(self) -> None:
        """No SSD writes from here on (the store could not be opened); reads go on."""
        self.ssd.writes_enabled = False

    @property
    def io_healthy(self) -> bool:
        """The I/O process serves reads and writes (agreed across the TP ranks)."""
        return self.ssd.io_healthy

    @property
    def writes_enabled(self) -> bool:
        """SSD write-back goes on (off after a failed write, or when the store could not be opened)."""
        return self.ssd.writes_enabled

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
        """Verify each part's bookkeeping: the tree's, the host slots' against the tree, and
        the I/O ledger's against the slots (tests and debugging)."""
        self.tree.check_invariants()
        self.host.check()
        self.ledger.check()

    # ------------------------------------------------------------------ the parts' operations
    @property
    def ssd_enabled(self) -> bool:
        return self.ssd.enabled

    def reserve_offload_slot(self, owner: Any, effects: Effects, *, decode: bool) -> Optional[int]:
        """A host slot for a chunk a forward will compute (:meth:`HostTier.reserve_offload_slot`)."""
        return self.host.reserve_offload_slot(owner, effects, decode=decode)

    @property
    def decode_reserved_slots(self) -> int:
        return self.host.decode_reserved_slots

    @property
    def decode_offload_limit(self) -> int:
        return self.host.decode_offload_limit

    def adopt_offload(self, node: ChunkNode, slot: int, effects: Effects) -> None:
        """The chunk computed into reserved ``slot`` is ``node`` (:meth:`HostTier.adopt_offload`)."""
        self.host.adopt_offload(node, slot, effects)

    def release_reserved(self, slot: int) -> None:
        self.host.release_reserved(slot)

    def order_reads(
        self, nodes: Sequence[ChunkNode], effects: Effects, *, urgent: bool, limit: int, hint: bool = False
    ) -> int:
        """Order reads of the SSD-only chunks of a chain (:meth:`SsdTier.order_reads`)."""
        return self.ssd.order_reads(nodes, effects, urgent=urgent, limit=limit, hint=hint)

    def abandon_reads(self, nodes: Iterable[ChunkNode]) -> None:
        """The request waiting for these reads left (:meth:`SsdTier.abandon_reads`)."""
        self.ssd.abandon_reads(nodes)

    def reading(self, node: ChunkNode) -> bool:
        return self.ledger.reading(node)

    @property
    def reads_in_flight(self) -> int:
        return self.ledger.reads_in_flight

    @property
    def writes_in_flight(self) -> int:
        return self.ledger.writes_in_flight

    def outstanding(self) -> list[int]:
        """Sequence numbers of reads and writes ordered and not yet applied, ascending."""
        return self.ledger.outstanding()

    def apply_outcomes(self, outcomes: Iterable[tuple[int, IoOutcome, float]], effects: Effects) -> None:
        """Apply finished orders: ``(seq, outcome, seconds)``, the same on every rank."""
        self.ssd.apply_outcomes(outcomes, effects)

    def landed(self, node: ChunkNode) -> bool:
        """``node`` was read from SSD and no admitted request has used it yet."""
        return node in self.unused

    def plan_prefetch(
        self,
        chains: Sequence[Sequence[ChunkNode]],
        keep: Iterable[ChunkNode],
        effects: Effects,
        queue_depth: int,
        hinted: Sequence[LiveHint] = (),
    ) -> None:
        """Each scheduler step's read-ahead (:meth:`PrefetchPlanner.plan`)."""
        self.prefetch.plan(chains, keep, effects, queue_depth, hinted)

    def hint_promotable(self, chain: HintedChain, most: int) -> list[ChunkNode]:
        """What a live hint's chain would load on to the device now (:meth:`PrefetchPlanner.hint_promotable`)."""
        return self.prefetch.hint_promotable(chain, most)

    def promotable(self, nodes: Sequence[ChunkNode]) -> Sequence[ChunkNode]:
        """The leading run of host-resident ``nodes`` a hint may load on to the device (:class:`UnusedReads`)."""
        return self.unused.promotable(nodes)

    def count_hinted(self, nodes: Iterable[ChunkNode]) -> set[ChunkNode]:
        """A request needs ``nodes`` now (:meth:`PrefetchPlanner.count_hinted`)."""
        return self.prefetch.count_hinted(nodes)

    def promote(self, nodes: Sequence[ChunkNode], device_values: Sequence[Any]) -> None:
        """KV hints: host-resident ``nodes`` of a hinted chain (continuing its device
        prefix) were copied into free device slots ``device_values`` before any request
        needs them. They are ordinary device chunks from here (evictable, demoted for free:
        their host copy stays); those read for a hint still count as its, in time, when
        their request comes."""
        self.unused.promoted_now(nodes)
        self.commit_load(nodes, device_values)
        self.ssd_stats.hint_promoted += len(nodes)

    def restore(self, records: Iterable[PersistedChunk]) -> list[ChunkKey]:
        """Put persisted chunks back in the (empty) tree (:meth:`SsdTier.restore`)."""
        return self.ssd.restore(records)

    def adopt_remote(self, keys: Sequence[ChunkKey], start: int, present: int, effects: Effects) -> int:
        """Enter chunks a remote probe found, at the SSD level (:meth:`SsdTier.adopt_remote`)."""
        return self.ssd.adopt_remote(keys, start, present, effects)

    def persisted_chunks(self) -> list[PersistedChunk]:
        return self.ssd.persisted_chunks()

    def resize_ssd(self, capacity_chunks: int) -> None:
        """The SSD tier is another store now, of this capacity (:meth:`SsdTier.resize`)."""
        self.ssd.resize(capacity_chunks)
