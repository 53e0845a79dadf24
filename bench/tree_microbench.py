"""Micro-benchmark of PCR's core chunk tree: per-operation cost as the tree grows.

For trees of 10^3 to 10^6 chunks (built from random chains of 64 chunks, so the tree is
both wide and deep), times, per chunk touched:

* match: a 64-chunk lookup that hits its whole chain (hashing included),
* insert: a new 64-chunk chain,
* lock + unlock of a 64-chunk chain,
* evict: removing 64 LRU leaves, with a look-ahead protection set of 8 chains,
* look-ahead refresh for a window of 8 waiting requests.

Each figure is the median of --repeats runs. If an operation's per-chunk cost stays flat
as the tree grows 1000x, the operation is O(chunks touched), not O(tree).

Usage: python bench/tree_microbench.py [--sizes 1e3,1e4,1e5,1e6] [--repeats 200]
"""

from __future__ import annotations

import argparse
import time

from pcr_eval.sim.tree_costs import CHAIN, CHUNK, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e3,1e4,1e5,1e6")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    ops = ["match", "insert", "lock+unlock", "evict", "lookahead"]
    print(f"per-chunk cost in microseconds (median of {args.repeats}); chunk {CHUNK} tokens, chains of {CHAIN} chunks")
    print("tree chunks".rjust(12) + "".join(op.rjust(13) for op in ops))
    for size in sizes:
        t = time.perf_counter()
        figures = measure(size, args.repeats, args.seed)
        print(
            f"{size:>12,}"
            + "".join(f"{figures[op]:13.2f}" for op in ops)
            + f"   (built+measured in {time.perf_counter() - t:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
