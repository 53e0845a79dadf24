"""Each live KV hint's matched chain, kept from step to step instead of matched again.

Matching every live hint's whole chain from the root every scheduler step cost
O(live hints x chain): 256 hints of 32k-token prompts added 90 ms to every step. A
:class:`HintedChain` keeps its hint's matched nodes and two frontiers, so a step costs
O(1) per hint while nothing on its chain changed, and work in proportion to what changed
when something did:

* **Removal.** The tree removes only leaves (children first) and a removed node loses
  its parent, so a chain lost chunks exactly when its last node did; the first lost one is
  found by bisection. A reset replaces the root (:meth:`HintedChains.reset` drops the
  chains; they are matched once more).
* **Insertion.** The tree gains a chunk of a chain only right after the chain's last
  matched node: one child lookup per step sees it.
* **Residency.** ``read_from``: no chunk before it needs a read from SSD. A chunk becomes
  readable again only when it loses its device or host copy, or a read of it ends without
  landing; :class:`~pcr_sglang.core.residency.CacheState`'s parts, where those happen, report
  them (:meth:`HintedChains.residency_changed`). ``device_end``: the device-resident
  prefix, checked at its edge (device residency is prefix-closed).

Derived state only: CacheState owns residency and this index, and nothing here changes a
node. ``full_matches`` counts walks from the root (registration, a reset), for tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree
from pcr_sglang.core.keys import ChunkKey

logger = logging.getLogger(__name__)


class LiveHint(Protocol):
    hint_id: str
    keys: list[ChunkKey]
    seq: int


@dataclass(eq=False)
class HintedChain:
    """One live hint's matched chain: ``nodes[i]`` holds ``keys[i]`` (depth ``i + 1``)."""

    hint_id: str
    seq: int
    keys: Sequence[ChunkKey]
    nodes: list[ChunkNode] = field(default_factory=list)
    read_from: int = 0  # no node before it is SSD-only without a read in flight
    device_end: int = 0  # a guess at the device-resident prefix, checked when used


class HintedChains:
    def __init__(self, tree: ChunkTree):
        self._tree = tree
        self._chains: dict[str, HintedChain] = {}
        self._order: list[HintedChain] = []
        self._members: dict[ChunkNode, set[HintedChain]] = {}
        self._synced: object = None  # the sequence of hints the last sync was given
        self.full_matches = 0

    # ------------------------------------------------------------------ the live set
    def sync(self, hints: Sequence[LiveHint]) -> list[HintedChain]:
        """Track exactly ``hints`` (the book's live ones, in reading order) and bring each
        chain up to date with the tree; returns their chains in that order. Given the same
        tuple as last time (the book's, unchanged since), only the chains are brought up to
        date."""
        if isinstance(hints, tuple) and hints is self._synced:
            for tracked in self._order:
                self._refresh(tracked)
            return self._order
        self._synced = hints
        order, kept = [], {}
        for hint in hints:
            chain = self._chains.get(hint.hint_id)
            if chain is None or chain.seq != hint.seq:
                if chain is not None:
                    self._forget(chain)
                chain = HintedChain(hint.hint_id, hint.seq, hint.keys)
                self._extend(chain, self._tree.root)
                self.full_matches += 1
            else:
                self._refresh(chain)
            kept[hint.hint_id] = chain
            order.append(chain)
        for hint_id, chain in self._chains.items():
            if hint_id not in kept:
                self._forget(chain)
        self._chains, self._order = kept, order
        return order

    def tracked(self) -> list[HintedChain]:
        """The chains of the last :meth:`sync`, in its order."""
        return self._order

    def covers(self, node: ChunkNode) -> bool:
        """``node`` is on a tracked hint's matched chain."""
        return node in self._members

    def reset(self) -> None:
        """The tree was reset: every chain is matched again at the next sync."""
        self._chains, self._order, self._members, self._synced = {}, [], {}, None

    def __len__(self) -> int:
        return len(self._chains)

    # ------------------------------------------------------------------ tree events
    def residency_changed(self, node: ChunkNode) -> None:
        """``node`` lost a device or host copy, or a read of it ended without landing: it
        may need a read again."""
        chains = self._members.get(node)
        if chains:
            at = node.depth - 1
            for chain in chains:
                if chain.read_from > at:
                    chain.read_from = at

    def first_readable(self, chain: HintedChain, needs_read: Callable[[ChunkNode], bool]) -> Optional[int]:
        """The index of ``chain``'s first node ``needs_read`` (None: none), moving its
        read frontier past those that do not."""
        nodes, at = chain.nodes, chain.read_from
        while at < len(nodes) and not needs_read(nodes[at]):
            at += 1
        chain.read_from = at
        return at if at < len(nodes) else None

    def device_end(self, chain: HintedChain) -> int:
        """How many of ``chain``'s first nodes are on the device."""
        nodes = chain.nodes
        end = chain.device_end
        if end < len(nodes) and not nodes[end].on_device and (end == 0 or nodes[end - 1].on_device):
            return end  # unchanged (the usual case)
        end = min(end, len(nodes))
        if end and not nodes[end - 1].on_device:
            end = _first(nodes, end, lambda n: not n.on_device)
        while end < len(nodes) and nodes[end].on_device:
            end += 1
        chain.device_end = end
        return end

    # ------------------------------------------------------------------ upkeep
    def _refresh(self, chain: HintedChain) -> None:
        nodes = chain.nodes
        if nodes and nodes[-1].parent is not None and nodes[0].parent is self._tree.root:  # the usual case
            if len(nodes) < len(chain.keys) and chain.keys[len(nodes)] in nodes[-1].children:
                self._extend(chain, nodes[-1])
            return
        if nodes and nodes[-1].parent is None:  # chunks left the tree: its tail did
            lost = _first(nodes, len(nodes), lambda n: n.parent is None)
            self._truncate(chain, lost)
        if nodes and nodes[0].parent is not self._tree.root:  # a reset nobody reported
            self._forget(chain)
            self._extend(chain, self._tree.root)
            self.full_matches += 1
            return
        tail = nodes[-1] if nodes else self._tree.root
        if len(nodes) < len(chain.keys) and chain.keys[len(nodes)] in tail.children:
            self._extend(chain, tail)

    def _extend(self, chain: HintedChain, tail: ChunkNode) -> None:
        nodes, keys = chain.nodes, chain.keys
        start = len(nodes)
        while len(nodes) < len(keys):
            child = tail.children.get(keys[len(nodes)])
            if child is None:
                break
            nodes.append(child)
            self._members.setdefault(child, set()).add(chain)
            tail = child
        chain.read_from = min(chain.read_from, start)

    def _truncate(self, chain: HintedChain, length: int) -> None:
        for node in chain.nodes[length:]:
            self._leave(node, chain)
        del chain.nodes[length:]
        chain.read_from = min(chain.read_from, length)
        chain.device_end = min(chain.device_end, length)

    def _forget(self, chain: HintedChain) -> None:
        for node in chain.nodes:
            self._leave(node, chain)
        del chain.nodes[:]
        chain.read_from = chain.device_end = 0

    def _leave(self, node: ChunkNode, chain: HintedChain) -> None:
        chains = self._members.get(node)
        if chains is not None:
            chains.discard(chain)
            if not chains:
                del self._members[node]


def _first(nodes: Sequence[ChunkNode], end: int, pred: Callable[[ChunkNode], bool]) -> int:
    """The first index below ``end`` whose node satisfies ``pred`` (which holds for a
    suffix of ``nodes[:end]``, and for ``nodes[end - 1]``)."""
    lo, hi = 0, end - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(nodes[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
