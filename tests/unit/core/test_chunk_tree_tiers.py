"""Two-tier residency in the chunk tree: device and host, per-tier leaves, demotion."""

from __future__ import annotations

import pytest

from pcr_sglang.core import ChunkTree
from tests.unit.core.test_chunk_tree import CHUNK, insert, keys


def demote_to(slots: list[int]):
    """An on_evict callback that copies each evicted chunk into the next free host slot."""

    def on_evict(node):
        if not node.on_host and slots:
            tree_of[0].set_host(node, slots.pop())

    tree_of: list[ChunkTree] = []
    return on_evict, tree_of


def test_demotion_keeps_the_chunk_and_match_reports_the_device_prefix():
    tree = ChunkTree()
    a = insert(tree, [1] * (2 * CHUNK))
    first, second = a.nodes
    on_evict, holder = demote_to([7])
    holder.append(tree)
    assert tree.evict(1, on_evict=on_evict) == [second]
    assert second.on_host and not second.on_device and second.host_slot == 7
    assert tree.num_chunks == 2 and tree.device_chunks == 1 and tree.host_chunks == 1
    m = tree.match(iter(keys([1] * (2 * CHUNK))))
    assert m.num_chunks == 2 and m.num_on_device == 1
    tree.set_device(second, "reloaded")
    assert tree.match(iter(keys([1] * (2 * CHUNK)))).num_on_device == 2
    tree.check_invariants()


def test_child_cannot_come_back_before_its_parent():
    tree = ChunkTree()
    a = insert(tree, [1] * (2 * CHUNK))
    for n in reversed(a.nodes):
        tree.set_host(n, n.depth)
    tree.evict(2)
    assert tree.device_chunks == 0 and tree.host_chunks == 2
    with pytest.raises(RuntimeError, match="before its parent"):
        tree.set_device(a.nodes[1], "x")
    tree.check_invariants()


def test_losing_the_last_tier_drops_host_only_descendants():
    tree = ChunkTree()
    a = insert(tree, [1] * (3 * CHUNK))
    tree.set_host(a.nodes[2], 30)
    tree.set_host(a.nodes[1], 20)
    tree.evict(2)  # chunks 2 and 1 leave the device, both kept on the host
    assert tree.device_chunks == 1 and tree.num_chunks == 3
    dropped = []
    tree.evict(1, on_drop_host=lambda n: dropped.append(n.host_slot))
    # Chunk 0 had no host copy: it is gone, and its host-only descendants with it.
    assert sorted(dropped) == [20, 30]
    assert tree.num_chunks == 0 and tree.host_chunks == 0
    tree.check_invariants()


def test_host_eviction_takes_host_leaves_lru_and_removes_tierless_chunks():
    tree = ChunkTree()
    a = insert(tree, [1] * (2 * CHUNK))
    b = insert(tree, [2] * CHUNK)
    for n in (*a.nodes, *b.nodes):
        tree.set_host(n, n.depth * 10 + (n in b.nodes))
    tree.evict(10)  # everything to host only
    assert tree.device_chunks == 0 and tree.num_chunks == 3
    freed = []
    tree.evict_host(2, on_evict=lambda n: freed.append(n.host_slot))
    # a's second chunk (a host leaf), then a's first, which became a leaf and is older
    # than b; b stays.
    assert freed == [20, 10] and tree.num_chunks == 1 and b.nodes[0].on_host
    tree.check_invariants()


def test_locked_chunks_stay_in_both_tiers():
    tree = ChunkTree()
    a = insert(tree, [1] * (2 * CHUNK))
    for n in a.nodes:
        tree.set_host(n, n.depth)
    tree.lock(a.last_node)
    assert tree.evict(5) == [] and tree.evict_host(5) == []
    tree.unlock(a.last_node)
    assert len(tree.evict_host(5)) == 2 and tree.num_chunks == 2  # still on the device
    tree.check_invariants()
