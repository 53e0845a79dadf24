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

The tree decides each change (it matches and inserts chains, checks its callers' requests,
and takes out of the tree a chunk no tier holds, with the descendants only it made
reachable); what a change moves (the per-tier counts, lock counts and leaf sets, and the
event recording it) is kept by :class:`pcr_sglang.core.tier_accounts.TierAccounts`, and
carrying a removal out (children before parents) by
:class:`pcr_sglang.core.tree_removal.ChunkRemoval`; the tree holds one of each.

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
)
from pcr_sglang.core.keys import ChunkKey
from pcr_sglang.core.lru import TierLeaves
from pcr_sglang.core.tier_accounts import TierAccounts
from pcr_sglang.core.tier_events import Tier, TierEvent, TierEventKind, TierEventLog
from pcr_sglang.core.tree_check import check_tree
from pcr_sglang.core.tree_removal import ChunkRemoval, NodeCallback, NodePredicate

__all__ = ["ChunkNode", "ChunkTree", "InsertOutcome", "MatchOutcome", "NodeCallback", "NodePredicate", "TreeStats"]


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
        self._tiers = TierAccounts(self._seq, self._log)
        self._removal = ChunkRemoval(self._tiers, self._log, self._forgot_one)

    def _forgot_one(self) -> None:
        self._num_chunks -= 1

    def _log(self, kind: TierEventKind, node: ChunkNode, tier: Optional[Tier] = None) -> None:
        """Record a residency change, when events are on."""
        if self.events is None:
            return
        parent = node.parent
        parent_key = None if parent is None or parent.parent is None else parent.key
        self.events.append(TierEvent(kind, node.key, parent_key, tier))

    @property
    def num_chunks(self) -> int:
        return self._num_chunks

    @property
    def device_chunks(self) -> int:
        return self._tiers.device_chunks

    @property
    def host_chunks(self) -> int:
        return self._tiers.host_chunks

    @property
    def ssd_chunks(self) -> int:
        return self._tiers.ssd_chunks

    @property
    def evictable_chunks(self) -> int:
        """Device chunks no lock holds: what device eviction could free."""
        return self._tiers.evictable_chunks

    @property
    def locked_chunks(self) -> int:
        return self._tiers.locked_chunks

    @property
    def locked_device_chunks(self) -> int:
        return self._tiers.locked_device_chunks

    # Each tier's evictable leaves, kept by the accounts: what the invariant check compares.
    @property
    def _device(self) -> TierLeaves:
        return self._tiers.device

    @property
    def _host(self) -> TierLeaves:
        return self._tiers.host

    @property
    def _ssd(self) -> TierLeaves:
        return self._tiers.ssd

    def stats(self) -> TreeStats:
        return self._tiers.stats(self._num_chunks)

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
        return InsertOutcome(nodes=nodes, last_node=node, num_existing=num_existing, new_nodes=new_nodes)

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
        self._tiers.enter_device(node, value)

    def set_host(self, node: ChunkNode, slot: int) -> None:
        """Record that ``node``'s KV is also in host slot ``slot``."""
        if node.parent is None:
            raise ValueError("the root holds no KV")
        if node.on_host:
            raise RuntimeError(f"{node!r} already has host slot {node.host_slot}")
        self._tiers.enter_host(node, slot)

    def set_ssd(self, node: ChunkNode) -> None:
        """Record that ``node``'s KV is also persisted in the SSD store."""
        if node.parent is None:
            raise ValueError("the root holds no KV")
        if node.on_ssd:
            raise RuntimeError(f"{node!r} is already on the SSD")
        self._tiers.enter_ssd(node)

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

    def drop_ssd(
        self, node: ChunkNode, on_drop_host: Optional[NodeCallback] = None, on_drop_ssd: Optional[NodeCallback] = None
    ) -> None:
        """``node``'s SSD record is gone (unreadable, corrupt): forget it. A chunk left in
        no tier is removed with the descendants only it made reachable."""
        if node.on_ssd:
            self._removal.leave(node, self._tiers.leave_ssd, on_drop_host, on_drop_ssd)

    # ------------------------------------------------------------------ host pins
    def pin_host(self, node: ChunkNode) -> None:
        """Keep ``node``'s host copy out of host eviction (it is not a host leaf while
        pinned); its other tiers and its ancestors are unaffected."""
        self._tiers.pin_host(node)

    def unpin_host(self, node: ChunkNode) -> None:
        self._tiers.unpin_host(node)

    # ------------------------------------------------------------------ locks
    def lock(self, node: ChunkNode) -> int:
        """Protect ``node`` and its ancestors from eviction in every tier (a running
        request's chain, or chunks in transit); returns device chunks newly locked
        (the device tokens that stopped being evictable, in chunks)."""
        return self._tiers.lock(node)

    def unlock(self, node: ChunkNode) -> int:
        """Undo one :meth:`lock` of ``node``; returns device chunks that became evictable."""
        return self._tiers.unlock(node)

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
        return self._removal.evict_leaves(
            self._tiers.device,
            self._tiers.leave_device,
            num_chunks,
            on_evict,
            is_protected,
            on_drop_host,
            on_drop_ssd,
            None,
        )

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
        return self._removal.evict_leaves(
            self._tiers.host,
            self._tiers.leave_host,
            num_chunks,
            on_evict,
            is_protected,
            on_drop_host,
            on_drop_ssd,
            take,
        )

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
        return self._removal.evict_leaves(
            self._tiers.ssd, self._tiers.leave_ssd, num_chunks, on_evict, is_protected, on_drop_host, on_drop_ssd, None
        )

    # ------------------------------------------------------------------ helpers
    def _touch_chain(self, nodes: Sequence[ChunkNode]) -> None:
        self._tiers.touch(nodes, next(self._tick))

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
