"""The trace workload of the accuracy benchmark (``--workload trace``): the first turns of
ragbench's retrieval trace, each mode scored against full prefill only (the asked-about
document is first in every prompt, so it does not test re-placed documents; the module
docstring of :mod:`pcr_eval.accuracy` says what is sent and why).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from pcr_eval.forcing import answer_nll
from pcr_eval.modes import ModeSpec
from pcr_eval.requests import all_docs_reused, served_order
from pcr_eval.scores import token_f1
from pcr_eval.serving import COMMON_SERVER_ARGS, doc_reuse_server_flags, machine, run_all, server_mode
from pcr_eval.trace_report import EXACT, FULL, TARGETS, markdown_table, mean_or_none, pct, summarize, target_lines

logger = logging.getLogger(__name__)


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


def mode_request(
    prompt: Prompt, spec: Optional[ModeSpec], input_ids: Optional[list[int]] = None, **sampling: Any
) -> dict[str, Any]:
    """A ``/generate`` body for ``prompt`` in mode ``spec``. Each mode has its own cache
    namespace (``extra_key``): a prompt one mode served by plain prefill (nothing left to
    reuse) is cached exactly, and would otherwise answer the next mode's requests from
    that exact prefix instead of from re-placed documents."""
    body: dict[str, Any] = {
        "input_ids": prompt.input_ids if input_ids is None else input_ids,
        "sampling_params": _sampling(prompt, spec, **sampling),
    }
    if spec is not None:
        body["extra_key"] = f"pcr-accuracy:{spec.name}"
    return body


def teacher_forced(server: Any, prompt: Prompt, answer: list[int], spec: Optional[ModeSpec]) -> tuple[float, int]:
    """NLL per token of ``answer`` after ``prompt`` on ``server``, and the request's cached tokens."""
    reply = server.generate(
        {
            **mode_request(prompt, spec, prompt.input_ids + answer, **greedy(0)),
            "return_logprob": True,
            "logprob_start_len": len(prompt.input_ids) - 1,
        }
    )
    meta = reply["meta_info"]
    return answer_nll(meta["input_token_logprobs"], answer), int(meta.get("cached_tokens", 0))


def measure_reference(server: Any, prompt: Prompt, max_new_tokens: int) -> dict[str, Any]:
    reply = server.generate({"input_ids": prompt.input_ids, "sampling_params": greedy(max_new_tokens)})
    answer = list(reply["output_ids"])
    nll, _ = teacher_forced(server, prompt, answer, None)
    return {
        "answer_ids": answer,
        "answer": reply.get("text", ""),
        "finish": (reply["meta_info"].get("finish_reason") or {}).get("type"),
        "nll": nll,
    }


def _docs_reused(prompt: Prompt, spec: Optional[ModeSpec], cached: int, chunk_size: int) -> Optional[bool]:
    """Marked: every document reused (:func:`pcr_eval.requests.all_docs_reused`, the rule the
    questions workload and calibration apply too). Unmarked (the control): prefix caching,
    documents are not reused as such (None)."""
    if spec is None:
        return None
    return all_docs_reused(prompt, spec, cached, chunk_size)


def measure_mode(
    server: Any,
    prompt: Prompt,
    reference: dict[str, Any],
    max_new_tokens: int,
    spec: Optional[ModeSpec],
    decode: Callable[[list[int]], str],
    chunk_size: int = 1,
) -> dict[str, Any]:
    """Warm, measured greedy answer, teacher-forced NLL of the reference answer (``spec``
    None: the documents unmarked, the exact prefix cache's control). ``reorder`` is not
    warmed: it follows the orders of the trace's earlier requests."""
    # mutant: accuracy-bench-warm-up-without-the-modes-key
    warm = (
        None
        if spec is not None and spec.mode == "reorder"
        else server.generate(mode_request(prompt, spec, **greedy(1)))
    )
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


def _counters(server: Any) -> dict[str, Any]:
    try:
        return dict(server.pcr_state()["doc_reuse"]["counters"])
    except Exception as e:  # noqa: BLE001 - informative only
        logger.warning("could not read the doc-reuse counters: %s", e)
        return {}


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


def run_trace(args: argparse.Namespace, argv: Sequence[str], requests_n: int) -> int:
    """``--workload trace``: full prefill's answers, then every ``--modes`` entry and the
    exact prefix cache's control on one document-reuse server; writes the JSON result and
    prints the table. Exit status 1 if a request failed or the control was not exact."""
    from transformers import AutoTokenizer

    from pcr_eval.ragbench.workload import WorkloadParams, make_trace
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
    trace = make_trace(
        WorkloadParams(
            num_requests=requests_n,
            max_doc_chars=args.max_doc_chars or None,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
        )
    )
    prompts = []
    for i, request in enumerate(trace.first_turns()[:requests_n]):
        doc_prompt = trace.doc_prompt(request, tokenizer)
        prompts.append(
            Prompt(
                i,
                request.rid,
                request.question,
                list(request.doc_ids),
                list(doc_prompt.input_ids),
                list(doc_prompt.doc_bounds),
            )
        )
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
        servers[name] = {"args": server.public_args, "startup_s": round(server.startup_seconds, 1), "log": str(log)}
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
    reference_nll = mean_or_none([references[i]["nll"] for i in usable])

    # 2./3. Every spec on one server (each request asks for its own); then the exactness control.
    results: dict[str, list[dict[str, Any]]] = {}
    counters: dict[str, dict[str, Any]] = {}
    reuse = server_mode(args.modes)
    flags = doc_reuse_server_flags(reuse, args.chunk_size)
    with serving(f"doc-reuse {reuse}", flags) as server:
        for spec in args.modes:
            before = _counters(server)
            results[spec.name] = timed_phase(
                spec.name,
                measured,
                lambda p: measure_mode(
                    server, p, references[p.index], args.max_new_tokens, spec, decode, args.chunk_size
                ),
            )
            after = _counters(server)
            counters[spec.name] = {"total": after, "this_phase": _delta(after, before)}
        results[EXACT] = timed_phase(
            EXACT, measured, lambda p: measure_mode(server, p, references[p.index], args.max_new_tokens, None, decode)
        )
        counters[EXACT] = {"this_phase": _delta(_counters(server), after)}

    ref_ok = [references[i] for i in usable]
    summaries = {
        FULL: {
            "requests": len(ref_ok),
            "errors": len(references) - len(ref_ok),
            "all_docs_reused": None,
            "tf_all_docs_reused": None,
            "identical_answers": 1.0,
            "mean_f1": 1.0,
            "nll": reference_nll,
            "nll_ratio": 1.0,
            "first_token_agreement": 1.0,
        },
        EXACT: summarize(results[EXACT], reference_nll, docs_reused=False),
    }
    for spec in args.modes:
        summaries[spec.name] = summarize(results[spec.name], reference_nll)

    rows = []
    for k, i in enumerate(usable):
        p, ref = prompts[i], references[i]
        rows.append(
            {
                "rid": p.rid,
                "question": p.question,
                "doc_ids": p.doc_ids,
                "prompt_tokens": len(p.input_ids),
                "doc_bounds": p.doc_bounds,
                "last_doc_end": p.last_doc_end,
                "reference": {**ref, "answer": decode(ref["answer_ids"])},
                "modes": {mode: results[mode][k] for mode in results},
            }
        )
    for i in range(len(prompts)):
        if i not in usable:
            rows.append({"rid": prompts[i].rid, "error": references[i]["error"]})
    not_reused = [
        {"rid": r["rid"], "mode": m, "cached_tokens": r["modes"][m]["cached_tokens"], "last_doc_end": r["last_doc_end"]}
        for r in rows
        if "modes" in r
        for m in (spec.name for spec in args.modes)
        if "error" not in r["modes"][m] and not r["modes"][m]["all_docs_reused"]
    ]
    elapsed = time.monotonic() - started
    result = {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python -m bench.doc_reuse_accuracy " + shlex.join(argv),
            "model": Path(model_path).name,
            "machine": f"{platform.machine()}, {machine()}",
            "requests": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "max_doc_chars": args.max_doc_chars,
            "chunk_size": args.chunk_size,
            "concurrency": args.concurrency,
            "modes": [spec.name for spec in args.modes],
            "trace_stats": trace.stats,
            "servers": servers,
            "phase_s": phase_s,
            "elapsed_s": elapsed,
            "nll_method": "teacher-forced: prompt + full prefill's answer ids, return_logprob, "
            "logprob_start_len = len(prompt) - 1; mean -logprob over the answer tokens",
            "f1_method": "SQuAD token F1 of the decoded answers (lowercase, punctuation and articles removed)",
        },
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
        print(
            f"{len(not_reused)} measured requests did not reuse all their documents: "
            + ", ".join(
                f"{r['rid']} ({r['mode']}: cached {r['cached_tokens']}, documents end at {r['last_doc_end']})"
                for r in not_reused[:10]
            )
        )
    control = summaries[EXACT]
    if control["identical_answers"] != 1.0:
        print(
            f"EXACTNESS CONTROL FAILED: prefix-cached answers equal full prefill's for only "
            f"{pct(control['identical_answers'])} of requests"
        )
    print(f"wrote {path} ({elapsed:.0f} s)")
    failed = any(s["errors"] for s in summaries.values()) or control["identical_answers"] != 1.0
    return 1 if failed else 0
