"""Taking chunks out of the chunk tree: a tier's eviction, and a chunk no tier holds any more
leaving the tree with the descendants only it made reachable.

Split out of :class:`pcr_sglang.core.chunk_tree.ChunkTree`, which inherits it: the tree
decides which chunks leave a tier (its ``evict*`` and ``drop_ssd`` methods); this part
carries each one out, in the order the KV cache events need (children before parents),
and records each change in the tree's event log when that is on.
"""

from __future__ import annotations

from typing import Callable, Optional

from pcr_sglang.core.chunk_node import ChunkNode, held_once, in_no_tier
from pcr_sglang.core.lru import TierLeaves
from pcr_sglang.core.tier_accounts import TierAccounts
from pcr_sglang.core.tier_events import Tier, TierEvent, TierEventKind, TierEventLog

NodeCallback = Callable[[ChunkNode], None]
NodePredicate = Callable[[ChunkNode], bool]


class ChunkRemoval:
    """The removal half of :class:`~pcr_sglang.core.chunk_tree.ChunkTree` (a mixin: the
    tree owns the state below and sets it in its constructor)."""

    events: Optional[TierEventLog]
    _tiers: TierAccounts
    _num_chunks: int

    def _evict_leaves(
        self,
        tier: TierLeaves,
        drop: NodeCallback,
        num_chunks: int,
        on_evict: Optional[NodeCallback],
        is_protected: Optional[NodePredicate],
        on_drop_host: Optional[NodeCallback],
        on_drop_ssd: Optional[NodeCallback],
        take: Optional[Callable[[ChunkNode], Optional[bool]]],
    ) -> list[ChunkNode]:
        """Each tier's eviction: take ``tier``'s LRU leaves out of it (``drop``); a chunk
        left in no tier goes, with the descendants only it made reachable."""
        evicted: list[ChunkNode] = []
        for node in tier.pop_lru(num_chunks, is_protected, take):
            if on_evict is not None:
                on_evict(node)
            self._leave(node, drop, on_drop_host, on_drop_ssd)
            evicted.append(node)
        return evicted

    def _leave(
        self,
        node: ChunkNode,
        drop: NodeCallback,
        on_drop_host: Optional[NodeCallback],
        on_drop_ssd: Optional[NodeCallback],
    ) -> None:
        """Take ``node`` out of one tier (``drop``); a chunk that tier held alone leaves the
        tree, and the descendants only it made reachable go first (so that events name
        children before parents)."""
        last = held_once(node)
        if last:
            self._drop_children(node, on_drop_host, on_drop_ssd)
        drop(node)
        if last:
            self._remove_leaf(node)

    def _drop_children(
        self, node: ChunkNode, on_drop_host: Optional[NodeCallback], on_drop_ssd: Optional[NodeCallback]
    ) -> None:
        for child in list(node.children.values()):
            self._drop_subtree(child, on_drop_host, on_drop_ssd)

    def _drop_subtree(
        self, node: ChunkNode, on_drop_host: Optional[NodeCallback], on_drop_ssd: Optional[NodeCallback] = None
    ) -> None:
        stack = [node]
        order = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        # mutant: kv-events-parent-removed-before-children
        for n in reversed(order):  # children before parents
            assert not n.on_device and n.lock_ref == 0, n
            if n.on_host:
                if on_drop_host is not None:
                    on_drop_host(n)
                self._tiers.leave_host(n)
            if n.on_ssd:
                if on_drop_ssd is not None:
                    on_drop_ssd(n)
                self._tiers.leave_ssd(n)
            self._remove_leaf(n)

    def _remove_leaf(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        assert in_no_tier(node)
        self._log(TierEventKind.FORGOTTEN, node)
        del parent.children[node.key]
        self._tiers.forget(node)
        self._num_chunks -= 1
        node.parent = None

    def _log(self, kind: TierEventKind, node: ChunkNode, tier: Optional[Tier] = None) -> None:
        """Record a residency change, when events are on."""
        if self.events is None:
            return
        parent = node.parent
        parent_key = None if parent is None or parent.parent is None else parent.key
        self.events.append(TierEvent(kind, node.key, parent_key, tier))
