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

from pcr_eval.sim.lookahead import TraceParams, make_trace, replay, working_set_chunks
from pcr_sglang.core import CacheNamespace, chunk_keys, root_key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--queue-depth", type=int, default=16)
    parser.add_argument("--windows", default="0,1,2,4,8,16")
    parser.add_argument(
        "--capacities", default="0.05,0.1,0.2", help="device capacity as fractions of the trace's working set"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    params = TraceParams(requests=args.requests, docs=args.docs, zipf_exponent=args.zipf, seed=args.seed)
    root = root_key(CacheNamespace("sim", "float16", params.chunk_size).digest())
    trace_keys = [chunk_keys(root, t, params.chunk_size) for t in make_trace(params)]
    ws = working_set_chunks(trace_keys)
    windows = [int(w) for w in args.windows.split(",")]
    print(
        f"trace: {params.requests} requests, {params.docs} docs, zipf {params.zipf_exponent}, "
        f"working set {ws} chunks of {params.chunk_size} tokens, queue depth {args.queue_depth}"
    )
    header = "capacity".ljust(18) + "".join(f"W={w}".rjust(9) for w in windows)
    print(header)
    for frac in (float(c) for c in args.capacities.split(",")):
        capacity = max(1, int(frac * ws))
        ratios = [replay(trace_keys, capacity, w, args.queue_depth) for w in windows]
        print(f"{frac:>5.0%} ({capacity:>6} ch)" + "".join(f"{r:9.3f}" for r in ratios))
    print("hit ratio = chunks reused / chunks requested; W=0 is plain LRU")


if __name__ == "__main__":
    main()
