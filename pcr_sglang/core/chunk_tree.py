"""The chunk tree: one node per fixed-size chunk, matched chunk by chunk from the root.

A node's key is the hash-chain key of its chunk (see :mod:`pcr_sglang.core.keys`), so a
node is reachable only through its own prefix: equal tokens under different prefixes are
different nodes (the paper's Figure 7).

Each node records where its KV lives, one field per tier (:mod:`pcr_sglang.core.chunk_node`),
and exists while it lives in at least one tier. Device residency is prefix-closed (a chunk
is on the device only if its parent is), because only device *leaves* leave the device and
chunks come back parent first; so a matched chain is a device-resident prefix followed by
host-only chunks.

Eviction in each tier takes only that tier's leaves (a node with a child resident in the
tier is not a leaf of it), unlocked, least recently used first (:mod:`pcr_sglang.core.lru`).
A match, an insert, a lock or an unlock costs O(chunks on the path) plus O(log leaves)
per heap push, never O(tree).

The tree is a data structure, not a policy: which tier a chunk should move to, and which
slots it uses there, is decided by :class:`pcr_sglang.core.residency.CacheState`, its
only user in the server.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Optional, Sequence

from pcr_sglang.core.chunk_node import (
    ChunkNode,
    InsertOutcome,
    MatchOutcome,
    TreeStats,
    held_once,
    in_no_tier,
    is_device_leaf,
    is_host_leaf,
    is_ssd_leaf,
    ssd_tier,
)
from pcr_sglang.core.keys import ChunkKey
from pcr_sglang.core.lru import TierLeaves
from pcr_sglang.core.tier_events import Tier, TierEvent, TierEventKind, TierEventLog
from pcr_sglang.core.tree_check import check_tree

__all__ = ["ChunkNode", "ChunkTree", "InsertOutcome", "MatchOutcome", "NodeCallback", "NodePredicate", "TreeStats"]

NodeCallback = Callable[[ChunkNode], None]
NodePredicate = Callable[[ChunkNode], bool]


class ChunkTree:
    """A prefix tree of chunks over three tiers with lock counts and per-tier LRU eviction."""

    def __init__(self) -> None:
        self._tick = itertools.count(1)
        self._seq = itertools.count()
        # Set to record every residency change (KV cache events); None records nothing.
        self.events: Optional[TierEventLog] = None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        if self.events is not None:
            self.events.append(TierEvent(TierEventKind.CLEARED))
        self.root = ChunkNode(key=b"", parent=None)
        self.root.lock_ref = 1  # the root is never evicted
        self._num_chunks = 0
        self._device_chunks = 0
        self._host_chunks = 0
        self._ssd_chunks = 0
        self._locked_chunks = 0
        self._locked_device_chunks = 0
        self._device = TierLeaves(is_device_leaf, self._seq)
        self._host = TierLeaves(is_host_leaf, self._seq)
        self._ssd = TierLeaves(is_ssd_leaf, self._seq)

    @property
    def num_chunks(self) -> int:
        return self._num_chunks

    @property
    def device_chunks(self) -> int:
        return self._device_chunks

    @property
    def host_chunks(self) -> int:
        return self._host_chunks

    @property
    def ssd_chunks(self) -> int:
        return self._ssd_chunks

    @property
    def evictable_chunks(self) -> int:
        """Device chunks no lock holds: what device eviction could free."""
        return self._device_chunks - self._locked_device_chunks

    @property
    def locked_chunks(self) -> int:
        return self._locked_chunks

    @property
    def locked_device_chunks(self) -> int:
        return self._locked_device_chunks

    def stats(self) -> TreeStats:
        return TreeStats(
            num_chunks=self._num_chunks,
            device_chunks=self._device_chunks,
            host_chunks=self._host_chunks,
            evictable_chunks=self.evictable_chunks,
            locked_chunks=self._locked_chunks,
            evictable_leaves=len(self._device.leaves),
            host_evictable_leaves=len(self._host.leaves),
            ssd_chunks=self._ssd_chunks,
            ssd_evictable_leaves=len(self._ssd.leaves),
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
        on_device = 0
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            nodes.append(child)
            if child.on_device and on_device == len(nodes) - 1:
                on_device += 1
            node = child
        if touch and nodes:
            self._touch_chain(nodes)
        return MatchOutcome(nodes=nodes, last_node=node, num_on_device=on_device)

    def insert(self, keys: Sequence[ChunkKey], values: Sequence[Any]) -> InsertOutcome:
        """Insert a chain on the device. Chunks already on the device keep their value;
        host-only chunks and new chunks take ``values[i]``."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        node = self.root
        nodes: list[ChunkNode] = []
        new_nodes: list[ChunkNode] = []
        num_existing = 0
        for key, value in zip(keys, values):
            child = node.children.get(key)
            if child is None:
                child = ChunkNode(key=key, parent=node)
                node.children[key] = child
                self._num_chunks += 1
                new_nodes.append(child)
                self.set_device(child, value)
            elif child.on_device:
                if num_existing == len(nodes):
                    num_existing += 1
            else:
                self.set_device(child, value)
            nodes.append(child)
            node = child
        if nodes:
            self._touch_chain(nodes)
        return InsertOutcome(
            nodes=nodes, last_node=node, num_existing=num_existing, new_nodes=new_nodes
        )

    # ------------------------------------------------------------------ residency
    def set_device(self, node: ChunkNode, value: Any) -> None:
        """Record that ``node``'s KV is (again) on the device, in ``value``."""
        if value is None:
            raise ValueError("a device value is required")
        parent = node.parent
        if parent is None:
            raise ValueError("the root holds no KV")
        if not parent.is_root and not parent.on_device:
            raise RuntimeError(f"{node!r} cannot be on the device before its parent")
        if not node.on_device:
            self._device_chunks += 1
            self._locked_device_chunks += node.lock_ref > 0
            parent.device_children += 1
            self._device.refresh(parent)
            self._log(TierEventKind.STORED, node, Tier.DEVICE)
        node.device_value = value
        self._device.refresh(node)
        self._host.refresh(node)

    def set_host(self, node: ChunkNode, slot: int) -> None:
        """Record that ``node``'s KV is also in host slot ``slot``."""
        if node.parent is None:
            raise ValueError("the root holds no KV")
        if node.on_host:
            raise RuntimeError(f"{node!r} already has host slot {node.host_slot}")
        node.host_slot = slot
        self._host_chunks += 1
        node.parent.host_children += 1
        self._host.refresh(node.parent)
        self._host.refresh(node)
        self._log(TierEventKind.STORED, node, Tier.HOST)

    def set_ssd(self, node: ChunkNode) -> None:
        """Record that ``node``'s KV is also persisted in the SSD store."""
        if node.parent is None:
            raise ValueError("the root holds no KV")
        if node.on_ssd:
            raise RuntimeError(f"{node!r} is already on the SSD")
        node.on_ssd = True
        self._ssd_chunks += 1
        node.parent.ssd_children += 1
        self._ssd.refresh(node.parent)
        self._ssd.refresh(node)
        self._log(TierEventKind.STORED, node, ssd_tier(node))

    def add_persisted(self, parent: Optional[ChunkNode], key: ChunkKey, remote_only: bool = False) -> ChunkNode:
        """A chunk found in the SSD store at startup, or (``remote_only``) in the remote
        tier by a probe, under ``parent`` (None: the root)."""
        parent = parent or self.root
        if key in parent.children:
            raise RuntimeError(f"chunk {key.hex()} is already in the tree")
        node = ChunkNode(key=key, parent=parent)
        node.remote_only = remote_only
        parent.children[key] = node
        self._num_chunks += 1
        self.set_ssd(node)
        return node

    def mark_ssd_local(self, node: ChunkNode) -> None:
        """``node``, entered from the remote tier, was read: the I/O process keeps it on
        the local SSD too."""
        if not node.remote_only or not node.on_ssd:
            return
        self._log(TierEventKind.REMOVED, node, Tier.REMOTE)
        node.remote_only = False
        self._log(TierEventKind.STORED, node, Tier.SSD)

    def drop_ssd(self, node: ChunkNode, on_drop_host: Optional[NodeCallback] = None,
                 on_drop_ssd: Optional[NodeCallback] = None) -> None:
        """``node``'s SSD record is gone (unreadable, corrupt): forget it. A chunk left in
        no tier is removed with the descendants only it made reachable."""
        if not node.on_ssd:
            return
        last = held_once(node)
        if last:  # what only it made reachable goes first (so events name children before parents)
            self._drop_children(node, on_drop_host, on_drop_ssd)
        self._drop_ssd(node)
        if last:
            self._remove_leaf(node)

    # ------------------------------------------------------------------ host pins
    def pin_host(self, node: ChunkNode) -> None:
        """Keep ``node``'s host copy out of host eviction (it is not a host leaf while
        pinned); its other tiers and its ancestors are unaffected."""
        node.host_pins += 1
        self._host.discard(node)

    def unpin_host(self, node: ChunkNode) -> None:
        if node.host_pins <= 0:
            raise RuntimeError(f"unpin of an unpinned chunk {node!r}")
        node.host_pins -= 1
        if node.parent is not None:
            self._host.refresh(node)

    # ------------------------------------------------------------------ locks
    def lock(self, node: ChunkNode) -> int:
        """Protect ``node`` and its ancestors from eviction in every tier (a running
        request's chain, or chunks in transit); returns device chunks newly locked
        (the device tokens that stopped being evictable, in chunks)."""
        newly = newly_on_device = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                newly += 1
                newly_on_device += node.on_device
            node.lock_ref += 1
            self._device.discard(node)
            self._host.discard(node)
            self._ssd.discard(node)
            node = node.parent
        self._locked_chunks += newly
        self._locked_device_chunks += newly_on_device
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
                self._device.refresh(node)
                self._host.refresh(node)
                self._ssd.refresh(node)
            node = node.parent
        self._locked_chunks -= freed
        self._locked_device_chunks -= freed_on_device
        return freed_on_device

    # ------------------------------------------------------------------ eviction
    def evict(
        self,
        num_chunks: int,
        on_evict: Optional[NodeCallback] = None,
        is_protected: Optional[NodePredicate] = None,
        on_drop_host: Optional[NodeCallback] = None,
        on_drop_ssd: Optional[NodeCallback] = None,
    ) -> list[ChunkNode]:
        """Take up to ``num_chunks`` unlocked device leaves off the device, LRU first.

        ``on_evict(node)`` runs first, while the device value is still set: the adapter
        frees the device slots there, after demoting the chunk to the host (``set_host``)
        if it wants to keep it. A chunk left in no tier is removed, and with it any
        descendants that only it made reachable, for which ``on_drop_host`` and
        ``on_drop_ssd`` free the host slot and the SSD record. Leaves for which
        ``is_protected`` answers true go only after every other (look-ahead protection).
        """
        evicted: list[ChunkNode] = []
        for node in self._device.pop_lru(num_chunks, is_protected):
            if on_evict is not None:
                on_evict(node)
            self._drop_device(node, on_drop_host, on_drop_ssd)
            evicted.append(node)
        return evicted

    def evict_host(
        self,
        num_chunks: int,
        on_evict: Optional[NodeCallback] = None,
        is_protected: Optional[NodePredicate] = None,
        on_drop_host: Optional[NodeCallback] = None,
        on_drop_ssd: Optional[NodeCallback] = None,
        take: Optional[Callable[[ChunkNode], Optional[bool]]] = None,
    ) -> list[ChunkNode]:
        """Free up to ``num_chunks`` host slots of unlocked, unpinned host leaves, LRU first.

        ``take(node)`` may refuse a leaf for now (False: the caller orders its write to
        SSD first, say) or end the eviction (None); ``on_evict(node)`` then runs while
        ``node.host_slot`` is still set (the caller releases the slot there). A chunk left in no tier is removed, with
        the descendants it made reachable (``on_drop_host`` and ``on_drop_ssd`` release
        their host slots and SSD records).
        """
        return self._evict_leaves(self._host, self._drop_host, num_chunks, on_evict, is_protected,
                                  on_drop_host, on_drop_ssd, take)

    def evict_ssd(
        self,
        num_chunks: int,
        on_evict: Optional[NodeCallback] = None,
        is_protected: Optional[NodePredicate] = None,
        on_drop_host: Optional[NodeCallback] = None,
        on_drop_ssd: Optional[NodeCallback] = None,
    ) -> list[ChunkNode]:
        """Drop up to ``num_chunks`` SSD records of unlocked SSD leaves, LRU first.

        ``on_evict(node)`` runs first (the caller deletes the record there). A chunk left
        in no tier is removed, with the descendants it made reachable.
        """
        return self._evict_leaves(self._ssd, self._drop_ssd, num_chunks, on_evict, is_protected,
                                  on_drop_host, on_drop_ssd, None)

    def _evict_leaves(self, tier: TierLeaves, drop: NodeCallback, num_chunks: int,
                      on_evict: Optional[NodeCallback], is_protected: Optional[NodePredicate],
                      on_drop_host: Optional[NodeCallback], on_drop_ssd: Optional[NodeCallback],
                      take: Optional[Callable[[ChunkNode], Optional[bool]]]) -> list[ChunkNode]:
        """The host and SSD tiers' eviction: take ``tier``'s LRU leaves out of it; a chunk
        left in no tier goes, with the descendants only it made reachable."""
        evicted: list[ChunkNode] = []
        for node in tier.pop_lru(num_chunks, is_protected, take):
            if on_evict is not None:
                on_evict(node)
            last = held_once(node)
            if last:  # what only it made reachable goes first (so events name children before parents)
                self._drop_children(node, on_drop_host, on_drop_ssd)
            drop(node)
            if last:
                self._remove_leaf(node)
            evicted.append(node)
        return evicted

    def _drop_children(self, node: ChunkNode, on_drop_host: Optional[NodeCallback],
                       on_drop_ssd: Optional[NodeCallback]) -> None:
        for child in list(node.children.values()):
            self._drop_subtree(child, on_drop_host, on_drop_ssd)

    def _drop_device(self, node: ChunkNode, on_drop_host: Optional[NodeCallback],
                     on_drop_ssd: Optional[NodeCallback] = None) -> None:
        parent = node.parent
        assert parent is not None and node.on_device and node.device_children == 0
        last = held_once(node)
        if last:  # no tier will hold it: its descendants are unreachable, and go first
            self._drop_children(node, on_drop_host, on_drop_ssd)
        node.device_value = None
        self._device_chunks -= 1
        parent.device_children -= 1
        self._device.leaves.discard(node)
        self._device.refresh(parent)
        self._log(TierEventKind.REMOVED, node, Tier.DEVICE)
        if last:
            self._remove_leaf(node)
            return
        self._host.refresh(node)
        self._ssd.refresh(node)

    def _drop_subtree(self, node: ChunkNode, on_drop_host: Optional[NodeCallback],
                      on_drop_ssd: Optional[NodeCallback] = None) -> None:
        stack = [node]
        order = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children before parents
            assert not n.on_device and n.lock_ref == 0, n
            if n.on_host:
                if on_drop_host is not None:
                    on_drop_host(n)
                self._drop_host(n)
            if n.on_ssd:
                if on_drop_ssd is not None:
                    on_drop_ssd(n)
                self._drop_ssd(n)
            self._remove_leaf(n)

    def _drop_host(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and node.on_host
        node.host_slot = None
        self._host_chunks -= 1
        parent.host_children -= 1
        self._host.leaves.discard(node)
        self._host.refresh(parent)
        self._log(TierEventKind.REMOVED, node, Tier.HOST)

    def _drop_ssd(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and node.on_ssd
        self._log(TierEventKind.REMOVED, node, ssd_tier(node))
        node.on_ssd = False
        node.remote_only = False
        self._ssd_chunks -= 1
        parent.ssd_children -= 1
        self._ssd.leaves.discard(node)
        self._ssd.refresh(parent)

    def _remove_leaf(self, node: ChunkNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        assert in_no_tier(node)
        self._log(TierEventKind.FORGOTTEN, node)
        del parent.children[node.key]
        self._device.leaves.discard(node)
        self._host.leaves.discard(node)
        self._ssd.leaves.discard(node)
        self._num_chunks -= 1
        node.parent = None

    # ------------------------------------------------------------------ helpers
    def _log(self, kind: TierEventKind, node: ChunkNode, tier: Optional[Tier] = None) -> None:
        """Record a residency change, when events are on."""
        if self.events is None:
            return
        parent = node.parent
        parent_key = None if parent is None or parent.parent is None else parent.key
        self.events.append(TierEvent(kind, node.key, parent_key, tier))

    def _touch_chain(self, nodes: Sequence[ChunkNode]) -> None:
        tick = next(self._tick)
        for node in nodes:
            node.last_access = tick
        # Only a chain's last chunk in each tier can be a leaf of that tier, but which
        # one that is differs per tier; refreshing the whole chain keeps it simple and
        # stays O(chain).
        for node in nodes:
            if node in self._device.leaves or is_device_leaf(node):
                self._device.refresh(node)
            if node in self._host.leaves or is_host_leaf(node):
                self._host.refresh(node)
            if node in self._ssd.leaves or is_ssd_leaf(node):
                self._ssd.refresh(node)

    # ------------------------------------------------------------------ checks
    def iter_nodes(self) -> Iterable[ChunkNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> TreeStats:
        """Walk the whole tree and verify its bookkeeping (tests and debugging only)."""
        return check_tree(self)
