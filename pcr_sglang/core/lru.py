"""The evictable leaves of one tier, least recently used first (lazy-invalidation heap).

Whenever a node becomes a leaf of a tier or is touched while one, a fresh
``(access_tick, key, seq, node)`` entry is pushed; stale entries (the node left the tier,
or was touched since) are skipped when popped. A push costs O(log leaves), so matches,
inserts, locks and unlocks never cost O(tree).

Leaves touched in the same tick are ordered by their chunk key, which every TP rank
computes alike, never by anything process-local (push order after a restore, set order
when the heap is rebuilt): ranks that hold the same tree evict the same chunks.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterable, Iterator, Optional

from pcr_sglang.core.keys import ChunkKey

NodePredicate = Callable[[Any], bool]
_Entry = tuple[int, ChunkKey, int, Any]  # (access tick, key, push seq, node)


class TierLeaves:
    """The evictable leaves of one tier and their LRU heap."""

    def __init__(self, is_leaf: NodePredicate, seq: Iterator[int]):
        self.is_leaf = is_leaf
        self.leaves: set[Any] = set()
        self._heap: list[_Entry] = []
        self._seq = seq

    def refresh(self, node: Any) -> None:
        """Re-evaluate ``node``: (re)enter it with its current recency if it is a leaf."""
        if self.is_leaf(node):
            self.leaves.add(node)
            heapq.heappush(self._heap, (node.last_access, node.key, next(self._seq), node))
            if len(self._heap) > 4 * len(self.leaves) + 1024:
                self._heap = [(n.last_access, n.key, next(self._seq), n) for n in self.leaves]
                heapq.heapify(self._heap)
        else:
            self.leaves.discard(node)

    def discard(self, node: Any) -> None:
        self.leaves.discard(node)

    def _pop(self) -> Optional[_Entry]:
        while self._heap:
            entry = heapq.heappop(self._heap)
            node = entry[-1]
            if node in self.leaves and node.last_access == entry[0]:
                return entry
        return None

    def pop_lru(
        self, count: int, is_protected: Optional[NodePredicate], take: Optional[Callable[[Any], Optional[bool]]] = None
    ) -> Iterable[Any]:
        """Yield up to ``count`` leaves, LRU first, protected ones after all others.

        The caller removes each yielded leaf from the tier before asking for the next,
        so that a parent that becomes a leaf competes by its own recency. ``take(node)``
        may refuse a leaf for now (False: it stays a leaf, with its recency, and is not
        counted) or end the walk (None).
        """
        deferred: list[_Entry] = []
        refused: list[_Entry] = []
        taken = 0
        while taken < count:
            entry = self._pop()
            if entry is None:
                if not deferred:
                    break
                entry = heapq.heappop(deferred)
                if not self.is_leaf(entry[-1]):
                    continue
            elif is_protected is not None and is_protected(entry[-1]):
                heapq.heappush(deferred, entry)
                continue
            verdict = True if take is None else take(entry[-1])
            if not verdict:
                refused.append(entry)
                if verdict is None:
                    break
                continue
            taken += 1
            yield entry[-1]
        for entry in deferred + refused:
            if self.is_leaf(entry[-1]):
                heapq.heappush(self._heap, entry)
