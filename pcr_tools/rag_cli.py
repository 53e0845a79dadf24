"""Build a retrieval datastore over the Wikipedia corpus, and run RAG pipelines against a server.

``python -m pcr_tools.rag_cli build --out DIR [--docs N] [--nlist N]``
    Embeds the offline Wikipedia extracts (all-MiniLM-L6-v2; about a second per 60
    documents on two cores, cached on disk) and saves an IVF datastore with the texts.

``python -m pcr_tools.rag_cli run --url URL --datastore DIR [--pipeline hyde|iter-retgen] ...``
    Runs the pipeline over questions about the corpus against a running server (started
    with ``--enable-pcr`` and an SSD tier for the KV hints to matter) and prints each
    answer, its documents, the cluster hit rate, retrieval and end-to-end latency, and a
    summary. ``--no-lookahead`` and ``--no-hints`` switch the two look-aheads off;
    ``--mark-documents`` marks the final prompts' documents for a server started with
    ``--pcr-doc-reuse`` (each document's KV reused wherever it appears, and hinted
    order-free).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from pcr_client.rag.fast_device import FAST_TIERS
from pcr_client.rag.pipelines import PIPELINES

logger = logging.getLogger(__name__)

TEXTS_FILE = "texts.jsonl"


def _texts(directory: Path) -> list[str]:
    path = directory / TEXTS_FILE
    if not path.is_file():
        raise SystemExit(f"{directory} has no {TEXTS_FILE}: build it with `python -m pcr_tools.rag_cli build`")
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def build(args: argparse.Namespace) -> int:
    from pcr_client.rag.embedder import embed_texts
    from pcr_client.rag.ivf import IVFDatastore
    from pcr_tools.data import load_wiki_articles

    articles = list(load_wiki_articles())[: args.docs] if args.docs else list(load_wiki_articles())
    texts = [f"{a.title}. {a.text}" for a in articles]
    nlist = args.nlist or max(1, min(len(texts) // 39, int(4 * len(texts) ** 0.5)))
    print(f"[rag] embedding {len(texts)} documents (cached after the first time)", file=sys.stderr)
    start = time.perf_counter()
    vectors = embed_texts(texts)
    print(f"[rag] embedded in {time.perf_counter() - start:.1f} s; training IVF with {nlist} clusters", file=sys.stderr)
    datastore = IVFDatastore.build(vectors, nlist, seed=args.seed)
    datastore.save(args.out)
    with open(args.out / TEXTS_FILE, "w", encoding="utf-8") as f:
        for article, text in zip(articles, texts):
            f.write(json.dumps({"title": article.title, "text": text}) + "\n")
    print(f"[rag] wrote {args.out}: {len(texts)} vectors, {nlist} clusters", file=sys.stderr)
    return 0


def _questions(texts: list[str], count: int, seed: int, path: Optional[Path]) -> list[str]:
    if path is not None:
        lines = [q.strip() for q in path.read_text(encoding="utf-8").splitlines() if q.strip()]
        return lines[:count]
    rng = random.Random(seed)
    titles = [t.split(". ", 1)[0] for t in rng.sample(texts, min(count, len(texts)))]
    return [f"What is {title} known for?" for title in titles]


def run(args: argparse.Namespace) -> int:
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    from pcr_client.rag.budget import BudgetModel, measure_read_bandwidth
    from pcr_client.rag.embedder import load_embedder
    from pcr_client.rag.fast_device import make_fast_tier
    from pcr_client.rag.ivf import IVFDatastore
    from pcr_client.rag.lookahead import LookaheadRetriever
    from pcr_client.rag.pipelines import KVHinter, PipelineConfig, Pipelines, run_batch

    datastore = IVFDatastore.load(args.datastore, mmap=True)
    texts = _texts(args.datastore)
    embedder = load_embedder()
    tier = make_fast_tier(datastore.table, args.tier_mb << 20, args.fast_tier) if not args.no_lookahead else None
    budget = BudgetModel(bandwidth_bytes_s=measure_read_bandwidth(datastore.table.codes))
    retriever = LookaheadRetriever(datastore, embedder.encode, nprobe=args.nprobe, k=args.k, tier=tier, budget=budget)
    if args.mark_documents:
        from pcr_client.frontend import DocReuseEndpoint

        backend = DocReuseEndpoint(args.url)
    else:
        backend = RuntimeEndpoint(args.url)
    hinter = None if args.no_hints else KVHinter(args.url, tokenizer=getattr(backend, "tokenizer", None))
    config = PipelineConfig(
        k=args.k, lookahead=not args.no_lookahead, hints=not args.no_hints, mark_documents=args.mark_documents
    )
    pipelines = Pipelines(retriever, texts, backend, hinter, config)
    questions = _questions(texts, args.questions, args.seed, args.questions_file)
    try:
        if args.concurrency > 1:
            results = run_batch(pipelines, args.pipeline, questions, group_size=args.concurrency)
        else:
            results = [pipelines.run(args.pipeline, q) for q in questions]
    finally:
        retriever.close()
        if hinter is not None:
            hinter.close()
    for n, r in enumerate(results, 1):
        print(
            f"[{n:2d}] {r.question}\n     answer: {r.answer!r}\n     documents {r.doc_ids}, cluster hits "
            f"{r.cluster_hit_rate:.0%}, generation {r.generation_s * 1000:.0f} ms, retrieval "
            f"{r.retrieval_s * 1000:.1f} ms, answer {r.answer_s * 1000:.0f} ms (cached {r.cached_tokens}, "
            f"{r.cached_details}), total {r.total_s * 1000:.0f} ms"
        )
    if results:
        print(
            f"\n{len(results)} {args.pipeline} pipelines: "
            f"mean total {statistics.mean(r.total_s for r in results):.2f} s, "
            f"mean retrieval {statistics.mean(r.retrieval_s for r in results) * 1000:.1f} ms, mean cluster hit rate "
            f"{statistics.mean(r.cluster_hit_rate for r in results):.0%}"
            + (f", hints sent {hinter.stats.sent} (registered {hinter.stats.registered})" if hinter else "")
        )
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pcr_tools.rag_cli",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build an IVF datastore over the offline Wikipedia extracts")
    b.add_argument("--out", type=Path, required=True, help="the datastore directory (created)")
    b.add_argument("--docs", type=int, default=0, help="the first N articles only (default: all 10,033)")
    b.add_argument("--nlist", type=int, default=0, help="IVF clusters (default: about 4 sqrt(N), >= 39 points each)")
    b.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="run a RAG pipeline over the corpus against a running server")
    r.add_argument("--url", required=True, help="the SGLang server, e.g. http://127.0.0.1:30000")
    r.add_argument("--datastore", type=Path, required=True, help="built by `build` (memory-mapped)")
    r.add_argument("--pipeline", choices=PIPELINES, default="hyde")
    r.add_argument("--questions", type=int, default=8, help="how many questions")
    r.add_argument(
        "--questions-file", type=Path, default=None, help="one question per line (default: about corpus titles)"
    )
    r.add_argument("--k", type=int, default=3, help="documents per final prompt")
    r.add_argument("--nprobe", type=int, default=8, help="IVF clusters each search probes")
    r.add_argument("--tier-mb", type=int, default=64, help="the fast tier's size (MB)")
    r.add_argument(
        "--fast-tier",
        choices=FAST_TIERS,
        default="auto",
        help="where look-ahead clusters land: gpu (GPU memory, a copy stream, an event per cluster), "
        "host (a host buffer), auto (the GPU where torch sees one; default)",
    )
    r.add_argument("--concurrency", type=int, default=1, help=">1: groups of similar questions run at once")
    r.add_argument("--no-lookahead", action="store_true", help="no cluster prefetch (faiss searches everything)")
    r.add_argument("--no-hints", action="store_true", help="no KV hints for the predicted final prompt")
    r.add_argument(
        "--mark-documents",
        action="store_true",
        help="mark the final prompts' documents, for a server with --pcr-doc-reuse",
    )
    r.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    return build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
