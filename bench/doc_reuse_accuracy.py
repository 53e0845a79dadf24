"""Answer accuracy of document KV reuse: gold answers and fidelity to full prefill.

    python -m bench.doc_reuse_accuracy                # questions about re-placed documents, base and tuned
    python -m bench.doc_reuse_accuracy --quick        # 12 questions
    python -m bench.doc_reuse_accuracy --models base --modes concat,blend,blend:0.15:16,lego:16
    python -m bench.doc_reuse_accuracy --workload trace --requests 80   # the ragbench trace (below)
    python -m bench.doc_reuse_accuracy --reorder-applicability      # how often reorder applies (no server)

Two workloads. ``questions`` (the default, ``bench/reuse_questions.py``): test-split
questions about documents that are never first in their prompt, scored against gold
answers and against full prefill, per model (the base SmolLM2 and the document-reuse tuned
one), with bootstrap intervals and the noise floor; its docstring says what is measured.

``trace``: the first turns of ``bench.ragbench``'s retrieval trace, scored against full
prefill only (in every one of its prompts the asked-about document is the first, whose KV
is exact in every mode, so it does not test re-placed documents). Its prompts are
Wikipedia extracts chosen by the embedding retriever, Zipf-popular topics, as
document-marked token prompts (``Trace.doc_prompt``), served by SmolLM2-135M-Instruct:

1. **full prefill** (``--disable-radix-cache``): the reference. Each prompt's greedy answer
   (temperature 0), and the teacher-forced NLL of that answer under full prefill.
2. each ``--modes`` entry (``concat``, ``lego[:K]``, ``blend[:R]``, ``reorder``), all on one server
   (``--enable-pcr --pcr-doc-reuse blend``, or ``concat`` when no entry recomputes, with
   ``--pcr-doc-warmup request --pcr-doc-warmup-after 1``; each
   request asks for its mode, K or R in ``custom_params``): every prompt is sent
   with its documents marked, twice: the first send (one output token; the server warms
   documents at their first sighting) makes sure every document's canonical KV is
   cached, the second is measured (its greedy answer, and ``cached_tokens``: all
   documents were reused when it equals the last document's end). Each mode's requests
   carry their own ``extra_key``, so no mode reads what another one cached.
   Then the reference answer is teacher-forced under the mode's KV (prompt + answer ids,
   ``return_logprob``, ``logprob_start_len = len(prompt) - 1``; SGLang reuses at most
   ``logprob_start_len`` tokens, which is past the documents, so they are still reused).
   ``reorder`` (exact) is not warmed: the trace's earlier requests in its namespace are
   the orders it follows, so each request is served in the order of a sequence served
   before where one fits (``reordered``: how often it moved the documents), else as given.
3. **exact prefix cache** (the control), on the same server after the marked
   requests: the same prompts without marks, sent twice, then teacher-forced. Prefix
   caching is exact: its answers must equal full prefill's (100%).

Metrics per mode against full prefill: the share of greedy answers with identical token
ids, the mean SQuAD-style token F1 of the decoded answers (:func:`token_f1`), the mean
per-token NLL of full prefill's answer and its ratio to full prefill's own, and the
first-token agreement. Prints a markdown table and writes everything, per-request rows
included, to ``--out/<timestamp>.json``.

``--reorder-applicability`` runs no server: it replays the trace's first turns (both of
its document orders, ``retrieval`` and ``shuffled``) through reorder's own order store
(:class:`pcr_sglang.reuse.reorder.OrderStore`) and prints how often reorder moves a
request's documents and the share of document tokens that are then an exact prefix hit,
beside the share a prefix cache hits with the documents as sent.

Why ``len(prompt) - 1``: SGLang's ``input_token_logprobs`` has one entry per token from
``logprob_start_len`` on, each the log-probability of that token given the ones before;
the first entry is None (the position before it is not computed). Starting one token
before the answer, the None falls on the last prompt token and every answer token gets
its log-probability (starting at ``len(prompt)`` would lose the first answer token's).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import platform
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from pcr_tools.tune.measure import MODES, ModeSpec, parse_mode, parse_modes  # noqa: F401 - re-exported
from pcr_tools.tune.scores import normalize_answer, token_f1  # noqa: F401 - re-exported

logger = logging.getLogger("bench.doc_reuse_accuracy")

DEFAULT_REQUESTS = 40
QUICK_REQUESTS = 12
DEFAULT_QUESTIONS = 36
QUICK_QUESTIONS = 12
FULL = "full prefill"
EXACT = "exact prefix cache"
# What the modes are measured against (reported, never assumed met).
TARGETS = {
    "blend": {"recompute_ratio": 0.15, "mean_f1_min": 0.90, "nll_ratio_max": 1.05,
              "text": "blend with R=15% recompute: mean F1 >= 0.90 and NLL within 5% of full prefill"},
}
COMMON_SERVER_ARGS = ("--context-length", "4096", "--log-level", "warning", "--sleep-on-idle")


# ---------------------------------------------------------------------------- metrics
def answer_nll(input_token_logprobs: Sequence[Sequence[Any]], answer_ids: Sequence[int]) -> float:
    """Mean negative log-likelihood per token of ``answer_ids``, from the
    ``meta_info.input_token_logprobs`` of a request of ``prompt + answer_ids`` sent with
    ``logprob_start_len = len(prompt) - 1``: one entry ``[logprob, token_id, text]`` for
    the last prompt token (logprob None) and one per answer token."""
    if not answer_ids:
        raise ValueError("an empty answer has no NLL")
    entries = list(input_token_logprobs)
    if len(entries) != len(answer_ids) + 1:
        raise ValueError(f"expected {len(answer_ids) + 1} input logprobs (the last prompt token and "
                         f"{len(answer_ids)} answer tokens), got {len(entries)}")
    tail = entries[1:]
    ids = [int(e[1]) for e in tail]
    if ids != list(answer_ids):
        raise ValueError(f"input logprobs are for tokens {ids[:8]}..., not the answer {list(answer_ids)[:8]}...")
    values = [e[0] for e in tail]
    if any(v is None for v in values):
        raise ValueError("an answer token has no logprob")
    return -sum(float(v) for v in values) / len(values)


def server_mode(specs: Sequence[ModeSpec]) -> str:
    """The ``--pcr-doc-reuse`` that serves every spec (a recompute server serves concat
    too; any server serves reorder, chosen in its tokenizer process)."""
    from pcr_sglang.reuse.bounds import RECOMPUTE_MODES

    return "blend" if any(s.mode in RECOMPUTE_MODES for s in specs) else "concat"


def doc_reuse_server_flags(reuse: str, chunk_size: int) -> tuple[str, ...]:
    """The doc-reuse server: documents warmed at their first sighting, so each prompt's
    warm-up send computes its documents' canonical KV and reuses it (with the default,
    warm when a document recurs, the warm-up would be a plain prefill, cached exactly, and
    the measured send would hit that exact prefix)."""
    return ("--enable-pcr", "--pcr-chunk-size", str(chunk_size), "--pcr-doc-reuse", reuse,
            "--pcr-doc-warmup", "request", "--pcr-doc-warmup-after", "1")


# ---------------------------------------------------------------------------- rows
@dataclass
class Prompt:
    index: int
    rid: str
    question: str
    doc_ids: list[str]
    input_ids: list[int]
    doc_bounds: list[int]

    @property
    def last_doc_end(self) -> int:
        return self.doc_bounds[-1]


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens}


def _sampling(prompt: Prompt, spec: Optional[ModeSpec], **sampling: Any) -> dict[str, Any]:
    """Sampling parameters; with ``spec``, the documents marked and the mode asked for."""
    from pcr_client.prompt import DocPrompt

    if spec is None:
        return sampling
    params = DocPrompt(prompt.input_ids, prompt.doc_bounds).sampling_params(**sampling)
    params["custom_params"].update(spec.custom_params())
    return params


def mode_request(prompt: Prompt, spec: Optional[ModeSpec], input_ids: Optional[list[int]] = None,
                 **sampling: Any) -> dict[str, Any]:
    """A ``/generate`` body for ``prompt`` in mode ``spec``. Each mode has its own cache
    namespace (``extra_key``): a prompt one mode served by plain prefill (nothing left to
    reuse) is cached exactly, and would otherwise answer the next mode's requests from
    that exact prefix instead of from re-placed documents."""
    body: dict[str, Any] = {"input_ids": prompt.input_ids if input_ids is None else input_ids,
                            "sampling_params": _sampling(prompt, spec, **sampling)}
    if spec is not None:
        body["extra_key"] = f"pcr-accuracy:{spec.name}"
    return body


def teacher_forced(server: Any, prompt: Prompt, answer: list[int], spec: Optional[ModeSpec]) -> tuple[float, int]:
    """NLL per token of ``answer`` after ``prompt`` on ``server``, and the request's cached tokens."""
    reply = server.generate({**mode_request(prompt, spec, prompt.input_ids + answer, **greedy(0)),
                             "return_logprob": True, "logprob_start_len": len(prompt.input_ids) - 1})
    meta = reply["meta_info"]
    return answer_nll(meta["input_token_logprobs"], answer), int(meta.get("cached_tokens", 0))


def measure_reference(server: Any, prompt: Prompt, max_new_tokens: int) -> dict[str, Any]:
    reply = server.generate({"input_ids": prompt.input_ids, "sampling_params": greedy(max_new_tokens)})
    answer = list(reply["output_ids"])
    nll, _ = teacher_forced(server, prompt, answer, None)
    return {"answer_ids": answer, "answer": reply.get("text", ""),
            "finish": (reply["meta_info"].get("finish_reason") or {}).get("type"), "nll": nll}


def _docs_reused(prompt: Prompt, spec: Optional[ModeSpec], cached: int, chunk_size: int) -> Optional[bool]:
    """Marked: reuse ends at the last document (past it, blended KV is never cached);
    recomputed tokens are not cached tokens, so they count as reused here; ``reorder``'s
    exact hit is whole chunks, and reaches the last one before the documents' end.
    Unmarked (the control): prefix caching, documents are not reused as such (None)."""
    if spec is None:
        return None
    if spec.mode == "reorder":
        return cached >= prompt.last_doc_end - prompt.last_doc_end % max(1, chunk_size)
    return cached + spec.recomputed_if_all_reused(prompt.doc_bounds) == prompt.last_doc_end


def measure_mode(server: Any, prompt: Prompt, reference: dict[str, Any], max_new_tokens: int,
                 spec: Optional[ModeSpec], decode: Callable[[list[int]], str], chunk_size: int = 1) -> dict[str, Any]:
    """Warm, measured greedy answer, teacher-forced NLL of the reference answer (``spec``
    None: the documents unmarked, the exact prefix cache's control). ``reorder`` is not
    warmed: it follows the orders of the trace's earlier requests."""
    from pcr_tools.tune.measure import served_order

    warm = None if spec is not None and spec.mode == "reorder" else \
        server.generate(mode_request(prompt, spec, **greedy(1)))
    reply = server.generate(mode_request(prompt, spec, **greedy(max_new_tokens)))
    answer = list(reply["output_ids"])
    cached = int(reply["meta_info"].get("cached_tokens", 0))
    nll, tf_cached = teacher_forced(server, prompt, reference["answer_ids"], spec)
    recomputed = spec.recomputed_if_all_reused(prompt.doc_bounds) if spec is not None else 0
    ref_ids = reference["answer_ids"]
    order = served_order(reply["meta_info"])
    return {
        "warm_cached_tokens": None if warm is None else int(warm["meta_info"].get("cached_tokens", 0)),
        "cached_tokens": cached,
        "all_docs_reused": _docs_reused(prompt, spec, cached, chunk_size),
        "recomputed_tokens": recomputed,
        "tf_cached_tokens": tf_cached,
        "tf_all_docs_reused": _docs_reused(prompt, spec, tf_cached, chunk_size),
        "served_order": order,
        "reordered": None if order is None else order != sorted(order),
        "answer_ids": answer,
        "answer": reply.get("text", decode(answer)),
        "identical": answer == ref_ids,
        "first_token_agrees": bool(answer) and bool(ref_ids) and answer[0] == ref_ids[0],
        "f1": token_f1(decode(answer), decode(ref_ids)),
        "nll": nll,
    }


def run_all(prompts: list[Prompt], work: Callable[[Prompt], dict[str, Any]], concurrency: int,
            label: str) -> list[dict[str, Any]]:
    """``work`` on every prompt, ``concurrency`` at a time; a failure is recorded as the
    row's ``error``. Progress goes to stderr."""
    done, lock, started = [0], threading.Lock(), time.monotonic()

    def one(prompt: Prompt) -> dict[str, Any]:
        try:
            row = work(prompt)
        except Exception as e:  # noqa: BLE001 - one bad request must not lose the run
            logger.error("[%s] request %s failed: %s", label, prompt.rid, e)
            row = {"error": f"{type(e).__name__}: {e}"}
        with lock:
            done[0] += 1
            print(f"[{label}] {done[0]}/{len(prompts)} done ({time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
        return row

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, prompts))


# ---------------------------------------------------------------------------- summary
def _mean(values: Sequence[float]) -> Optional[float]:
    return statistics.fmean(values) if values else None


def summarize(rows: Sequence[dict[str, Any]], reference_nll: Optional[float],
              docs_reused: bool = True) -> dict[str, Any]:
    """A mode's metrics over its rows without errors (``rows``: the measure_mode dicts)."""
    ok = [r for r in rows if "error" not in r]
    nll = _mean([r["nll"] for r in ok])
    return {
        "requests": len(ok),
        "errors": len(rows) - len(ok),
        "all_docs_reused": (sum(r["all_docs_reused"] for r in ok) / len(ok) if ok else None) if docs_reused else None,
        # The teacher-forced requests too (their logprob_start_len caps reuse, past the documents).
        "tf_all_docs_reused": (sum(bool(r.get("tf_all_docs_reused")) for r in ok) / len(ok) if ok else None)
        if docs_reused else None,
        "identical_answers": sum(r["identical"] for r in ok) / len(ok) if ok else None,
        "mean_f1": _mean([r["f1"] for r in ok]),
        "nll": nll,
        "nll_ratio": nll / reference_nll if nll is not None and reference_nll else None,
        "first_token_agreement": sum(r["first_token_agrees"] for r in ok) / len(ok) if ok else None,
        # reorder: the share served in another order than sent (None for the other modes).
        "reordered": _share([r.get("reordered") for r in ok]),
    }


def _share(flags: Sequence[Optional[bool]]) -> Optional[float]:
    known = [bool(f) for f in flags if f is not None]
    return sum(known) / len(known) if known else None


def _pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _num(value: Optional[float], digits: int = 3) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def markdown_table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = ["| mode | requests | all docs reused | reordered | identical answers | mean F1 | NLL | NLL / full "
             "| first-token agreement |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, s in summaries.items():
        lines.append(f"| {mode} | {s['requests']} | {_pct(s['all_docs_reused'])} | {_pct(s.get('reordered'))} "
                     f"| {_pct(s['identical_answers'])} "
                     f"| {_num(s['mean_f1'])} | {_num(s['nll'])} | {_num(s['nll_ratio'], 2)} "
                     f"| {_pct(s['first_token_agreement'])} |")
    return "\n".join(lines)


def target_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """Each target, and where every measured reuse mode stands against it."""
    lines = []
    for name, target in TARGETS.items():
        ran = any(m.split(":")[0] == name for m in summaries)
        lines.append(f"target ({target['text']}): " + ("measured below" if ran else
                                                      f"no {name} configuration was run (--modes)"))
        for mode, s in summaries.items():
            if mode in (FULL, EXACT) or s["mean_f1"] is None or s["nll_ratio"] is None:
                continue
            f1_ok = s["mean_f1"] >= target["mean_f1_min"]
            nll_ok = s["nll_ratio"] <= target["nll_ratio_max"]
            lines.append(f"  {mode}: mean F1 {s['mean_f1']:.3f} ({'meets' if f1_ok else 'below'} "
                         f">= {target['mean_f1_min']:.2f}), NLL / full {s['nll_ratio']:.2f} "
                         f"({'within' if nll_ok else 'outside'} {target['nll_ratio_max'] - 1:.0%})")
    return lines


# ---------------------------------------------------------------------------- reorder, offline
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
        run_tokens += sum(lengths[i] for i in result.order[:result.matched])
        all_docs += result.matched == len(spans)
        docs = [tuple(ids[span.start:span.end]) for span in spans]
        prefix = 0  # as sent: the longest prefix of this order a request was served with before
        while prefix < len(docs) and (tuple(ids[:spans[0].start]), *docs[:prefix + 1]) in as_sent:
            prefix += 1
        sent_tokens += sum(lengths[:prefix])
        for k in range(1, len(docs) + 1):
            as_sent.add((tuple(ids[:spans[0].start]), *docs[:k]))
    n = max(1, len(prompts))
    stats = store.stats
    return {"requests": len(prompts), "reordered": stats.moved / n, "follow_a_served_run": stats.hits / n,
            "all_documents_follow": all_docs / n,
            "doc_tokens_exact_hit_reorder": run_tokens / doc_tokens if doc_tokens else None,
            "doc_tokens_exact_hit_as_sent": sent_tokens / doc_tokens if doc_tokens else None}


def reorder_applicability_table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| trace | requests | reordered | follow a served run | all documents follow one "
             "| document tokens hit, reorder | document tokens hit, as sent |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['requests']} | {_pct(r['reordered'])} | {_pct(r['follow_a_served_run'])} "
                     f"| {_pct(r['all_documents_follow'])} | {_pct(r['doc_tokens_exact_hit_reorder'])} "
                     f"| {_pct(r['doc_tokens_exact_hit_as_sent'])} |")
    return "\n".join(lines)


def run_reorder_applicability(args: argparse.Namespace, requests_n: int) -> int:
    """``--reorder-applicability``: the trace's first turns in both document orders, no server."""
    from transformers import AutoTokenizer

    from bench.ragbench.workload import WorkloadParams, make_trace
    from pcr_tools.models.smollm2 import build_smollm2

    tokenizer = AutoTokenizer.from_pretrained(args.model_path or str(build_smollm2()))
    rows = {}
    for order in ("retrieval", "shuffled"):
        trace = make_trace(WorkloadParams(num_requests=requests_n, max_doc_chars=args.max_doc_chars or None,
                                          seed=args.seed, max_new_tokens=args.max_new_tokens, doc_order=order))
        prompts = [trace.doc_prompt(r, tokenizer) for r in trace.first_turns()[:requests_n]]
        rows[f"ragbench, {order} order"] = reorder_applicability([(p.input_ids, p.doc_bounds) for p in prompts])
    print(reorder_applicability_table(rows))
    return 0


# ---------------------------------------------------------------------------- main
def _counters(server: Any) -> dict[str, Any]:
    try:
        return dict(server.pcr_state()["doc_reuse"]["counters"])
    except Exception as e:  # noqa: BLE001 - informative only
        logger.warning("could not read the doc-reuse counters: %s", e)
        return {}


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.doc_reuse_accuracy", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--modes", type=parse_modes, default=parse_modes("concat,lego,blend"),
                        help="comma-separated configurations to measure: concat, lego[:K], blend[:R[:A][:S]] "
                             "(A: anchor tokens, S: deviation, gradual, query or prophet), reorder (exact) "
                             "(default: concat,lego,blend at the server's K and R)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"first turns of the trace (default {DEFAULT_REQUESTS}; --quick: {QUICK_REQUESTS})")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="greedy answer length, at most")
    parser.add_argument("--max-doc-chars", type=int, default=600, help="cut Wikipedia extracts to this many characters")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed")
    parser.add_argument("--chunk-size", type=int, default=16, help="--pcr-chunk-size")
    parser.add_argument("--max-total-tokens", type=int, default=60000,
                        help="device KV pool of every server (large enough that nothing is evicted)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="prompts in flight at once; 1 (default) keeps every request alone in its batch, "
                             "so batch composition cannot move an answer")
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct (built offline)")
    parser.add_argument("--out", type=Path,
                        default=Path(f"bench/results/{datetime.date.today().isoformat()}/doc_reuse_accuracy"),
                        help="where the JSON result, the markdown report and the server logs go "
                             "(default: bench/results/<today>/doc_reuse_accuracy)")
    parser.add_argument("--workload", choices=("questions", "trace"), default="questions",
                        help="questions (default): test-split questions about re-placed documents, gold-scored "
                             "(bench/reuse_questions.py); trace: the first turns of the ragbench trace, "
                             "scored against full prefill only (the asked-about document is always first there)")
    parser.add_argument("--models", default="base,tuned",
                        help="questions workload: comma-separated base (SmolLM2-135M-Instruct) and tuned (the same "
                             "with the committed document-reuse adapter merged); ignored with --model-path")
    parser.add_argument("--questions", type=int, default=None,
                        help=f"questions workload: questions per seed, the kinds in turn (default {DEFAULT_QUESTIONS}; "
                             f"--quick: {QUICK_QUESTIONS})")
    parser.add_argument("--seeds", default="0", help="questions workload: comma-separated seeds (repeats)")
    parser.add_argument("--top-k", type=int, default=10,
                        help="questions workload: full prefill's top-k tokens per position for the KL (default 10)")
    parser.add_argument("--reorder-applicability", action="store_true",
                        help="start no server: replay the ragbench trace's first turns (--requests, in its "
                             "retrieval and shuffled document orders) through reorder's order store and print "
                             "how often reorder applies")
    args = parser.parse_args(argv)
    requests_n = args.requests if args.requests is not None else (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    if requests_n < 1 or args.max_new_tokens < 1 or args.concurrency < 1:
        parser.error("--requests, --max-new-tokens and --concurrency must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.reorder_applicability:
        return run_reorder_applicability(args, requests_n)
    if args.workload == "questions":
        from bench.reuse_questions import run_questions

        return run_questions(args, argv)

    from transformers import AutoTokenizer

    from bench.ragbench.workload import WorkloadParams, make_trace
    from pcr_tools.launcher import ServerProcess
    from pcr_tools.models.smollm2 import build_smollm2

    started = time.monotonic()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    model_path = args.model_path or str(build_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", file=sys.stderr, flush=True)

    progress(f"building the retrieval trace ({requests_n} requests)...")
    trace = make_trace(WorkloadParams(num_requests=requests_n, max_doc_chars=args.max_doc_chars or None,
                                      seed=args.seed, max_new_tokens=args.max_new_tokens))
    prompts = []
    for i, request in enumerate(trace.first_turns()[:requests_n]):
        doc_prompt = trace.doc_prompt(request, tokenizer)
        prompts.append(Prompt(i, request.rid, request.question, list(request.doc_ids),
                              list(doc_prompt.input_ids), list(doc_prompt.doc_bounds)))
    longest = max(len(p.input_ids) for p in prompts)
    progress(f"{len(prompts)} prompts, {sum(len(p.input_ids) for p in prompts)} tokens, longest {longest}")
    pool = ("--max-total-tokens", str(args.max_total_tokens))
    servers: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def serving(name: str, extra: tuple[str, ...]) -> Iterator[Any]:
        log = args.out / f"{stamp}-{name.replace(' ', '-')}.log"
        progress(f"starting the {name} server (log: {log})...")
        server = ServerProcess(model_path, (*extra, *pool, *COMMON_SERVER_ARGS), log_path=log)
        server.start()
        servers[name] = {"args": server.public_args, "startup_s": round(server.startup_seconds, 1),
                         "log": str(log)}
        progress(f"the {name} server is up ({server.startup_seconds:.0f} s)")
        try:
            yield server
        finally:
            # Killed, not stopped: nothing of it is needed afterwards, and a graceful stop
            # costs seconds; the launcher removes what a killed PCR scheduler leaves.
            server.kill()

    phase_s: dict[str, float] = {}

    def timed_phase(label: str, items: list[Prompt], work: Callable[[Prompt], dict[str, Any]]) -> list[dict[str, Any]]:
        start = time.monotonic()
        out = run_all(items, work, args.concurrency, label)
        phase_s[label] = time.monotonic() - start
        return out

    # 1. The reference: full prefill.
    with serving(FULL, ("--disable-radix-cache",)) as server:
        references = timed_phase(FULL, prompts, lambda p: measure_reference(server, p, args.max_new_tokens))
    usable = [i for i, r in enumerate(references) if "error" not in r]
    measured = [prompts[i] for i in usable]
    reference_nll = _mean([references[i]["nll"] for i in usable])

    # 2./3. Every spec on one server (each request asks for its own); then the exactness control.
    results: dict[str, list[dict[str, Any]]] = {}
    counters: dict[str, dict[str, Any]] = {}
    reuse = server_mode(args.modes)
    flags = doc_reuse_server_flags(reuse, args.chunk_size)
    with serving(f"doc-reuse {reuse}", flags) as server:
        for spec in args.modes:
            before = _counters(server)
            results[spec.name] = timed_phase(spec.name, measured, lambda p: measure_mode(
                server, p, references[p.index], args.max_new_tokens, spec, decode, args.chunk_size))
            after = _counters(server)
            counters[spec.name] = {"total": after, "this_phase": _delta(after, before)}
        results[EXACT] = timed_phase(EXACT, measured, lambda p: measure_mode(
            server, p, references[p.index], args.max_new_tokens, None, decode))
        counters[EXACT] = {"this_phase": _delta(_counters(server), after)}

    ref_ok = [references[i] for i in usable]
    summaries = {FULL: {"requests": len(ref_ok), "errors": len(references) - len(ref_ok), "all_docs_reused": None,
                        "tf_all_docs_reused": None,
                        "identical_answers": 1.0, "mean_f1": 1.0, "nll": reference_nll, "nll_ratio": 1.0,
                        "first_token_agreement": 1.0},
                 EXACT: summarize(results[EXACT], reference_nll, docs_reused=False)}
    for spec in args.modes:
        summaries[spec.name] = summarize(results[spec.name], reference_nll)

    rows = []
    for k, i in enumerate(usable):
        p, ref = prompts[i], references[i]
        rows.append({"rid": p.rid, "question": p.question, "doc_ids": p.doc_ids, "prompt_tokens": len(p.input_ids),
                     "doc_bounds": p.doc_bounds, "last_doc_end": p.last_doc_end,
                     "reference": {**ref, "answer": decode(ref["answer_ids"])},
                     "modes": {mode: results[mode][k] for mode in results}})
    for i in range(len(prompts)):
        if i not in usable:
            rows.append({"rid": prompts[i].rid, "error": references[i]["error"]})
    not_reused = [{"rid": r["rid"], "mode": m, "cached_tokens": r["modes"][m]["cached_tokens"],
                   "last_doc_end": r["last_doc_end"]}
                  for r in rows if "modes" in r for m in (spec.name for spec in args.modes)
                  if "error" not in r["modes"][m] and not r["modes"][m]["all_docs_reused"]]
    elapsed = time.monotonic() - started
    result = {
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "command": "python -m bench.doc_reuse_accuracy " + shlex.join(argv),
                 "model": Path(model_path).name,
                 "machine": f"{platform.machine()}, {machine()}",
                 "requests": len(prompts), "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                 "max_doc_chars": args.max_doc_chars, "chunk_size": args.chunk_size,
                 "concurrency": args.concurrency, "modes": [spec.name for spec in args.modes],
                 "trace_stats": trace.stats, "servers": servers, "phase_s": phase_s, "elapsed_s": elapsed,
                 "nll_method": "teacher-forced: prompt + full prefill's answer ids, return_logprob, "
                               "logprob_start_len = len(prompt) - 1; mean -logprob over the answer tokens",
                 "f1_method": "SQuAD token F1 of the decoded answers (lowercase, punctuation and articles removed)"},
        "summary": summaries,
        "targets": TARGETS,
        "doc_reuse_counters": counters,
        "not_all_docs_reused": not_reused,
        "rows": rows,
    }
    path = args.out / f"{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(markdown_table(summaries))
    print()
    for line in target_lines(summaries):
        print(line)
    if not_reused:
        print(f"{len(not_reused)} measured requests did not reuse all their documents: "
              + ", ".join(f"{r['rid']} ({r['mode']}: cached {r['cached_tokens']}, documents end at "
                          f"{r['last_doc_end']})" for r in not_reused[:10]))
    control = summaries[EXACT]
    if control["identical_answers"] != 1.0:
        print(f"EXACTNESS CONTROL FAILED: prefix-cached answers equal full prefill's for only "
              f"{_pct(control['identical_answers'])} of requests")
    print(f"wrote {path} ({elapsed:.0f} s)")
    failed = any(s["errors"] for s in summaries.values()) or control["identical_answers"] != 1.0
    return 1 if failed else 0


def machine() -> str:
    """The run's machine as the reports name it: its usable CPU cores, and no GPU where
    there is none."""
    from pcr_tools.launcher import cpu_only

    return f"{len(_affinity())} CPU cores" + (", no GPU" if cpu_only() else "")


def _affinity() -> set[int]:
    import os

    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


if __name__ == "__main__":
    sys.exit(main())
