"""How much retrieval latency the look-ahead hides when the datastore lives on SSD.

A synthetic table of ``--vectors`` jittered copies of real all-MiniLM-L6-v2 embeddings of
the Wikipedia extracts (TeleRAG's scale on a CPU machine: a 1M table is 1.5 GB per copy)
is built once and memory-mapped; before each measured leg the datastore's files are
dropped from the page cache (``posix_fadvise(DONTNEED)``, only our files) and the
datastore is opened again, so a search reads the disk (the kernel keeps every page a
live mapping has touched: dropping under a mapping left the pages an earlier leg read
resident, which is how this benchmark ran until 2026-12-03; it now checks with
``mincore`` that the drop took).
Per query, side by side:

* ``faiss``: ``search(q_out)`` alone, what a pipeline without look-ahead waits for;
* ``lookahead``: ``lookahead(q_in)``, then ``--generation-s`` of simulated pre-retrieval
  generation (the LLM writing the query; nothing else runs), then ``search(q_out)``.

``q_in`` is the question ("What is <title> known for?"), ``q_out`` the question with the
article's first sentence, standing in for a HyDE passage (no LLM runs here: the lead
time is a parameter). Reported: median search latency of each, the share hidden, the
cluster hit rate, and whether every merged result equals faiss's (exact mode). Medians
over ``--queries`` queries; the two are measured alternately on the same queries.

Usage: ``python -m bench.lookahead_retrieval [--vectors 1000000] [--queries 20]``
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pcr_client.paths import cache_root
from pcr_client.rag.budget import BudgetModel, measure_read_bandwidth
from pcr_client.rag.embedder import embed_texts, load_embedder
from pcr_client.rag.fast_device import FAST_TIERS, make_fast_tier
from pcr_client.rag.ivf import IVFDatastore, normalized
from pcr_client.rag.lookahead import LookaheadRetriever
from pcr_tools.data import load_wiki_articles

logger = logging.getLogger(__name__)


def drop_page_cache(directory: Path) -> None:
    """Evict our datastore's files (and only those) from the page cache. Pages a live
    mapping of this process has touched stay: drop every datastore opened on them first
    (:func:`open_cold`)."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages (a table just built) are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def resident_share(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` over a fresh,
    untouched mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        pages = (size + page - 1) // page
        vector = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(mapped.ctypes.data), ctypes.c_size_t(size), vector) != 0:
            raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
        return sum(b & 1 for b in bytes(vector)) / pages
    finally:
        del mapped


def open_cold(directory: Path) -> IVFDatastore:
    """The datastore opened again with none of its table in the page cache. Callers
    must have dropped every datastore opened before (and ``gc`` must be able to free
    them): a live mapping keeps the pages it touched."""
    gc.collect()
    drop_page_cache(directory)
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        left = resident_share(path)
        if left > 0.01:
            raise RuntimeError(
                f"{100 * left:.0f}% of {path} stayed in the page cache after the drop: "
                "a mapping of it is still open, so the measurement would not be cold"
            )
    return IVFDatastore.load(directory, mmap=True)


def build_table(directory: Path, base: np.ndarray, vectors: int, nlist: int, sigma: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    copies = -(-vectors // len(base))
    rows = []
    for _ in range(copies):
        rows.append(normalized(base + sigma * rng.standard_normal(base.shape).astype(np.float32)))
    table = np.concatenate(rows)[:vectors]
    print(f"[bench] training IVF{nlist} over {len(table)} vectors", file=sys.stderr)
    start = time.perf_counter()
    IVFDatastore.build(table, nlist, seed=seed).save(directory)
    (directory / "built.json").write_text(json.dumps({"vectors": vectors, "nlist": nlist, "sigma": sigma}))
    print(f"[bench] built in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lookahead_retrieval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vectors", type=int, default=1_000_000)
    parser.add_argument("--nlist", type=int, default=1024)
    parser.add_argument("--nprobe", type=int, default=64)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--base-docs", type=int, default=1000, help="real embeddings the table is jittered from")
    parser.add_argument("--sigma", type=float, default=0.05, help="jitter of each copy (then renormalised)")
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--generation-s", type=float, default=1.0, help="simulated pre-retrieval generation")
    parser.add_argument("--tier-mb", type=int, default=512, help="the fast tier's size (MB)")
    parser.add_argument(
        "--fast-tier", choices=FAST_TIERS, default="auto", help="gpu, host, or auto (the GPU where torch sees one)"
    )
    parser.add_argument(
        "--budget-mb", type=int, default=0, help="look-ahead budget (default: measured bandwidth x --generation-s)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the table lives (default: the cache)")
    parser.add_argument(
        "--no-predict",
        action="store_true",
        help="the look-ahead copies clusters only, without the prediction's faiss search (what "
        "KV hints need; it also reads the question's clusters into the page cache)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    articles = list(load_wiki_articles())[: args.base_docs]
    texts = [f"{a.title}. {a.text}" for a in articles]
    base = embed_texts(texts)
    directory = args.dir or cache_root() / "bench" / f"ivf-{args.vectors}-{args.nlist}-{args.base_docs}-{args.seed}"
    if not (directory / "built.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        build_table(directory, base, args.vectors, args.nlist, args.sigma, args.seed)
    datastore = IVFDatastore.load(directory, mmap=True)
    embedder = load_embedder()
    rng = np.random.default_rng(args.seed + 1)
    picks = rng.choice(len(articles), args.queries, replace=False)
    q_in_text = [f"What is {articles[i].title} known for?" for i in picks]
    q_out_text = [f"{q} {articles[i].text.split('. ')[0]}." for q, i in zip(q_in_text, picks)]
    q_in, q_out = embedder.encode(q_in_text), embedder.encode(q_out_text)

    ntotal, nlist = datastore.index.ntotal, datastore.nlist
    del datastore
    datastore = open_cold(directory)
    bandwidth = measure_read_bandwidth(datastore.table.codes)  # from the disk: its cache was just dropped
    del datastore
    faiss_ms, lookahead_ms, hit_rates, identical = [], [], [], 0
    copied = 0.0
    for n in range(args.queries):
        plain = LookaheadRetriever(open_cold(directory), embed=None, nprobe=args.nprobe, k=args.k)
        start = time.perf_counter()
        ref = plain.search_vectors(q_out[n : n + 1])
        faiss_ms.append((time.perf_counter() - start) * 1000)
        plain.close()
        del plain
        # A fresh tier per query: what one pipeline's look-ahead fetches, no cache across queries.
        budget = BudgetModel(
            default_stage_s=args.generation_s, stage_bytes={"bench": args.budget_mb << 20} if args.budget_mb else {}
        )
        budget.observe_bandwidth(bandwidth)
        cold = open_cold(directory)
        retriever = LookaheadRetriever(
            cold,
            embed=None,
            nprobe=args.nprobe,
            k=args.k,
            tier=make_fast_tier(cold.table, args.tier_mb << 20, args.fast_tier),
            budget=budget,
        )
        del cold
        try:
            ticket = retriever.lookahead_vectors(q_in[n : n + 1], stage="bench", predict=not args.no_predict)
            time.sleep(args.generation_s)  # the LLM writes the query meanwhile
            start = time.perf_counter()
            got = retriever.search_vectors(q_out[n : n + 1], ticket)
            lookahead_ms.append((time.perf_counter() - start) * 1000)
            copied += retriever.tier.stats.bytes_copied
        finally:
            retriever.close()
        del retriever
        hit_rates.append(got.stats.hit_rate)
        identical += set(got.ids[0]) == set(ref.ids[0])
    f, la = statistics.median(faiss_ms), statistics.median(lookahead_ms)
    print(
        f"\n{ntotal} vectors, nlist {nlist}, nprobe {args.nprobe}, k {args.k}, "
        f"{args.queries} queries, simulated generation {args.generation_s:g} s, tier {args.tier_mb} MB, "
        f"{'no prediction' if args.no_predict else 'with the prediction search'}, "
        f"disk read bandwidth {bandwidth / 1e6:.0f} MB/s, {copied / args.queries / 1e6:.0f} MB copied per look-ahead"
    )
    print("| search | median latency | P90 |")
    print("| --- | --- | --- |")
    print(f"| faiss on the memory-mapped datastore (cold) | {f:.1f} ms | {np.percentile(faiss_ms, 90):.1f} ms |")
    print(f"| after look-ahead (merged) | {la:.1f} ms | {np.percentile(lookahead_ms, 90):.1f} ms |")
    print(
        f"\nhidden: {1 - la / f:.0%} of the median latency; cluster hit rate {statistics.mean(hit_rates):.0%}; "
        f"results identical to faiss's: {identical}/{args.queries}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
