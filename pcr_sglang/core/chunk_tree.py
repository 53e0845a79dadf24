"""The chunk tree: one node per fixed-size chunk, matched chunk by chunk from the root.

A node's key is the hash-chain key of its chunk (see :mod:`pcr_sglang.core.keys`), so a
node is reachable only through its own prefix: equal tokens under different prefixes are
different nodes (the paper's Figure 7). The tree stores an opaque ``device_value`` per
node (the adapter puts the chunk's KV slot indices there) and never interprets it.

Eviction takes unlocked leaves, least recently used first. The order is kept in a heap
with lazy invalidation: every time a node becomes an evictable leaf or is touched while
one, a fresh ``(access_tick, seq, node)`` entry is pushed, and stale entries are skipped
when popped. A match, an insert, a lock or an unlock therefore costs O(chunks on the
path) plus O(log leaves) per heap push, never O(tree).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from pcr_sglang.core.keys import ChunkKey

logger = logging.getLogger(__name__)


class ChunkNode:
    """One chunk of KV. ``depth`` counts chunks from the root (the root has depth 0)."""

    __slots__ = (
        "key",
        "parent",
        "children",
        "depth",
        "device_value",
        "lock_ref",
        "last_access",
        "hit_count",
    )

    def __init__(self, key: ChunkKey, parent: Optional[ChunkNode], device_value: Any = None):
        self.key = key
        self.parent = parent
        self.children: dict[ChunkKey, ChunkNode] = {}
        self.depth = 0 if parent is None else parent.depth + 1
        self.device_value = device_value
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path_from_root(self) -> list[ChunkNode]:
        """Nodes from the first chunk down to this one (empty for the root)."""
        path = []
        node: Optional[ChunkNode] = self
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def __repr__(self) -> str:
        return (
            f"ChunkNode(key={self.key.hex()[:8]}, depth={self.depth}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})"
        )


@dataclass
class MatchOutcome:
    """The matched chain, first chunk first; empty when the first chunk misses."""

    nodes: list[ChunkNode]
    last_node: ChunkNode

    @property
    def num_chunks(self) -> int:
        return len(self.nodes)


@dataclass
class InsertOutcome:
    """``nodes`` is the whole chain inserted; its first ``num_existing`` were already cached
    (their values were not taken: the caller still owns the duplicates it passed in)."""

    nodes: list[ChunkNode]
    last_node: ChunkNode
    num_existing: int
    new_nodes: list[ChunkNode] = field(default_factory=list)


@dataclass(frozen=True)
class TreeStats:
    num_chunks: int
    evictable_chunks: int
    locked_chunks: int
    evictable_leaves: int


class ChunkTree:
    """A prefix tree of chunks with lock counts and LRU eviction of unlocked leaves."""

    def __init__(self) -> None:
        self._tick = itertools.count(1)
        self._seq = itertools.count()
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self.root = ChunkNode(key=b"", parent=None)
        self.root.lock_ref = 1  # the root is never evicted
        self._num_chunks = 0
        self._locked_chunks = 0
        self._evictable_leaves: set[ChunkNode] = set()
        self._heap: list[tuple[int, int, ChunkNode]] = []

    @property
    def num_chunks(self) -> int:
        return self._num_chunks

    @property
    def evictable_chunks(self) -> int:
        """Chunks no running request holds: what eviction could eventually free."""
        return self._num_chunks - self._locked_chunks

    @property
    def locked_chunks(self) -> int:
        return self._locked_chunks

    def stats(self) -> TreeStats:
        return TreeStats(
            num_chunks=self._num_chunks,
            evictable_chunks=self.evictable_chunks,
            locked_chunks=self._locked_chunks,
            evictable_leaves=len(self._evictable_leaves),
        )

    # ------------------------------------------------------------------ lookup
    def match(self, keys: Iterable[ChunkKey], touch: bool = True) -> MatchOutcome:
        """Follow ``keys`` from the root until the first miss.

        ``keys`` may be a lazy iterator: it is consumed only up to the first miss.
        ``touch`` refreshes the matched chain's recency (a real use); a look-ahead
        probe passes ``False``.
        """
        node = self.root
        nodes: list[ChunkNode] = []
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            nodes.append(child)
            node = child
        if touch and nodes:
            self._touch_chain(nodes)
        return MatchOutcome(nodes=nodes, last_node=node)

    def insert(self, keys: Sequence[ChunkKey], values: Sequence[Any]) -> InsertOutcome:
        """Insert a chain; chunks already present keep their value, new ones take ``values[i]``."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        node = self.root
        nodes: list[ChunkNode] = []
        new_nodes: list[ChunkNode] = []
        num_existing = 0
        for key, value in zip(keys, values):
            child = node.children.get(key)
            if child is None:
                child = ChunkNode(key=key, parent=node, device_value=value)
                node.children[key] = child
                self._num_chunks += 1
                new_nodes.append(child)
                # The parent gained a child: it is no longer a leaf.
                self._evictable_leaves.discard(node)
            elif not new_nodes:
                num_existing += 1
            nodes.append(child)
            node = child
        if nodes:
            self._touch_chain(nodes)
            for child in new_nodes:
                child.hit_count = 0
        return InsertOutcome(
            nodes=nodes, last_node=node, num_existing=num_existing, new_nodes=new_nodes
        )

    # ------------------------------------------------------------------ locks
    def lock(self, node: ChunkNode) -> int:
        """Protect ``node`` and its ancestors from eviction; returns chunks newly locked."""
        newly = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                newly += 1
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        self._locked_chunks += newly
        return newly

    def unlock(self, node: ChunkNode) -> int:
        """Undo one :meth:`lock` of ``node``; returns chunks that became evictable."""
        freed = 0
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked chunk {node!r}: lock counts are unbalanced")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                freed += 1
                self._refresh_leaf(node)
            node = node.parent
        self._locked_chunks -= freed
        return freed

    # ------------------------------------------------------------------ eviction
    def evict(
        self,
        num_chunks: int,
        on_evict: Optional[Callable[[ChunkNode], None]] = None,
        is_protected: Optional[Callable[[ChunkNode], bool]] = None,
    ) -> list[ChunkNode]:
        """Remove up to ``num_chunks`` unlocked leaves, least recently used first.

        ``on_evict`` is called for each removed node before it is detached (the adapter
        frees its KV slots there). Leaves for which ``is_protected`` answers true are
        evicted only after every unprotected candidate (look-ahead protection).
        """
        evicted: list[ChunkNode] = []
        deferred: list[tuple[int, int, ChunkNode]] = []
        while len(evicted) < num_chunks:
            entry = self._pop_evictable()
            if entry is None:
                if not deferred:
                    break
                # Only protected leaves remain: take them, oldest first.
                entry = heapq.heappop(deferred)
            elif is_protected is not None and is_protected(entry[2]):
                heapq.heappush(deferred, entry)
                continue
            node = entry[2]
            if on_evict is not None:
                on_evict(node)
            self._remove_leaf(node)
            evicted.append(node)
        for entry in deferred:
            if self._is_evictable_leaf(entry[2]):
                heapq.heappush(self._heap, entry)
        return evicted

    def _pop_evictable(self) -> Optional[tuple[int, int, ChunkNode]]:
        while self._heap:
            entry = heapq.heappop(self._heap)
            tick, _, node = entry
            if node in self._evictable_leaves and node.last_access == tick:
                return entry
        return None

    def _remove_leaf(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.key]
        self._evictable_leaves.discard(node)
        self._num_chunks -= 1
        node.parent = None
        node.device_value = None
        self._refresh_leaf(parent)

    # ------------------------------------------------------------------ helpers
    def _is_evictable_leaf(self, node: ChunkNode) -> bool:
        return node.parent is not None and node.lock_ref == 0 and not node.children

    def _refresh_leaf(self, node: ChunkNode) -> None:
        if self._is_evictable_leaf(node):
            self._evictable_leaves.add(node)
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
            self._maybe_compact_heap()
        else:
            self._evictable_leaves.discard(node)

    def _touch_chain(self, nodes: Sequence[ChunkNode]) -> None:
        tick = next(self._tick)
        for node in nodes:
            node.last_access = tick
            node.hit_count += 1
        # Only the chain's last node can be a leaf: the others have a child on it.
        self._refresh_leaf(nodes[-1])

    def _maybe_compact_heap(self) -> None:
        if len(self._heap) > 4 * len(self._evictable_leaves) + 1024:
            self._heap = [
                (n.last_access, next(self._seq), n) for n in self._evictable_leaves
            ]
            heapq.heapify(self._heap)

    # ------------------------------------------------------------------ checks
    def iter_nodes(self) -> Iterable[ChunkNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> TreeStats:
        """Walk the whole tree and verify its bookkeeping (tests and debugging only)."""
        count = locked = 0
        leaves = set()
        for node in self.iter_nodes():
            count += 1
            assert node.parent is not None and node.parent.children.get(node.key) is node
            assert node.depth == node.parent.depth + 1
            assert node.lock_ref >= 0, node
            child_locks = sum(c.lock_ref for c in node.children.values())
            # lock() raises every ancestor's count: a parent holds at least its children's.
            assert node.lock_ref >= child_locks, node
            if node.lock_ref > 0:
                locked += 1
            if self._is_evictable_leaf(node):
                leaves.add(node)
        assert count == self._num_chunks, (count, self._num_chunks)
        assert locked == self._locked_chunks, (locked, self._locked_chunks)
        assert leaves == self._evictable_leaves
        return self.stats()
