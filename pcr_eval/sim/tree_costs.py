"""The core chunk tree's per-operation cost per chunk touched, on a tree of a given size
built from random 64-chunk chains (wide and deep): match, insert, lock + unlock, evict with
look-ahead protection, and the look-ahead refresh. ``python -m bench.tree_microbench``
prints them from 10^3 to 10^6 chunks; flat figures mean O(chunks touched), not O(tree)."""

from __future__ import annotations

import random
import statistics
import time
from array import array

from pcr_sglang.core import CacheNamespace, ChunkTree, chunk_keys, root_key
from pcr_sglang.core.keys import iter_chunk_keys
from pcr_sglang.core.lookahead import LookaheadProtection

CHUNK = 64
CHAIN = 64  # chunks per request (4,096 tokens)


def random_prompt(rng: random.Random) -> array:
    # Random 17-bit token ids, generated in bulk (a per-token randrange would dominate).
    raw = array("i", rng.randbytes(4 * CHUNK * CHAIN))
    return array("q", (t & 0x1FFFF for t in raw))


def build(root: bytes, num_chunks: int, rng: random.Random) -> tuple[ChunkTree, list[array]]:
    tree = ChunkTree()
    prompts = []
    # Chains share random-length prefixes with earlier ones, like RAG prompts do.
    while tree.num_chunks < num_chunks:
        if prompts and rng.random() < 0.7:
            base = rng.choice(prompts)
            cut = rng.randrange(1, CHAIN) * CHUNK
            prompt = base[:cut] + random_prompt(rng)[cut:]
        else:
            prompt = random_prompt(rng)
        keys = chunk_keys(root, prompt, CHUNK)
        tree.insert(keys, [True] * len(keys))  # any device value: the tree only needs one
        prompts.append(prompt)
    return tree, prompts


def measure(size: int, repeats: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    root = root_key(CacheNamespace("bench", "float16", CHUNK).digest())
    tree, prompts = build(root, size, rng)
    out: dict[str, list[float]] = {k: [] for k in ("match", "insert", "lock+unlock", "evict", "lookahead")}
    protection = LookaheadProtection(tree, window=8)
    for _ in range(repeats):
        prompt = rng.choice(prompts)
        t = time.perf_counter()
        m = tree.match(iter_chunk_keys(root, prompt, CHUNK))
        out["match"].append((time.perf_counter() - t) / max(m.num_chunks, 1))

        t = time.perf_counter()
        tree.lock(m.last_node)
        tree.unlock(m.last_node)
        out["lock+unlock"].append((time.perf_counter() - t) / max(m.num_chunks, 1))

        window = [chunk_keys(root, rng.choice(prompts), CHUNK) for _ in range(8)]
        t = time.perf_counter()
        protected = protection.refresh(window)
        out["lookahead"].append((time.perf_counter() - t) / max(protected, 1))

        new = random_prompt(rng)
        keys = chunk_keys(root, new, CHUNK)
        t = time.perf_counter()
        tree.insert(keys, [True] * len(keys))  # any device value: the tree only needs one
        out["insert"].append((time.perf_counter() - t) / len(keys))

        t = time.perf_counter()
        evicted = tree.evict(CHAIN, is_protected=protection.__contains__)
        out["evict"].append((time.perf_counter() - t) / max(len(evicted), 1))
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}
