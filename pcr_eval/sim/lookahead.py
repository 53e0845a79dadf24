"""Look-ahead LRU vs plain LRU on one seeded synthetic RAG trace, through
:class:`pcr_sglang.core.ChunkTree` exactly as the server's cache uses it (match, lock, evict
to make room, insert, unlock), one request at a time while the next ones wait; the chunks
of the first W waiting requests are protected (W = 0 is plain LRU). The command, its
options and its table are ``python -m bench.lookahead_sim``'s."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pcr_sglang.core import ChunkTree
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_tools.workload import zipf_weights


@dataclass(frozen=True)
class TraceParams:
    requests: int = 3000
    docs: int = 400
    chunk_size: int = 64
    zipf_exponent: float = 1.0
    min_docs: int = 3
    max_docs: int = 5
    seed: int = 0


def make_trace(p: TraceParams) -> list[list[int]]:
    rng = random.Random(p.seed)
    # Document lengths ~ lognormal, clipped to 300-1500 tokens.
    lengths = [min(1500, max(300, int(rng.lognormvariate(6.4, 0.5)))) for _ in range(p.docs)]
    docs, next_token = [], 1000
    for n in lengths:
        docs.append(list(range(next_token, next_token + n)))
        next_token += n
    system = list(range(1, 2 * p.chunk_size + 1))
    weights = zipf_weights(p.docs, p.zipf_exponent)
    trace = []
    for i in range(p.requests):
        k = rng.randint(p.min_docs, p.max_docs)
        chosen: list[int] = []
        while len(chosen) < k:
            d = rng.choices(range(p.docs), weights=weights)[0]
            if d not in chosen:
                chosen.append(d)
        question = [next_token + i * 50 + j for j in range(40)]
        trace.append(system + sum((docs[d] for d in chosen), []) + question)
    return trace


def working_set_chunks(trace_keys: list[list[bytes]]) -> int:
    return len({k for keys in trace_keys for k in keys})


def replay(trace_keys: list[list[bytes]], capacity: int, window: int, queue_depth: int) -> float:
    tree = ChunkTree()
    protection = LookaheadProtection(tree, window)
    hits = total = 0
    for i, keys in enumerate(trace_keys):
        protection.refresh(trace_keys[i + 1 : i + 1 + min(window, queue_depth)])
        outcome = tree.match(iter(keys))
        hits += outcome.num_chunks
        total += len(keys)
        tree.lock(outcome.last_node)
        new = len(keys) - outcome.num_chunks
        overflow = tree.num_chunks + new - capacity
        if overflow > 0:
            tree.evict(overflow, is_protected=protection.__contains__)
        # What still does not fit is computed but not cached (as the server does when
        # the pool is full of locked chunks).
        room = max(0, capacity - tree.num_chunks)
        keep = outcome.num_chunks + min(new, room)
        tree.insert(keys[:keep], [True] * keep)  # device values: the tree needs one, any will do
        tree.unlock(outcome.last_node)
    return hits / max(total, 1)
