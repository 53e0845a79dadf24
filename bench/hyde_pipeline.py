"""The HyDE pipeline end to end on SmolLM2: what the cluster look-ahead and the KV hints
each give, side by side.

One PCR server with host and SSD tiers serves every configuration. The final prompts'
KV is computed once (a fill pass), then before each configuration the server is
restarted on the same store, so every chain starts on SSD only, as after a warm restart
or once host memory has moved on; ``--read-delay-ms`` slows each SSD chunk read in the
I/O process (the ``PCR_IO_TEST_FAULTS`` knob: a disk with that much more latency per
read; reads in flight at once overlap it, ``--read-threads`` of them, the server's
``--pcr-ssd-read-threads``: a comma list runs every configuration at each). Configurations:

* ``none``: no look-ahead: faiss searches the memory-mapped datastore, the final
  request reads its chain from SSD when it arrives;
* ``clusters``: the look-ahead copies the predicted clusters into the host fast tier
  while the passage is written;
* ``hints``: the predicted final prompt goes to the server as a KV hint, which reads its
  chain into host memory meanwhile;
* ``both``.

Questions are answered one at a time (low load: the waiting queue never holds the final
request, so only a hint can read its chain ahead), or with ``--concurrency N`` N at a
time, grouped by similarity (``run_batch``, TeleRAG's prefetch scheduler: under load the
final requests queue, and the queue's own prefetch reads ahead too). Reported per configuration: median
pipeline latency, passage generation, retrieval (embedding the query, then the search),
the search alone (what the look-ahead can hide: the share of ``none``'s search latency
each configuration hides), the final request's latency (8 output tokens), its
cached tokens by tier, the cluster hit rate, how many searches returned exactly faiss's
documents for the same query, and the server's hint counters.

``--table-vectors N`` searches a synthetic table of N jittered copies of the ``--docs``
extracts' embeddings instead (``bench.lookahead_retrieval``'s table: TeleRAG's scale,
1.5 GB for 1M vectors, memory-mapped; a copy's document is its original's), dropped from
the page cache and opened again before each pipeline (with ``--concurrency``, before the
batch), so the search reads the disk: where retrieval takes long enough for the
look-ahead to hide.
``--repeats`` runs of ``--questions`` pipelines each, the configurations interleaved
within each repeat (the machine's noise falls on all alike); medians over every pipeline
of every repeat, counters summed.

Usage: ``python -m bench.hyde_pipeline [--questions 8] [--docs 1000] [--read-delay-ms 20]
[--read-threads 1,4] [--repeats 2] [--concurrency 4] [--table-vectors 1000000 --nlist 1024 --nprobe 64]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.lookahead_retrieval import build_table, open_cold
from pcr_client.paths import cache_root
from pcr_client.rag.budget import BudgetModel, measure_read_bandwidth
from pcr_client.rag.embedder import embed_texts, load_embedder
from pcr_client.rag.fast_device import FAST_TIERS, make_fast_tier
from pcr_client.rag.ivf import IVFDatastore
from pcr_client.rag.lookahead import LookaheadRetriever
from pcr_client.rag.pipelines import KVHinter, PipelineConfig, Pipelines, run_batch
from pcr_tools.data import load_wiki_articles
from pcr_tools.launcher import ServerProcess

CONFIGS = {"none": (False, False), "clusters": (True, False), "hints": (False, True), "both": (True, True)}


def _server(model: str, store: Path, read_delay_ms: float, read_threads: int = 4) -> ServerProcess:
    server = ServerProcess(
        model,
        (
            "--enable-pcr",
            "--pcr-chunk-size",
            "16",
            "--pcr-dram-gb",
            "0.5",
            "--pcr-ssd-path",
            str(store),
            "--pcr-ssd-gb",
            "2",
            "--pcr-ssd-reserve-gb",
            "0",
            "--pcr-ssd-read-threads",
            str(read_threads),
            "--max-total-tokens",
            "16384",
            "--context-length",
            "4096",
            "--log-level",
            "warning",
        ),
    )
    if read_delay_ms > 0:
        server.env = {**server.env, "PCR_IO_TEST_FAULTS": json.dumps({"read_delay_s": read_delay_ms / 1000})}
    return server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hyde_pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument(
        "--concurrency", type=int, default=1, help="pipelines at once (>1: groups of similar questions, run_batch)"
    )
    parser.add_argument("--docs", type=int, default=1000, help="Wikipedia extracts in the datastore")
    parser.add_argument("--nprobe", type=int, default=8)
    parser.add_argument(
        "--table-vectors",
        type=int,
        default=0,
        help="search a synthetic table of this many jittered copies of the documents' embeddings, "
        "read cold from disk (0: the documents themselves)",
    )
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists of the synthetic table")
    parser.add_argument("--tier-mb", type=int, default=64, help="the look-ahead's fast tier (MB)")
    parser.add_argument(
        "--fast-tier",
        choices=FAST_TIERS,
        default="auto",
        help="where look-ahead clusters land: gpu, host, or auto (the GPU where torch sees one)",
    )
    parser.add_argument("--read-delay-ms", type=float, default=20.0, help="added to each SSD chunk read")
    parser.add_argument(
        "--read-threads",
        default="4",
        help="comma list of --pcr-ssd-read-threads values; every configuration runs at each",
    )
    parser.add_argument("--configs", default="none,clusters,hints,both")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every configuration, interleaved")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    try:
        thread_counts = [int(t) for t in args.read_threads.split(",") if t]
    except ValueError:
        thread_counts = []
    if not thread_counts or not all(1 <= t <= 64 for t in thread_counts):
        raise SystemExit(f"--read-threads must be a comma list of integers from 1 to 64, got {args.read_threads!r}")
    if args.repeats < 1 or args.concurrency < 1:
        raise SystemExit("--repeats and --concurrency must be >= 1")

    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    from pcr_tools.models.smollm2 import build_smollm2

    model = args.model_path or str(build_smollm2())
    articles = list(load_wiki_articles())[: args.docs]
    texts = [f"{a.title}. {a.text}" for a in articles]
    cold = args.table_vectors > 0
    if cold:  # the same table (and cache directory) as bench.lookahead_retrieval's
        directory = cache_root() / "bench" / f"ivf-{args.table_vectors}-{args.nlist}-{args.docs}-{args.seed}"
        if not (directory / "built.json").is_file():
            directory.mkdir(parents=True, exist_ok=True)
            build_table(directory, embed_texts(texts), args.table_vectors, args.nlist, 0.05, args.seed)
        texts = [texts[i % len(texts)] for i in range(args.table_vectors)]  # row i copies document i % docs
    else:
        directory = cache_root() / "bench" / f"hyde-ivf-{args.docs}-{args.seed}"
        if not (directory / "meta.json").is_file():
            IVFDatastore.build(embed_texts(texts), max(8, int(4 * len(texts) ** 0.5)), seed=args.seed).save(directory)

    def open_datastore() -> IVFDatastore:
        # Cold: no earlier mapping may hold its pages (the caller dropped its datastore).
        return open_cold(directory) if cold else IVFDatastore.load(directory, mmap=True)

    datastore = open_datastore()
    nlist = datastore.nlist
    embedder = load_embedder()
    import random

    rng = random.Random(args.seed)
    questions = [f"What is {a.title} known for?" for a in rng.sample(articles, args.questions)]
    bandwidth = measure_read_bandwidth(datastore.table.codes)
    del datastore

    def new_budget() -> BudgetModel:
        budget = BudgetModel(default_stage_s=1.0)
        budget.observe_bandwidth(bandwidth)
        return budget

    def pipelines_for(
        server: ServerProcess, clusters: bool, hints: bool, budget: BudgetModel
    ) -> tuple[Pipelines, LookaheadRetriever, KVHinter]:
        datastore = open_datastore()
        tier = make_fast_tier(datastore.table, args.tier_mb << 20, args.fast_tier) if clusters else None
        retriever = LookaheadRetriever(datastore, embedder.encode, nprobe=args.nprobe, k=3, tier=tier, budget=budget)
        hinter = KVHinter(server.base_url)
        config = PipelineConfig(k=3, hyde_tokens=48, answer_tokens=8, lookahead=clusters, hints=hints)
        return Pipelines(retriever, texts, RuntimeEndpoint(server.base_url), hinter, config), retriever, hinter

    rows: dict[tuple[str, int], tuple[list, dict, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pcr-hyde-bench-") as tmp:
        store = Path(tmp) / "store"
        print("[bench] fill pass: computing every final prompt once", file=sys.stderr)
        with _server(model, store, 0) as server:
            pipelines, retriever, hinter = pipelines_for(server, False, False, new_budget())
            for q in questions:
                pipelines.hyde(q)
            retriever.close()
            hinter.close()
            del pipelines, retriever, hinter  # a cold run's next datastore must be the only mapping
            deadline = time.monotonic() + 120
            while server.pcr_state()["ssd"]["writes_in_flight"] and time.monotonic() < deadline:
                time.sleep(0.5)
        runs = [
            (repeat, name, threads) for repeat in range(args.repeats) for threads in thread_counts for name in configs
        ]
        for repeat, name, threads in runs:
            clusters, hints = CONFIGS[name]
            print(
                f"[bench] repeat {repeat + 1}: {name}, {threads} read threads: restarting on the store", file=sys.stderr
            )
            with _server(model, store, args.read_delay_ms, threads) as server:
                budget = new_budget()  # one per configuration: it learns the stage's time
                # One retriever per configuration, or with --table-vectors one per pipeline
                # (or batch), each on a datastore opened cold.
                batches = [questions] if args.concurrency > 1 or not cold else [[q] for q in questions]
                results = []
                for batch in batches:
                    pipelines, retriever, hinter = pipelines_for(server, clusters, hints, budget)
                    if args.concurrency > 1:
                        results += run_batch(pipelines, "hyde", batch, group_size=args.concurrency)
                    else:
                        results += [pipelines.hyde(q) for q in batch]
                    retriever.close()
                    hinter.close()
                    del pipelines, retriever, hinter
                counters = server.pcr_state()["ssd"]["counters"]
            # Exact mode: each search's documents are faiss IVF's for the same query (checked
            # after the run, outside its timing).
            reference = LookaheadRetriever(
                IVFDatastore.load(directory, mmap=True), embedder.encode, nprobe=args.nprobe, k=3
            )  # faiss alone
            summed_identical = sum(_same_as_faiss(reference, r) for r in results)
            reference.close()
            del reference
            pooled, tiers, summed = rows.setdefault((name, threads), ([], {}, {}))
            summed["identical"] = summed.get("identical", 0) + summed_identical
            pooled += results
            for t in ("device", "host", "storage"):
                tiers[t] = tiers.get(t, 0) + sum(r.cached_details.get(t, 0) for r in results)
            for k in ("hint_in_time", "hint_late", "hint_issued"):
                summed[k] = summed.get(k, 0) + counters[k]

    med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    at_once = "one at a time" if args.concurrency == 1 else f"{args.concurrency} at a time"
    print(
        f"\nHyDE on SmolLM2-135M, {len(questions)} questions {at_once} x {args.repeats} repeats, "
        f"{len(texts)} "
        f"{'vectors (jittered copies of ' + str(args.docs) + ' documents, cold page cache)' if cold else 'documents'}"
        f" (IVF{nlist}, nprobe {args.nprobe}, memory-mapped), SSD reads +{args.read_delay_ms:g} ms each"
    )
    print(
        "| config | read threads | pipeline | generation | retrieval | search | search hidden | final request | "
        "cached host / storage (tokens) | cluster hits | same as faiss | hint chunks in time / late / issued |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    search_s = lambda r: sum(s.total_s for s in r.searches)  # noqa: E731
    for (name, threads), (results, tiers, c) in rows.items():
        search = med([search_s(r) for r in results])
        plain = rows.get(("none", threads))
        hidden = f"{1 - search / med([search_s(r) for r in plain[0]]):.0%}" if plain and name != "none" else "-"
        print(
            f"| {name} | {threads} | {med([r.total_s for r in results]):.0f} ms | "
            f"{med([r.generation_s for r in results]):.0f} ms | "
            f"{med([r.retrieval_s for r in results]):.1f} ms | {search:.1f} ms | {hidden} | "
            f"{med([r.answer_s for r in results]):.0f} ms | "
            f"{tiers['host']} / {tiers['storage']} | {statistics.mean(r.cluster_hit_rate for r in results):.0%} | "
            f"{c['identical']}/{len(results)} | {c['hint_in_time']} / {c['hint_late']} / {c['hint_issued']} |"
        )
    return 0


def _same_as_faiss(reference: LookaheadRetriever, result) -> bool:
    """Whether ``result``'s documents are what faiss IVF alone returns for its query."""
    found = reference.search(result.queries[-1])
    return {int(i) for i in found.ids[0] if i >= 0} == set(result.doc_ids)


if __name__ == "__main__":
    raise SystemExit(main())
