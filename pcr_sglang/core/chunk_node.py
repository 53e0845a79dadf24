"""The chunk tree's unit: one node per chunk, and the plain results the tree hands back.

A node is kept apart from :class:`pcr_sglang.core.chunk_tree.ChunkTree` because it is
what every other part of the server holds on to: the adapter's requests keep their
matched chain as nodes, the residency owner (:mod:`pcr_sglang.core.residency`) moves
nodes between tiers, the KV event publisher names them. Those readers need the node's
fields and the tree's results, not the tree's bookkeeping.

Where a node's KV lives, one field per tier (a node lives in at least one):

* ``device_value``: the chunk's device copy, opaque to the tree (the adapter puts the
  chunk's device KV slot indices there); ``None`` when it is not on the device.
* ``host_slot``: the host-pool slot holding a copy, or ``None``.
* ``on_ssd``: a record in the SSD store, named by the node's key. With ``remote_only``
  that record is only in the remote tier behind the SSD store, until it is read.

The counters say what eviction may take: ``device_children``, ``host_children`` and
``ssd_children`` count the children resident in each tier (a node with one is not that
tier's leaf), ``lock_ref`` counts locks held on the node or a descendant (a locked node
leaves no tier), ``host_pins`` counts reasons its host copy must stay (a write to SSD
reading it), and ``last_access`` is the tick of its last use (LRU order).

The leaf predicates (and the other one-node facts the tree asks: whether a single tier
holds the node, which tier its SSD-level record is in) are here, not in the tree, because
they read one node only: the tree keeps its per-tier leaf sets with them, and its
invariant check (:mod:`pcr_sglang.core.tree_check`) recomputes those sets with the same
definitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pcr_sglang.core.keys import ChunkKey
from pcr_sglang.core.tier_events import Tier


class ChunkNode:
    """One chunk of KV. ``depth`` counts chunks from the root (the root has depth 0)."""

    __slots__ = (
        "key",
        "parent",
        "children",
        "depth",
        "device_value",
        "host_slot",
        "on_ssd",
        "remote_only",
        "device_children",
        "host_children",
        "ssd_children",
        "lock_ref",
        "host_pins",
        "last_access",
    )

    def __init__(self, key: ChunkKey, parent: Optional[ChunkNode], device_value: Any = None):
        self.key = key
        self.parent = parent
        self.children: dict[ChunkKey, ChunkNode] = {}
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.device_value = device_value
        self.host_slot: Optional[int] = None
        self.on_ssd = False
        self.remote_only = False  # its SSD-level record is in the remote tier only
        self.device_children = 0
        self.host_children = 0
        self.ssd_children = 0
        self.lock_ref = 0
        self.host_pins = 0  # reasons the host copy must stay (a write to SSD reading it)
        self.last_access = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def on_device(self) -> bool:
        return self.device_value is not None

    @property
    def on_host(self) -> bool:
        return self.host_slot is not None

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
        tiers = ("D" if self.on_device else "") + ("H" if self.on_host else "") + ("S" if self.on_ssd else "")
        return (
            f"ChunkNode(key={self.key.hex()[:8]}, depth={self.depth}, tiers={tiers or '-'}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})"
        )


def in_no_tier(node: ChunkNode) -> bool:
    """No tier holds ``node``'s KV: the tree must not keep it."""
    return not node.on_device and not node.on_host and not node.on_ssd


def held_once(node: ChunkNode) -> bool:
    """Only one tier holds ``node``: leaving it, the chunk leaves the tree."""
    return node.on_device + node.on_host + node.on_ssd == 1


def ssd_tier(node: ChunkNode) -> Tier:
    """The tier ``node``'s SSD-level record is in, as KV events name it."""
    return Tier.REMOTE if node.remote_only else Tier.SSD


def is_device_leaf(node: ChunkNode) -> bool:
    """Device eviction may take ``node``: on the device, unlocked, no child there."""
    return node.parent is not None and node.on_device and node.lock_ref == 0 and node.device_children == 0


def is_host_leaf(node: ChunkNode) -> bool:
    """Host eviction may take ``node``: in host memory, unlocked, unpinned, no child there."""
    return (
        node.parent is not None
        and node.on_host
        and node.lock_ref == 0
        and node.host_children == 0
        and node.host_pins == 0
    )


def is_ssd_leaf(node: ChunkNode) -> bool:
    """SSD eviction may take ``node``: on the SSD, unlocked, no child there."""
    return node.parent is not None and node.on_ssd and node.lock_ref == 0 and node.ssd_children == 0


@dataclass
class MatchOutcome:
    """The matched chain, first chunk first; empty when the first chunk misses.

    The first ``num_on_device`` nodes are on the device; the rest live only in the host
    or SSD tier (or both).
    """

    nodes: list[ChunkNode]
    last_node: ChunkNode
    num_on_device: int = 0

    @property
    def num_chunks(self) -> int:
        return len(self.nodes)


@dataclass
class InsertOutcome:
    """``nodes`` is the whole chain inserted. Its first ``num_existing`` were already on
    the device: their values were not taken, the caller still owns the duplicates it
    passed in. Every later node took its value from ``values``."""

    nodes: list[ChunkNode]
    last_node: ChunkNode
    num_existing: int
    new_nodes: list[ChunkNode] = field(default_factory=list)


@dataclass(frozen=True)
class TreeStats:
    """A snapshot of the tree's counters, for the server's metrics and the tests: the
    chunks in each tier, and how many each tier's eviction could take right now."""

    num_chunks: int
    device_chunks: int
    host_chunks: int
    evictable_chunks: int
    locked_chunks: int
    evictable_leaves: int
    host_evictable_leaves: int
    ssd_chunks: int = 0
    ssd_evictable_leaves: int = 0
