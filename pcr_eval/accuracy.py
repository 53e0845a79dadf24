"""Answer accuracy of document KV reuse: gold answers and fidelity to full prefill.

    python -m bench.doc_reuse_accuracy                # questions about re-placed documents, base and tuned
    python -m bench.doc_reuse_accuracy --quick        # 12 questions
    python -m bench.doc_reuse_accuracy --models base --modes concat,blend,blend:0.15:16,lego:16
    python -m bench.doc_reuse_accuracy --workload trace --requests 80   # the ragbench trace (below)
    python -m bench.doc_reuse_accuracy --reorder-applicability      # how often reorder applies (no server)

Two workloads. ``questions`` (the default, ``pcr_eval/questions_workload.py``): test-split
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
import datetime
import logging
import sys
from pathlib import Path
from typing import Optional

from pcr_eval.modes import parse_modes
from pcr_eval.questions_workload import DEFAULT_QUESTIONS, QUICK_QUESTIONS, run_questions
from pcr_eval.reorder_applicability import run_reorder_applicability
from pcr_eval.trace_workload import run_trace

DEFAULT_REQUESTS = 40
QUICK_REQUESTS = 12


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.doc_reuse_accuracy",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=parse_modes("concat,lego,blend"),
        help="comma-separated configurations to measure: concat, lego[:K], blend[:R[:A][:S]] "
        "(A: anchor tokens, S: deviation, gradual, query or prophet), reorder (exact) "
        "(default: concat,lego,blend at the server's K and R)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"first turns of the trace (default {DEFAULT_REQUESTS}; --quick: {QUICK_REQUESTS})",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="greedy answer length, at most")
    parser.add_argument("--max-doc-chars", type=int, default=600, help="cut Wikipedia extracts to this many characters")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed")
    parser.add_argument("--chunk-size", type=int, default=16, help="--pcr-chunk-size")
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=60000,
        help="device KV pool of every server (large enough that nothing is evicted)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="prompts in flight at once; 1 (default) keeps every request alone in its batch, "
        "so batch composition cannot move an answer",
    )
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct (built offline)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(f"bench/results/{datetime.date.today().isoformat()}/doc_reuse_accuracy"),
        help="where the JSON result, the markdown report and the server logs go "
        "(default: bench/results/<today>/doc_reuse_accuracy)",
    )
    parser.add_argument(
        "--workload",
        choices=("questions", "trace"),
        default="questions",
        help="questions (default): test-split questions about re-placed documents, gold-scored "
        "(pcr_eval/questions_workload.py); trace: the first turns of the ragbench trace, "
        "scored against full prefill only (the asked-about document is always first there)",
    )
    parser.add_argument(
        "--models",
        default="base,tuned",
        help="questions workload: comma-separated base (SmolLM2-135M-Instruct) and tuned (the same "
        "with the committed document-reuse adapter merged); ignored with --model-path",
    )
    parser.add_argument(
        "--questions",
        type=int,
        default=None,
        help=f"questions workload: questions per seed, the kinds in turn (default {DEFAULT_QUESTIONS}; "
        f"--quick: {QUICK_QUESTIONS})",
    )
    parser.add_argument("--seeds", default="0", help="questions workload: comma-separated seeds (repeats)")
    parser.add_argument(
        "--top-k",
        type=int,
        default=10,
        help="questions workload: full prefill's top-k tokens per position for the KL (default 10)",
    )
    parser.add_argument(
        "--reorder-applicability",
        action="store_true",
        help="start no server: replay the ragbench trace's first turns (--requests, in its "
        "retrieval and shuffled document orders) through reorder's order store and print "
        "how often reorder applies",
    )
    args = parser.parse_args(argv)
    requests_n = args.requests if args.requests is not None else (QUICK_REQUESTS if args.quick else DEFAULT_REQUESTS)
    if requests_n < 1 or args.max_new_tokens < 1 or args.concurrency < 1:
        parser.error("--requests, --max-new-tokens and --concurrency must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.reorder_applicability:
        return run_reorder_applicability(args, requests_n)
    if args.workload == "questions":
        return run_questions(args, argv)
    return run_trace(args, argv, requests_n)
