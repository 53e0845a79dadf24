"""Look-ahead LRU vs plain LRU on the same trace and the same capacity (PCR's core tree).

Replays a seeded RAG trace through :class:`pcr_sglang.core.ChunkTree` exactly as the
server's cache uses it (match, lock, evict to make room, insert, unlock), serving one
request at a time while the next ``--queue-depth`` requests wait, and protects the
chunks of the first W waiting requests (W = 0 is plain LRU). Prints the chunk hit
ratio for each W side by side, for capacities given as a fraction of the working set.

Synthetic documents (lognormal lengths, Zipf popularity) keep the sweep fast; the
figures are hit ratios, independent of the machine.

Usage: python bench/lookahead_sim.py [--requests 3000] [--windows 0,1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from pcr_sglang.core import CacheNamespace, ChunkTree, chunk_keys, root_key
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--queue-depth", type=int, default=16)
    parser.add_argument("--windows", default="0,1,2,4,8,16")
    parser.add_argument("--capacities", default="0.05,0.1,0.2",
                        help="device capacity as fractions of the trace's working set")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    params = TraceParams(requests=args.requests, docs=args.docs, zipf_exponent=args.zipf, seed=args.seed)
    root = root_key(CacheNamespace("sim", "float16", params.chunk_size).digest())
    trace_keys = [chunk_keys(root, t, params.chunk_size) for t in make_trace(params)]
    ws = working_set_chunks(trace_keys)
    windows = [int(w) for w in args.windows.split(",")]
    print(f"trace: {params.requests} requests, {params.docs} docs, zipf {params.zipf_exponent}, "
          f"working set {ws} chunks of {params.chunk_size} tokens, queue depth {args.queue_depth}")
    header = "capacity".ljust(18) + "".join(f"W={w}".rjust(9) for w in windows)
    print(header)
    for frac in (float(c) for c in args.capacities.split(",")):
        capacity = max(1, int(frac * ws))
        ratios = [replay(trace_keys, capacity, w, args.queue_depth) for w in windows]
        print(f"{frac:>5.0%} ({capacity:>6} ch)" + "".join(f"{r:9.3f}" for r in ratios))
    print("hit ratio = chunks reused / chunks requested; W=0 is plain LRU")


if __name__ == "__main__":
    main()
