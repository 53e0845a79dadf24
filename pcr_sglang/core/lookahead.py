"""Look-ahead protection for LRU eviction (the PCR paper's look-ahead LRU).

Plain LRU evicts the least recently used leaf even when the request at the head of the
waiting queue is about to reuse it. Each scheduler step, the adapter hands this class
the chunk keys of the first ``window`` waiting requests; the chunks of those requests
that are cached become *protected*, and eviction takes them only after every
unprotected leaf. Cost per refresh: O(chunks matched by the window's requests), never
O(tree), because the lookup stops at each request's first miss and does not touch
recency (a queued request has not used anything yet).
"""

from __future__ import annotations

from typing import Iterable

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree
from pcr_sglang.core.keys import ChunkKey


class LookaheadProtection:
    def __init__(self, tree: ChunkTree, window: int):
        if window < 0:
            raise ValueError(f"look-ahead window must be >= 0, got {window}")
        self.tree = tree
        self.window = window
        self._protected: set[ChunkNode] = set()

    def refresh(self, upcoming: Iterable[Iterable[ChunkKey]]) -> int:
        """Protect the cached chains of the upcoming requests, first ``window`` of them.

        Returns the number of protected chunks.
        """
        protected: set[ChunkNode] = set()
        if self.window:
            for i, keys in enumerate(upcoming):
                if i >= self.window:
                    break
                protected.update(self.tree.match(keys, touch=False).nodes)
        self._protected = protected
        return len(protected)

    def clear(self) -> None:
        self._protected = set()

    def __contains__(self, node: ChunkNode) -> bool:
        return node in self._protected

    def __len__(self) -> int:
        return len(self._protected)
