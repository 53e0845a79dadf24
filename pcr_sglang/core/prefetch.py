"""What became of SSD reads no request has used yet, and how much the next prefetch may read.

A read lands in host memory before any request uses it: for a waiting request the queue
prefetch read ahead, or for a live KV hint. Until a request uses it, it is *unused*: kept in
host memory (host eviction takes it last), counted as in time, late or wasted once, and,
for a hint's read, possibly promoted on to the device ahead of its request.
:class:`UnusedReads` is that ledger; :func:`prefetch_budgets` is the budget arithmetic of a
prefetch plan. The prefetch planner (:mod:`pcr_sglang.core.prefetch_plan`), a part of
:class:`~pcr_sglang.core.residency.CacheState`, drives them: nothing here changes where a chunk lives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.stats import SSDStats


@dataclass
class UnusedReads:
    stats: SSDStats
    landed: set[ChunkNode] = field(default_factory=set)  # read from SSD, not yet used by a request
    hinted: set[ChunkNode] = field(default_factory=set)  # of those read or reading, ordered for a KV hint
    # Hinted chunks that landed, then went on into free device slots before their request.
    promoted: set[ChunkNode] = field(default_factory=set)

    def __contains__(self, node: ChunkNode) -> bool:
        """``node`` landed and no request has used it (host eviction takes it last)."""
        return node in self.landed

    def used(self, node: ChunkNode) -> bool:
        """A request loaded ``node`` (or it left host memory): True if it had landed unused."""
        if node in self.landed:
            self.landed.discard(node)
            return True
        return False

    def count_hinted(self, nodes: Iterable[ChunkNode], reading: Callable[[ChunkNode], bool]) -> set[ChunkNode]:
        """A request needs ``nodes`` now (first considered for admission): those read for a
        hint count as in time (landed) or late (still reading), once, and only as a hint's
        (returned, so the caller leaves them out of the queue prefetch's counts). A landed
        one was in host memory before the request existed: it is a host hit from here on,
        not a read made for this request (which SGLang reports as ``storage``)."""
        counted = set()
        for node in nodes:
            if node in self.hinted:
                self.hinted.discard(node)
                counted.add(node)
                if node in self.landed or node in self.promoted:
                    self.landed.discard(node)
                    self.promoted.discard(node)
                    self.stats.hint_in_time += 1
                elif reading(node):
                    self.stats.hint_late += 1
        return counted

    def queue_read(self, node: ChunkNode) -> bool:
        """``node`` landed for a waiting request (the queue prefetch), not for a hint: its
        admission counts and loads it, so a hint never promotes it."""
        return node in self.landed and node not in self.hinted

    def promotable(self, nodes: Sequence[ChunkNode]) -> Sequence[ChunkNode]:
        """The leading run of host-resident ``nodes`` a hint may load on to the device: up
        to the first one the queue prefetch read for a waiting request."""
        for i, node in enumerate(nodes):
            if self.queue_read(node):
                return nodes[:i]
        return nodes

    def promoted_now(self, nodes: Iterable[ChunkNode]) -> None:
        """Hinted ``nodes`` went on to the device ahead of their request; those read for a
        hint still count as its, in time, when their request comes."""
        for node in nodes:
            if node in self.landed and node in self.hinted:
                self.promoted.add(node)

    def drop_unneeded(
        self, needed: set[ChunkNode], hinted_chain: Callable[[ChunkNode], bool], reading: Callable[[ChunkNode], bool]
    ) -> None:
        """After a prefetch plan: landed or promoted reads that no waiting request and no
        live hint needs any more are counted (unused or wasted) and forgotten."""
        for node in [n for n in self.landed if n not in needed and not hinted_chain(n)]:
            self.landed.discard(node)
            if node in self.hinted:  # counted as a hint's, never also as the queue's
                self.hinted.discard(node)
                self.stats.hint_wasted += 1
            else:
                self.stats.prefetch_unused += 1
        for node in [n for n in self.promoted if n not in needed and not hinted_chain(n)]:
            self.promoted.discard(node)
            self.hinted.discard(node)
            self.stats.hint_wasted += 1
        self.hinted = {n for n in self.hinted if reading(n) or n in self.landed or n in self.promoted}

    def clear(self) -> None:
        self.landed, self.hinted, self.promoted = set(), set(), set()


@dataclass(frozen=True)
class PrefetchBudgets:
    queue: int  # new reads for the waiting requests' chains this plan
    hint_cap: int  # new reads for live hints: at most this, and what the queue left


def prefetch_budgets(
    *,
    host_slots: int,
    prefetch_budget: int,
    hint_budget: int,
    queue_reads_in_flight: int,
    reads_in_flight: int,
    unused: int,
    hinted_held: int,
) -> PrefetchBudgets:
    """The queue prefetch reads within its budget and half the host tier (counting reads
    in flight and landed unused ones); hinted reads, in flight or landed, have their own
    budget and never take the queue's: they count only against it, and against at most a
    quarter of the host tier."""
    room = host_slots // 2 - reads_in_flight - unused
    return PrefetchBudgets(
        queue=min(prefetch_budget - queue_reads_in_flight, room),
        hint_cap=min(hint_budget - hinted_held, host_slots // 4 - hinted_held),
    )
