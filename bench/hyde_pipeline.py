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
pipeline latency, passage generation, retrieval, the final request's latency (8 output
tokens), its cached tokens by tier, the cluster hit rate and the server's hint counters.
``--repeats`` runs of ``--questions`` pipelines each, the configurations interleaved
within each repeat (the machine's noise falls on all alike); medians over every pipeline
of every repeat, counters summed.

Usage: ``python -m bench.hyde_pipeline [--questions 8] [--docs 1000] [--read-delay-ms 20]
[--read-threads 1,4] [--repeats 2] [--concurrency 4]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pcr_sglang.data import load_wiki_articles
from pcr_sglang.launcher import ServerProcess
from pcr_sglang.models import cache_root
from pcr_sglang.rag.budget import BudgetModel, measure_read_bandwidth
from pcr_sglang.rag.embedder import embed_texts, load_embedder
from pcr_sglang.rag.device_tier import FAST_TIERS, make_fast_tier
from pcr_sglang.rag.ivf import IVFDatastore
from pcr_sglang.rag.lookahead import LookaheadRetriever
from pcr_sglang.rag.pipelines import KVHinter, PipelineConfig, Pipelines, run_batch

CONFIGS = {"none": (False, False), "clusters": (True, False), "hints": (False, True), "both": (True, True)}


def _server(model: str, store: Path, read_delay_ms: float, read_threads: int = 4) -> ServerProcess:
    server = ServerProcess(model, ("--enable-pcr", "--pcr-chunk-size", "16", "--pcr-dram-gb", "0.5",
                                   "--pcr-ssd-path", str(store), "--pcr-ssd-gb", "2", "--pcr-ssd-reserve-gb", "0",
                                   "--pcr-ssd-read-threads", str(read_threads),
                                   "--max-total-tokens", "16384", "--context-length", "4096",
                                   "--log-level", "warning"))
    if read_delay_ms > 0:
        server.env = {**server.env, "PCR_IO_TEST_FAULTS": json.dumps({"read_delay_s": read_delay_ms / 1000})}
    return server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hyde_pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="pipelines at once (>1: groups of similar questions, run_batch)")
    parser.add_argument("--docs", type=int, default=1000, help="Wikipedia extracts in the datastore")
    parser.add_argument("--nprobe", type=int, default=8)
    parser.add_argument("--fast-tier", choices=FAST_TIERS, default="auto",
                        help="where look-ahead clusters land: gpu, host, or auto (the GPU where torch sees one)")
    parser.add_argument("--read-delay-ms", type=float, default=20.0, help="added to each SSD chunk read")
    parser.add_argument("--read-threads", default="4",
                        help="comma list of --pcr-ssd-read-threads values; every configuration runs at each")
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

    from pcr_sglang.models.smollm2 import build_smollm2
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    model = args.model_path or str(build_smollm2())
    articles = list(load_wiki_articles())[: args.docs]
    texts = [f"{a.title}. {a.text}" for a in articles]
    directory = cache_root() / "bench" / f"hyde-ivf-{args.docs}-{args.seed}"
    if not (directory / "meta.json").is_file():
        IVFDatastore.build(embed_texts(texts), max(8, int(4 * len(texts) ** 0.5)), seed=args.seed).save(directory)
    datastore = IVFDatastore.load(directory, mmap=True)
    embedder = load_embedder()
    import random

    rng = random.Random(args.seed)
    questions = [f"What is {a.title} known for?" for a in rng.sample(articles, args.questions)]
    bandwidth = measure_read_bandwidth(datastore.table.codes)

    def pipelines_for(server: ServerProcess, clusters: bool, hints: bool) -> tuple[Pipelines, LookaheadRetriever,
                                                                                     KVHinter]:
        budget = BudgetModel(default_stage_s=1.0)
        budget.observe_bandwidth(bandwidth)
        tier = make_fast_tier(datastore.table, 64 << 20, args.fast_tier) if clusters else None
        retriever = LookaheadRetriever(datastore, embedder.encode, nprobe=args.nprobe, k=3, tier=tier, budget=budget)
        hinter = KVHinter(server.base_url)
        config = PipelineConfig(k=3, hyde_tokens=48, answer_tokens=8, lookahead=clusters, hints=hints)
        return Pipelines(retriever, texts, RuntimeEndpoint(server.base_url), hinter, config), retriever, hinter

    rows: dict[tuple[str, int], tuple[list, dict, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pcr-hyde-bench-") as tmp:
        store = Path(tmp) / "store"
        print("[bench] fill pass: computing every final prompt once", file=sys.stderr)
        with _server(model, store, 0) as server:
            pipelines, retriever, hinter = pipelines_for(server, False, False)
            for q in questions:
                pipelines.hyde(q)
            retriever.close()
            hinter.close()
            deadline = time.monotonic() + 120
            while server.pcr_state()["ssd"]["writes_in_flight"] and time.monotonic() < deadline:
                time.sleep(0.5)
        runs = [(repeat, name, threads) for repeat in range(args.repeats) for threads in thread_counts
                for name in configs]
        for repeat, name, threads in runs:
            clusters, hints = CONFIGS[name]
            print(f"[bench] repeat {repeat + 1}: {name}, {threads} read threads: restarting on the store",
                  file=sys.stderr)
            with _server(model, store, args.read_delay_ms, threads) as server:
                pipelines, retriever, hinter = pipelines_for(server, clusters, hints)
                if args.concurrency > 1:
                    results = run_batch(pipelines, "hyde", questions, group_size=args.concurrency)
                else:
                    results = [pipelines.hyde(q) for q in questions]
                retriever.close()
                hinter.close()
                counters = server.pcr_state()["ssd"]["counters"]
            pooled, tiers, summed = rows.setdefault((name, threads), ([], {}, {}))
            pooled += results
            for t in ("device", "host", "storage"):
                tiers[t] = tiers.get(t, 0) + sum(r.cached_details.get(t, 0) for r in results)
            for k in ("hint_in_time", "hint_late", "hint_issued"):
                summed[k] = summed.get(k, 0) + counters[k]

    med = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    at_once = "one at a time" if args.concurrency == 1 else f"{args.concurrency} at a time"
    print(f"\nHyDE on SmolLM2-135M, {len(questions)} questions {at_once} x {args.repeats} repeats, "
          f"{len(texts)} documents "
          f"(IVF{datastore.nlist}, nprobe {args.nprobe}, memory-mapped), SSD reads +{args.read_delay_ms:g} ms each")
    print("| config | read threads | pipeline | generation | retrieval | final request | "
          "cached host / storage (tokens) | cluster hits | hint chunks in time / late / issued |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (name, threads), (results, tiers, c) in rows.items():
        print(f"| {name} | {threads} | {med([r.total_s for r in results]):.0f} ms | {med([r.generation_s for r in results]):.0f} ms | "
              f"{med([r.retrieval_s for r in results]):.1f} ms | {med([r.answer_s for r in results]):.0f} ms | "
              f"{tiers['host']} / {tiers['storage']} | {statistics.mean(r.cluster_hit_rate for r in results):.0%} | "
              f"{c['hint_in_time']} / {c['hint_late']} / {c['hint_issued']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
