"""How often ``reorder`` applies to the ragbench trace, with no server: its first turns
replayed through reorder's own order store (``python -m bench.doc_reuse_accuracy
--reorder-applicability``)."""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence


def _pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def reorder_applicability(prompts: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, Any]:
    """How often ``reorder`` applies over ``prompts`` (``(input_ids, doc_bounds)``, in
    arrival order, one tenant), replayed through its own order store: the share of
    requests it serves in another order than sent, that follow a served sequence's run,
    whose documents all follow one; and the share of document tokens in those runs (an
    exact prefix hit while the prefix cache keeps them) beside the share a prefix cache
    hits with the documents as sent (the longest served sequence their order begins)."""
    from pcr_sglang.reuse.bounds import parse_doc_bounds
    from pcr_sglang.reuse.reorder import OrderStore, Tenant

    store = OrderStore()
    as_sent: set[tuple[tuple[int, ...], ...]] = set()
    doc_tokens = run_tokens = sent_tokens = all_docs = 0
    for ids, bounds in prompts:
        ids = list(ids)
        spans = parse_doc_bounds(list(bounds), len(ids))
        result = store.plan(ids, spans, Tenant())
        lengths = [span.length for span in spans]
        doc_tokens += sum(lengths)
        run_tokens += sum(lengths[i] for i in result.order[: result.matched])
        all_docs += result.matched == len(spans)
        docs = [tuple(ids[span.start : span.end]) for span in spans]
        prefix = 0  # as sent: the longest prefix of this order a request was served with before
        while prefix < len(docs) and (tuple(ids[: spans[0].start]), *docs[: prefix + 1]) in as_sent:
            prefix += 1
        sent_tokens += sum(lengths[:prefix])
        for k in range(1, len(docs) + 1):
            as_sent.add((tuple(ids[: spans[0].start]), *docs[:k]))
    n = max(1, len(prompts))
    stats = store.stats
    return {
        "requests": len(prompts),
        "reordered": stats.moved / n,
        "follow_a_served_run": stats.hits / n,
        "all_documents_follow": all_docs / n,
        "doc_tokens_exact_hit_reorder": run_tokens / doc_tokens if doc_tokens else None,
        "doc_tokens_exact_hit_as_sent": sent_tokens / doc_tokens if doc_tokens else None,
    }


def reorder_applicability_table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| trace | requests | reordered | follow a served run | all documents follow one "
        "| document tokens hit, reorder | document tokens hit, as sent |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['requests']} | {_pct(r['reordered'])} | {_pct(r['follow_a_served_run'])} "
            f"| {_pct(r['all_documents_follow'])} | {_pct(r['doc_tokens_exact_hit_reorder'])} "
            f"| {_pct(r['doc_tokens_exact_hit_as_sent'])} |"
        )
    return "\n".join(lines)


def run_reorder_applicability(args: argparse.Namespace, requests_n: int) -> int:
    """``--reorder-applicability``: the trace's first turns in both document orders, no server."""
    from transformers import AutoTokenizer

    from pcr_eval.ragbench.workload import WorkloadParams, make_trace
    from pcr_tools.models.smollm2 import build_smollm2

    tokenizer = AutoTokenizer.from_pretrained(args.model_path or str(build_smollm2()))
    rows = {}
    for order in ("retrieval", "shuffled"):
        trace = make_trace(
            WorkloadParams(
                num_requests=requests_n,
                max_doc_chars=args.max_doc_chars or None,
                seed=args.seed,
                max_new_tokens=args.max_new_tokens,
                doc_order=order,
            )
        )
        prompts = [trace.doc_prompt(r, tokenizer) for r in trace.first_turns()[:requests_n]]
        rows[f"ragbench, {order} order"] = reorder_applicability([(p.input_ids, p.doc_bounds) for p in prompts])
    print(reorder_applicability_table(rows))
    return 0
