"""The SSD level of the chunk tree: residency, SSD leaves, restore, dropping a bad record."""

from __future__ import annotations

from pcr_sglang.core import ChunkTree
from tests.unit.core.test_chunk_tree import CHUNK, insert, keys


def three_chunks_on_all_tiers():
    tree = ChunkTree()
    outcome = insert(tree, [1] * (3 * CHUNK))
    for slot, node in enumerate(outcome.nodes):
        tree.set_host(node, slot)
        tree.set_ssd(node)
    return tree, outcome.nodes


def test_a_persisted_chunk_outlives_the_device_and_host():
    tree, (a, b, c) = three_chunks_on_all_tiers()
    tree.evict(3)
    freed = []
    tree.evict_host(3, on_evict=lambda n: freed.append(n.host_slot))
    assert sorted(freed) == [0, 1, 2] and tree.num_chunks == 3 and tree.ssd_chunks == 3
    m = tree.match(iter(keys([1] * (3 * CHUNK))))
    assert m.num_chunks == 3 and m.num_on_device == 0 and all(n.on_ssd and not n.on_host for n in m.nodes)
    tree.check_invariants()


def test_ssd_eviction_takes_leaves_first_and_removes_chunks_in_no_tier():
    tree, (a, b, c) = three_chunks_on_all_tiers()
    tree.evict(3)
    tree.evict_host(3)
    deleted = []
    assert tree.evict_ssd(1, on_evict=lambda n: deleted.append(n)) == [c]
    assert deleted == [c] and tree.num_chunks == 2 and c.parent is None
    tree.check_invariants()


def test_dropping_a_bad_record_removes_what_only_it_made_reachable():
    tree, (a, b, c) = three_chunks_on_all_tiers()
    tree.evict(3)
    tree.evict_host(1)  # c: SSD only now; a and b still on host
    tree.evict_host(2)
    dropped_ssd = []
    tree.drop_ssd(b, on_drop_ssd=dropped_ssd.append)
    assert b.parent is None and c.parent is None and dropped_ssd == [c]
    assert tree.num_chunks == 1 and tree.ssd_chunks == 1
    tree.check_invariants()


def test_restore_builds_chains_of_persisted_chunks():
    tree = ChunkTree()
    ks = keys([5] * (3 * CHUNK))
    first = tree.add_persisted(None, ks[0])
    second = tree.add_persisted(first, ks[1])
    m = tree.match(iter(ks))
    assert m.nodes == [first, second] and tree.ssd_chunks == 2 and tree.device_chunks == 0
    tree.set_host(second, 0)
    tree.check_invariants()
    # A restored chain can be loaded back, parent first.
    tree.set_device(first, "d0")
    tree.set_device(second, "d1")
    assert tree.match(iter(ks)).num_on_device == 2
    tree.check_invariants()


def test_host_eviction_that_strands_descendants_releases_their_slots_and_records():
    """N (host only, never persisted) -> C (SSD only) -> G (host and SSD): evicting N from
    host memory leaves it in no tier, so C and G become unreachable and must give back
    their host slot and records."""
    tree = ChunkTree()
    n, c, g = insert(tree, [3] * (3 * CHUNK)).nodes
    for slot, node in enumerate((n, c, g)):
        tree.set_host(node, slot)
    tree.set_ssd(c)
    tree.set_ssd(g)
    tree.evict(3)
    tree.evict_host(1, is_protected=lambda node: node is not g)
    tree.evict_host(1, is_protected=lambda node: node is not c)
    tree.set_host(g, 7)  # G read back from SSD (a prefetch), C still SSD only
    freed_hosts, dropped_records = [], []
    assert tree.evict_host(
        1,
        is_protected=lambda node: node is not n,
        on_drop_host=lambda node: freed_hosts.append(node.host_slot),
        on_drop_ssd=dropped_records.append,
    ) == [n]
    assert freed_hosts == [7] and dropped_records == [g, c]
    assert tree.num_chunks == 0 and tree.host_chunks == 0 and tree.ssd_chunks == 0
    tree.check_invariants()
