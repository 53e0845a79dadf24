"""The chunk tree's per-tier accounts: what each tier holds, what is locked, what may go.

:class:`pcr_sglang.core.chunk_tree.ChunkTree` decides which chunk enters or leaves which
tier, and when a chunk leaves the tree; these accounts carry out each such change and keep
what it moves, one change at a time, so that no operation costs O(tree): the node's
residency field and its parent's child count in that tier, the chunks each tier holds, the
locked chunks and each tier's evictable leaves (:mod:`pcr_sglang.core.lru`). They record
the change as a KV cache event too, through the tree's ``log``.

They are apart from the tree because they are what :mod:`pcr_sglang.core.tree_check`
recounts: a residency field, the counts and leaf sets that depend on it and its event
change here together, so none goes stale unless a change bypasses this class. The accounts
know nothing of the tree's shape beyond a node's parent, and check nothing the tree's
callers pass (the tree does).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

from pcr_sglang.core.chunk_node import (
    ChunkNode,
    TreeStats,
    is_device_leaf,
    is_host_leaf,
    is_ssd_leaf,
    ssd_tier,
)
from pcr_sglang.core.lru import TierLeaves
from pcr_sglang.core.tier_events import Tier, TierEventKind

EventLog = Callable[[TierEventKind, ChunkNode, Optional[Tier]], None]


class TierAccounts:
    """Per tier, its chunk count and its evictable leaves; across tiers, the lock counts."""

    def __init__(self, seq: Iterator[int], log: EventLog) -> None:
        self._log = log
        self.device = TierLeaves(is_device_leaf, seq)
        self.host = TierLeaves(is_host_leaf, seq)
        self.ssd = TierLeaves(is_ssd_leaf, seq)
        self.device_chunks = 0
        self.host_chunks = 0
        self.ssd_chunks = 0
        self.locked_chunks = 0
        self.locked_device_chunks = 0

    @property
    def evictable_chunks(self) -> int:
        return self.device_chunks - self.locked_device_chunks

    def stats(self, num_chunks: int) -> TreeStats:
        """The counters, with the tree's own count of its chunks."""
        return TreeStats(
            num_chunks=num_chunks,
            device_chunks=self.device_chunks,
            host_chunks=self.host_chunks,
            evictable_chunks=self.evictable_chunks,
            locked_chunks=self.locked_chunks,
            evictable_leaves=len(self.device.leaves),
            host_evictable_leaves=len(self.host.leaves),
            ssd_chunks=self.ssd_chunks,
            ssd_evictable_leaves=len(self.ssd.leaves),
        )

    # ------------------------------------------------------------------ entering a tier
    def enter_device(self, node: ChunkNode, value: Any) -> None:
        """Make ``value`` ``node``'s device copy (it may be there already, in another)."""
        parent = node.parent
        assert parent is not None
        if not node.on_device:
            self.device_chunks += 1
            self.locked_device_chunks += node.lock_ref > 0
            parent.device_children += 1
            self.device.refresh(parent)
            self._log(TierEventKind.STORED, node, Tier.DEVICE)
        node.device_value = value
        self.device.refresh(node)
        self.host.refresh(node)

    def enter_host(self, node: ChunkNode, slot: int) -> None:
        parent = node.parent
        assert parent is not None and not node.on_host
        node.host_slot = slot
        self.host_chunks += 1
        parent.host_children += 1
        self.host.refresh(parent)
        self.host.refresh(node)
        self._log(TierEventKind.STORED, node, Tier.HOST)

    def enter_ssd(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and not node.on_ssd
        node.on_ssd = True
        self.ssd_chunks += 1
        parent.ssd_children += 1
        self.ssd.refresh(parent)
        self.ssd.refresh(node)
        self._log(TierEventKind.STORED, node, ssd_tier(node))

    # ------------------------------------------------------------------ leaving a tier
    def leave_device(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and node.on_device and node.device_children == 0
        node.device_value = None
        self.device_chunks -= 1
        parent.device_children -= 1
        self.device.leaves.discard(node)
        self.device.refresh(parent)
        self._log(TierEventKind.REMOVED, node, Tier.DEVICE)
        if node.on_host:  # the tiers still holding it take it afresh
            self.host.refresh(node)
        if node.on_ssd:
            self.ssd.refresh(node)

    def leave_host(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and node.on_host
        node.host_slot = None
        self.host_chunks -= 1
        parent.host_children -= 1
        self.host.leaves.discard(node)
        self.host.refresh(parent)
        # mutant: kv-events-host-removal-left-out
        self._log(TierEventKind.REMOVED, node, Tier.HOST)

    def leave_ssd(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and node.on_ssd
        self._log(TierEventKind.REMOVED, node, ssd_tier(node))  # while remote_only still says where
        node.on_ssd = False
        node.remote_only = False
        self.ssd_chunks -= 1
        parent.ssd_children -= 1
        self.ssd.leaves.discard(node)
        self.ssd.refresh(parent)

    def forget(self, node: ChunkNode) -> None:
        """``node`` leaves the tree: no tier's leaves keep it."""
        self.device.leaves.discard(node)
        self.host.leaves.discard(node)
        self.ssd.leaves.discard(node)

    # ------------------------------------------------------------------ locks, pins, recency
    def lock(self, node: ChunkNode) -> int:
        """Count one lock on ``node`` and its ancestors; returns device chunks newly locked."""
        newly = newly_on_device = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                newly += 1
                newly_on_device += node.on_device
            node.lock_ref += 1
            self.device.discard(node)
            self.host.discard(node)
            self.ssd.discard(node)
            node = node.parent
        self.locked_chunks += newly
        self.locked_device_chunks += newly_on_device
        return newly_on_device

    def unlock(self, node: ChunkNode) -> int:
        """Undo one :meth:`lock` of ``node``; returns device chunks that became evictable."""
        freed = freed_on_device = 0
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked chunk {node!r}: lock counts are unbalanced")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                freed += 1
                freed_on_device += node.on_device
                self.device.refresh(node)
                self.host.refresh(node)
                self.ssd.refresh(node)
            node = node.parent
        self.locked_chunks -= freed
        self.locked_device_chunks -= freed_on_device
        return freed_on_device

    def pin_host(self, node: ChunkNode) -> None:
        node.host_pins += 1
        self.host.discard(node)

    def unpin_host(self, node: ChunkNode) -> None:
        if node.host_pins <= 0:
            raise RuntimeError(f"unpin of an unpinned chunk {node!r}")
        node.host_pins -= 1
        if node.parent is not None:
            self.host.refresh(node)

    def touch(self, nodes: Sequence[ChunkNode], tick: int) -> None:
        """A chain was used at ``tick``: its leaves re-enter their heaps with that recency."""
        for node in nodes:
            node.last_access = tick
        # Only a chain's last chunk in each tier can be a leaf of that tier, but which
        # one that is differs per tier; refreshing the whole chain keeps it simple and
        # stays O(chain).
        for node in nodes:
            if node in self.device.leaves or is_device_leaf(node):
                self.device.refresh(node)
            if node in self.host.leaves or is_host_leaf(node):
                self.host.refresh(node)
            if node in self.ssd.leaves or is_ssd_leaf(node):
                self.ssd.refresh(node)
