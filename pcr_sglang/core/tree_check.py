"""The chunk tree's invariant check: recount everything the tree keeps incrementally.

:class:`pcr_sglang.core.chunk_tree.ChunkTree` keeps its counters, per-node child counts
and per-tier leaf sets up to date one change at a time, so that no operation costs
O(tree). A slip in any of those updates goes unnoticed until eviction takes the wrong
chunk; this walk recomputes them all from the nodes and compares. It costs O(tree), so
only the tests and debugging run it (``ChunkTree.check_invariants`` delegates here). It
lives apart from the tree because it is a reader of the tree's state, not part of
maintaining it.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol

from pcr_sglang.core.chunk_node import (
    ChunkNode,
    TreeStats,
    in_no_tier,
    is_device_leaf,
    is_host_leaf,
    is_ssd_leaf,
)


class _Leaves(Protocol):
    @property
    def leaves(self) -> set[Any]: ...


class CheckedTree(Protocol):
    """What the check reads of a :class:`~pcr_sglang.core.chunk_tree.ChunkTree` (a Protocol,
    so that this reader needs no import of the tree it checks)."""

    @property
    def _device(self) -> _Leaves: ...

    @property
    def _host(self) -> _Leaves: ...

    @property
    def _ssd(self) -> _Leaves: ...

    @property
    def num_chunks(self) -> int: ...

    @property
    def device_chunks(self) -> int: ...

    @property
    def host_chunks(self) -> int: ...

    @property
    def ssd_chunks(self) -> int: ...

    @property
    def locked_chunks(self) -> int: ...

    @property
    def locked_device_chunks(self) -> int: ...

    def iter_nodes(self) -> Iterable[ChunkNode]: ...

    def stats(self) -> TreeStats: ...


def check_tree(tree: CheckedTree) -> TreeStats:
    """Walk the whole of ``tree`` and assert its bookkeeping; returns its stats."""
    count = locked = device = host = ssd = 0
    device_leaves, host_leaves, ssd_leaves = set(), set(), set()
    for node in tree.iter_nodes():
        count += 1
        parent = node.parent
        assert parent is not None and parent.children.get(node.key) is node
        assert node.depth == parent.depth + 1
        assert not in_no_tier(node), f"{node!r} lives in no tier"
        if node.on_device:
            device += 1
            assert parent.is_root or parent.on_device, f"{node!r} on device without its parent"
        host += node.on_host
        ssd += node.on_ssd
        assert node.ssd_children == sum(c.on_ssd for c in node.children.values()), node
        assert node.device_children == sum(c.on_device for c in node.children.values()), node
        assert node.host_children == sum(c.on_host for c in node.children.values()), node
        assert node.lock_ref >= 0 and node.host_pins >= 0, node
        # lock() raises every ancestor's count: a parent holds at least its children's.
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), node
        if node.lock_ref > 0:
            locked += 1
        if is_device_leaf(node):
            device_leaves.add(node)
        if is_host_leaf(node):
            host_leaves.add(node)
        if is_ssd_leaf(node):
            ssd_leaves.add(node)
    assert count == tree.num_chunks, (count, tree.num_chunks)
    assert device == tree.device_chunks, (device, tree.device_chunks)
    assert host == tree.host_chunks, (host, tree.host_chunks)
    assert ssd == tree.ssd_chunks, (ssd, tree.ssd_chunks)
    assert locked == tree.locked_chunks, (locked, tree.locked_chunks)
    locked_device = sum(1 for n in tree.iter_nodes() if n.lock_ref > 0 and n.on_device)
    assert locked_device == tree.locked_device_chunks, (locked_device, tree.locked_device_chunks)
    # The leaf sets are the tree's own (private) state: this check is their one outside reader.
    assert device_leaves == tree._device.leaves
    assert host_leaves == tree._host.leaves
    assert ssd_leaves == tree._ssd.leaves
    return tree.stats()
