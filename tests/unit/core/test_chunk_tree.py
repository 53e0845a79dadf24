from __future__ import annotations

import random

import pytest

from pcr_sglang.core import CacheNamespace, ChunkTree, chunk_keys, root_key
from pcr_sglang.core.keys import iter_chunk_keys

CHUNK = 4
NS = CacheNamespace(model_fingerprint="m", kv_dtype="float16", chunk_size=CHUNK).digest()
ROOT = root_key(NS)


def keys(tokens, root=ROOT):
    return chunk_keys(root, tokens, CHUNK)


def insert(tree, tokens, root=ROOT):
    ks = keys(tokens, root)
    return tree.insert(ks, [f"v{i}" for i in range(len(ks))])


def test_partial_trailing_chunk_is_never_keyed():
    assert len(keys(list(range(11)))) == 2
    assert keys(list(range(3))) == []


def test_key_depends_on_whole_prefix_figure7():
    # Paper, Figure 7: D1 and D2 share their first chunk (one node, C1); their second
    # chunks have equal tokens but different prefixes, so they are different nodes.
    d1 = [1, 2, 3, 4, 9, 9, 9, 9]
    d2 = [1, 2, 3, 4, 9, 9, 9, 9]
    d3 = [5, 6, 7, 8, 9, 9, 9, 9]
    tree = ChunkTree()
    a = insert(tree, d1)
    b = insert(tree, d2)
    c = insert(tree, d3)
    assert a.nodes == b.nodes  # identical documents share both chunks
    assert c.nodes[1] is not a.nodes[1]  # same tokens, different prefix: different node
    assert c.nodes[1].key != a.nodes[1].key
    assert tree.num_chunks == 4


def test_match_stops_at_first_miss_and_hashes_lazily():
    tree = ChunkTree()
    insert(tree, list(range(12)))
    probe = list(range(8)) + [99, 99, 99, 99] + list(range(8, 12))
    consumed = []

    def spy():
        for k in iter_chunk_keys(ROOT, probe, CHUNK):
            consumed.append(k)
            yield k

    outcome = tree.match(spy())
    assert outcome.num_chunks == 2
    assert len(consumed) == 3  # hashed up to the first miss, not the whole prompt


def test_first_chunk_differs_reuses_nothing_and_k_chunks_reuse_k():
    tree = ChunkTree()
    base = list(range(40))
    insert(tree, base)
    assert tree.match(iter(keys([-1] + base[1:]))).num_chunks == 0
    for k in range(0, 10):
        probe = base[: k * CHUNK] + [-5] * CHUNK + base[(k + 1) * CHUNK :]
        assert tree.match(iter(keys(probe))).num_chunks == k


def test_namespace_and_salt_separate_chains():
    tree = ChunkTree()
    tokens = list(range(8))
    insert(tree, tokens)
    other_model = root_key(CacheNamespace("other", "float16", CHUNK).digest())
    salted = root_key(NS, cache_salt="tenant-b")
    lora = root_key(NS, extra_key="lora-1")
    for root in (other_model, salted, lora):
        assert tree.match(iter(keys(tokens, root))).num_chunks == 0
    assert root_key(NS, "ab", None) != root_key(NS, "a", "b")


def test_insert_reports_existing_prefix_and_keeps_old_values():
    tree = ChunkTree()
    insert(tree, list(range(8)))
    ks = keys(list(range(16)))
    outcome = tree.insert(ks, ["x0", "x1", "x2", "x3"])
    assert outcome.num_existing == 2
    assert [n.device_value for n in outcome.nodes] == ["v0", "v1", "x2", "x3"]
    assert len(outcome.new_nodes) == 2


def test_lru_evicts_least_recent_leaf_and_parent_becomes_leaf():
    tree = ChunkTree()
    a = insert(tree, [1] * 8)  # chain a0 -> a1
    b = insert(tree, [2] * 4)
    c = insert(tree, [3] * 4)
    tree.match(iter(keys([1] * 8)))  # a is now most recent
    evicted = tree.evict(2)
    assert evicted == [b.nodes[0], c.nodes[0]]
    evicted = tree.evict(1)
    assert evicted == [a.nodes[1]]  # a leaf first; its parent then becomes a leaf
    assert tree.evict(5) == [a.nodes[0]]
    assert tree.num_chunks == 0
    tree.check_invariants()


def test_locked_chunks_are_never_evicted_and_locks_balance():
    tree = ChunkTree()
    a = insert(tree, list(range(12)))
    insert(tree, [7] * 8)
    tree.lock(a.last_node)
    assert tree.locked_chunks == 3
    evicted = tree.evict(10)
    assert all(n not in a.nodes for n in evicted)
    assert tree.num_chunks == 3
    tree.lock(a.nodes[0])
    assert tree.unlock(a.last_node) == 2
    assert tree.unlock(a.nodes[0]) == 1
    assert tree.locked_chunks == 0
    with pytest.raises(RuntimeError, match="unbalanced"):
        tree.unlock(a.nodes[0])
    tree.check_invariants()


def test_protected_leaves_are_evicted_last():
    tree = ChunkTree()
    old = insert(tree, [1] * 4)
    young = insert(tree, [2] * 4)
    evicted = tree.evict(1, is_protected=lambda n: n is old.nodes[0])
    assert evicted == [young.nodes[0]]
    assert tree.evict(1, is_protected=lambda n: True) == [old.nodes[0]]


def test_on_evict_sees_value_before_detach():
    tree = ChunkTree()
    insert(tree, [1] * 8)
    seen = []
    tree.evict(2, on_evict=lambda n: seen.append(n.device_value))
    assert seen == ["v1", "v0"]


def test_randomized_operations_keep_invariants():
    rng = random.Random(0)
    tree = ChunkTree()
    docs = [[rng.randrange(50) for _ in range(CHUNK * 3)] for _ in range(10)]
    held = []
    for step in range(2000):
        op = rng.random()
        prompt = sum((rng.choice(docs) for _ in range(rng.randint(1, 3))), [])
        if op < 0.4:
            insert(tree, prompt)
        elif op < 0.6:
            node = tree.match(iter(keys(prompt))).last_node
            if not node.is_root:
                tree.lock(node)
                held.append(node)
        elif op < 0.8 and held:
            tree.unlock(held.pop(rng.randrange(len(held))))
        else:
            tree.evict(rng.randint(1, 5))
        if step % 200 == 0:
            tree.check_invariants()
    for node in held:
        tree.unlock(node)
    stats = tree.check_invariants()
    assert stats.locked_chunks == 0
    tree.evict(10**6)
    assert tree.num_chunks == 0


def test_paper_figure7_lookahead_lru_example():
    """PCR paper, Figure 7: leaves {C2, C4, C6, C8}, C2 the oldest; the next request needs
    C2. Making room for C9 (a child of C8) evicts C4 instead of C2; the leaf set becomes
    {C2, C3, C6, C9}. Plain LRU would evict C2 and leave {C4, C6, C9}."""
    from pcr_sglang.core.lookahead import LookaheadProtection

    def build():
        tree = ChunkTree()
        c1 = [1] * CHUNK
        paths = {
            "C2": c1 + [2] * CHUNK,
            "C4": c1 + [3] * CHUNK + [4] * CHUNK,
            "C6": c1 + [5] * CHUNK + [6] * CHUNK,
            "C8": c1 + [7] * CHUNK + [8] * CHUNK,
        }
        leaves = {name: insert(tree, tokens).last_node for name, tokens in paths.items()}
        return tree, paths, leaves

    def leaf_names(tree, names):
        return {names[n] for n in tree.iter_nodes() if not n.children}

    for lookahead in (True, False):
        tree, paths, leaves = build()
        names = {node: name for name, node in leaves.items()}
        names[leaves["C4"].parent] = "C3"
        protection = LookaheadProtection(tree, window=1 if lookahead else 0)
        protection.refresh([keys(paths["C2"] + [0] * CHUNK)])  # next request: C1 C2 ...
        tree.evict(1, is_protected=protection.__contains__)
        c9 = insert(tree, paths["C8"] + [9] * CHUNK).last_node
        names[c9] = "C9"
        if lookahead:
            assert leaf_names(tree, names) == {"C2", "C3", "C6", "C9"}
        else:
            assert leaf_names(tree, names) == {"C4", "C6", "C9"}
        tree.check_invariants()


def test_lookahead_refresh_does_not_touch_recency_and_respects_window():
    from pcr_sglang.core.lookahead import LookaheadProtection

    tree = ChunkTree()
    a = insert(tree, [1] * 8)
    b = insert(tree, [2] * 8)
    before = [n.last_access for n in a.nodes + b.nodes]
    protection = LookaheadProtection(tree, window=1)
    assert protection.refresh([keys([1] * 8), keys([2] * 8)]) == 2  # only the first request
    assert [n.last_access for n in a.nodes + b.nodes] == before
    assert a.last_node in protection and b.last_node not in protection
    with pytest.raises(ValueError):
        LookaheadProtection(tree, window=-1)
