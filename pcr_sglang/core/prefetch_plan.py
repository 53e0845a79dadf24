"""The prefetch planner: what the SSD tier reads ahead each scheduler step, and KV hints' share.

A part of :class:`~pcr_sglang.core.residency.CacheState`, on its tree. Each step it orders
the reads of the waiting requests' chains, then of the live KV hints' chains, within the
budgets of :func:`~pcr_sglang.core.prefetch.prefetch_budgets`, cancels the reads nobody
needs any more, and counts the landed reads no request used
(:class:`~pcr_sglang.core.prefetch.UnusedReads`). It also answers what a hint may load on
to the device ahead of its request. It orders reads only through the
:class:`~pcr_sglang.core.ssd_residency.SsdTier` and reads what is in flight from the
:class:`~pcr_sglang.core.io_ledger.IoLedger`; its orders go into the caller's
:class:`~pcr_sglang.core.effects.Effects`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.hint_chains import HintedChain, HintedChains, LiveHint
from pcr_sglang.core.host_tier import HostTier
from pcr_sglang.core.io_ledger import IoLedger
from pcr_sglang.core.orders import Reorder
from pcr_sglang.core.prefetch import UnusedReads, prefetch_budgets
from pcr_sglang.core.ssd_residency import SsdTier
from pcr_sglang.core.stats import SSDStats

__all__ = ["PrefetchPlanner"]


class PrefetchPlanner:
    def __init__(
        self,
        ssd: SsdTier,
        host: HostTier,
        ledger: IoLedger,
        unused: UnusedReads,
        hint_chains: HintedChains,
        ssd_stats: SSDStats,
    ):
        self.ssd = ssd
        self.host = host
        self.ledger = ledger
        self.unused = unused
        self.hint_chains = hint_chains
        self.ssd_stats = ssd_stats

    def plan(
        self,
        chains: Sequence[Sequence[ChunkNode]],
        keep: Iterable[ChunkNode],
        effects: Effects,
        queue_depth: int,
        hinted: Sequence[LiveHint] = (),
    ) -> None:
        """Each scheduler step: order the SSD-only chunks of the waiting requests' chains
        (earliest request first) within the prefetch budget and half the host tier, then
        those of the ``hinted`` hints' chains (the live KV hints, in reading order) with
        what is left, holding at most ``hint_budget_chunks`` hinted chunks (in flight or
        landed, at most a quarter of the host tier); and stop protecting (and cancel the
        reads of) chunks neither needs now. ``keep`` are other chunks still wanted (those of
        requests waiting for reads). The hints' chains are kept matched across steps
        (:mod:`pcr_sglang.core.hint_chains`): O(1) per hint while its chain is unchanged."""
        if not self.ssd.enabled:
            return
        config = self.ssd.config
        tracked = self.hint_chains.sync(hinted)
        self.ssd_stats.max_queue_depth = max(self.ssd_stats.max_queue_depth, queue_depth)
        needed = set(keep)
        # mutant: hint-budget-counts-only-reads-in-flight
        hinted_held = len(self.unused.hinted)
        budgets = prefetch_budgets(
            host_slots=config.host_slots,
            prefetch_budget=config.prefetch_budget_chunks,
            hint_budget=config.hint_budget_chunks,
            reads_in_flight=self.ledger.reads_in_flight,
            unused=len(self.unused.landed),
            hinted_held=hinted_held,
            queue_reads_in_flight=self.ledger.queue_reads_in_flight(self.unused.hinted),
        )
        budget = budgets.queue
        for chain in chains:
            needed.update(chain)
            if budget > 0:
                budget -= self.ssd.order_reads(chain, effects, urgent=False, limit=budget)
        hint_room = min(budget, budgets.hint_cap)
        for hint_chain in tracked:
            if hint_room <= 0:
                break
            start = self.hint_chains.first_readable(hint_chain, self._needs_read)
            if start is None:
                continue
            # From the first chunk to read (none before it is): the chain's tail is locked
            # meanwhile, as for any read, so making room never evicts the chain itself.
            ordered = self.ssd.order_reads(hint_chain.nodes[start:], effects, urgent=False, limit=hint_room, hint=True)
            hint_room -= ordered
            self.ssd_stats.hint_issued += ordered
        hinted_chain = self.hint_chains.covers  # an index of the hinted chains, not a walk of them
        for seq in self.ledger.cancel_unneeded(lambda n: n in needed or hinted_chain(n)):
            effects.orders.append(Reorder(seq, cancel=True))
        self.unused.drop_unneeded(needed, hinted_chain, self.ledger.reading)

    def _needs_read(self, node: ChunkNode) -> bool:
        return node.on_ssd and not node.on_host and not node.on_device and not self.ledger.reading(node)

    # ------------------------------------------------------------------ KV hints ahead of their request
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
            if not self.host.loadable(node) or self.unused.queue_read(node):
                break
            if len(run) >= most:
                return []
            run.append(node)
        return run

    def count_hinted(self, nodes: Iterable[ChunkNode]) -> set[ChunkNode]:
        """A request needs ``nodes`` now: those read for a hint count as in time or late,
        once, and only as a hint's (returned; :meth:`UnusedReads.count_hinted`)."""
        return self.unused.count_hinted(nodes, self.ledger.reading)
