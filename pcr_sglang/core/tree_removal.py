"""Taking chunks out of the chunk tree: a tier's eviction, and a chunk no tier holds any more
leaving the tree with the descendants only it made reachable.

A collaborator of :class:`pcr_sglang.core.chunk_tree.ChunkTree`: the tree decides which
chunks leave a tier (its ``evict*`` and ``drop_ssd`` methods); this part carries each one
out, in the order the KV cache events need (children before parents), through the tree's
:class:`~pcr_sglang.core.tier_accounts.TierAccounts` and its event log, and tells the tree
each chunk it forgot.
"""

from __future__ import annotations

from typing import Callable, Optional

from pcr_sglang.core.chunk_node import ChunkNode, held_once, in_no_tier
from pcr_sglang.core.lru import TierLeaves
from pcr_sglang.core.tier_accounts import EventLog, TierAccounts
from pcr_sglang.core.tier_events import TierEventKind

NodeCallback = Callable[[ChunkNode], None]
NodePredicate = Callable[[ChunkNode], bool]


class ChunkRemoval:
    """Carries removals out of one tree: ``tiers`` are its accounts, ``log`` records a
    residency change, ``forgotten`` is told each chunk that left the tree."""

    def __init__(self, tiers: TierAccounts, log: EventLog, forgotten: Callable[[], None]) -> None:
        self._tiers = tiers
        self._log = log
        self._forgotten = forgotten

    def evict_leaves(
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
            self.leave(node, drop, on_drop_host, on_drop_ssd)
            evicted.append(node)
        return evicted

    def leave(
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
        self._log(TierEventKind.FORGOTTEN, node, None)
        del parent.children[node.key]
        self._tiers.forget(node)
        self._forgotten()
        node.parent = None
