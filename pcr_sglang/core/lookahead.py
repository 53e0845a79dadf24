"""Look-ahead protection for LRU eviction (the PCR paper's look-ahead LRU).

Plain LRU evicts the least recently used leaf even when the request at the head of the
waiting queue is about to reuse it. Each scheduler step, the cache state hands this
class the matched chains of the first ``window`` waiting requests; their chunks become
*protected*, and eviction takes them only after every unprotected leaf. Cost per
refresh: O(chunks matched by the window's requests), never O(tree), because a lookup
stops at each request's first miss and does not touch recency (a queued request has
not used anything yet).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree
from pcr_sglang.core.keys import ChunkKey


class LookaheadProtection:
    def __init__(self, tree: ChunkTree, window: int):
        if window < 0:
            raise ValueError(f"look-ahead window must be >= 0, got {window}")
        self.tree = tree
        self.window = window
        self._protected: set[ChunkNode] = set()

    def protect(self, chains: Iterable[Sequence[ChunkNode]]) -> int:
        """Protect the chunks of the first ``window`` chains; returns how many."""
        protected: set[ChunkNode] = set()
        if self.window:
            for i, chain in enumerate(chains):
                if i >= self.window:
                    break
                protected.update(chain)
        self._protected = protected
        return len(protected)

    def refresh(self, upcoming: Iterable[Iterable[ChunkKey]]) -> int:
        """Protect the cached chains of the upcoming requests (their chunk keys)."""
        if not self.window:
            self._protected = set()
            return 0
        chains = []
        for i, keys in enumerate(upcoming):
            if i >= self.window:
                break
            chains.append(self.tree.match(keys, touch=False).nodes)
        return self.protect(chains)

    def clear(self) -> None:
        self._protected = set()

    def __contains__(self, node: ChunkNode) -> bool:
        return node in self._protected

    def __len__(self) -> int:
        return len(self._protected)
