"""The re-placed-document workload of ``python -m bench.doc_reuse_accuracy`` (its default): questions
about documents that are never first, scored against gold answers and against full prefill.

Questions come from ``pcr_tools.tune.questions`` on the **test** split (articles the tuning
never saw): ``lead`` (gold: the article's lead sentence), ``needle`` (a planted number or
name) and ``two_hop`` (a planted person in one document, their birthplace in another).
For each model (``base``: SmolLM2-135M-Instruct; ``tuned``: the same with the committed
document-reuse adapter merged) two servers run side by side in one command:

1. full prefill (``--disable-radix-cache``): the greedy answer (streamed: TTFT), its
   teacher-forced log-probabilities with the top ``--top-k`` tokens per position, the
   teacher-forced NLL of the gold answer, and the noise floor: the greedy answer with the
   documents shuffled (the asked-about ones kept off the first position);
2. a document-reuse server serving every ``--modes`` entry: each prompt is warmed (one
   token), then measured (greedy, streamed), then full prefill's answer is teacher-forced
   under the mode (``token_ids_logprob``: full prefill's top-k tokens of every position)
   and so is the gold answer. ``reorder`` (exact) is warmed instead with the documents in
   the noise floor's shuffled order and no question: the measured request is served in
   that order, so its answer is full prefill's shuffled one and its agreement is the noise
   floor by construction; ``reordered`` is the share served in another order.

Reported per model and mode, each mean with a 95% bootstrap interval over questions:
gold scores (lead F1 and ROUGE-L, needle and two-hop exact match, gold NLL) and the same
as % of the **base** model's full prefill; teacher-forced fidelity to the same model's
full prefill (KL over full prefill's top-k tokens plus the rest of the mass, a lower bound
of the full KL; top-1 agreement; NLL ratio); free-running agreement (token F1, identical
share) beside the noise floor; the recomputed share of all document tokens; median TTFT.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from pcr_eval.gold import GoldPrompt, gold_prompts
from pcr_eval.measure import measure_full, measure_reuse
from pcr_eval.questions_report import FULL, markdown_tables, summarize_full, summarize_mode, target_lines
from pcr_eval.serving import COMMON_SERVER_ARGS, doc_reuse_server_flags, machine, run_all, server_mode

DEFAULT_QUESTIONS = 36
QUICK_QUESTIONS = 12


def run_questions(args: Any, argv: Sequence[str]) -> int:
    """The questions workload of ``python -m bench.doc_reuse_accuracy`` (its default)."""
    from transformers import AutoTokenizer

    from pcr_tools.launcher import ServerProcess
    from pcr_tools.models.smollm2 import build_smollm2
    from pcr_tools.tune.questions import question_set

    started = time.monotonic()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", file=sys.stderr, flush=True)

    if args.model_path:
        models = {Path(args.model_path).name: str(args.model_path)}
    else:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in names if n not in ("base", "tuned")]
        if unknown or not names:
            print(f"--models: expected base and/or tuned, got {args.models!r}", file=sys.stderr)
            return 2
        models = {}
        for name in names:
            progress(f"building the {name} model...")
            models[name] = str(build_smollm2(doc_reuse_tuned=name == "tuned"))
    count = args.questions or (QUICK_QUESTIONS if args.quick else DEFAULT_QUESTIONS)
    seeds = [int(x) for x in str(args.seeds).split(",") if x.strip()]
    tokenizer = AutoTokenizer.from_pretrained(next(iter(models.values())))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    prompts: list[GoldPrompt] = []
    for seed in seeds:
        prompts += gold_prompts(question_set("test", count, seed), tokenizer, seed)
    for i, p in enumerate(prompts):
        p.index = i
    progress(
        f"{len(prompts)} test-split questions ({', '.join(sorted({p.kind for p in prompts}))}), "
        f"longest prompt {max(len(p.input_ids) for p in prompts)} tokens"
    )
    pool = ("--max-total-tokens", str(args.max_total_tokens))
    servers: dict[str, Any] = {}

    @contextlib.contextmanager
    def serving(label: str, model_path: str, extra: tuple[str, ...]):
        log = args.out / f"{stamp}-{label.replace(' ', '-')}.log"
        progress(f"starting {label} (log: {log})...")
        server = ServerProcess(model_path, (*extra, *pool, *COMMON_SERVER_ARGS), log_path=log)
        server.start()
        servers[label] = {"args": server.public_args, "startup_s": round(server.startup_seconds, 1)}
        try:
            yield server
        finally:
            server.kill()

    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    flags = doc_reuse_server_flags(server_mode(args.modes), args.chunk_size)
    for name, path in models.items():
        rows[name] = {}
        with serving(f"{name} full prefill", path, ("--disable-radix-cache",)) as server:
            rows[name][FULL] = run_all(
                prompts,
                lambda p: measure_full(server, p, args.max_new_tokens, args.top_k, decode),
                args.concurrency,
                f"{name} {FULL}",
            )
        reference = rows[name][FULL]
        with serving(f"{name} doc-reuse", path, flags) as server:
            for spec in args.modes:
                rows[name][spec.name] = run_all(
                    prompts,
                    lambda p: measure_reuse(
                        server, p, reference[p.index], spec, args.max_new_tokens, decode, args.chunk_size
                    )
                    if "error" not in reference[p.index]
                    else {"error": "no reference"},
                    args.concurrency,
                    f"{name} {spec.name}",
                )
    # The measurements first: a failure while summarizing must not lose them.
    (args.out / f"{stamp}-rows.json").write_text(json.dumps(rows, default=str))
    base_name = "base" if "base" in rows else next(iter(rows))
    base_full = rows[base_name][FULL]
    summaries = {
        name: {
            mode: (
                summarize_full(r, prompts, base_full, 0)
                if mode == FULL
                else summarize_mode(r, prompts, base_full, rows[name][FULL], 0)
            )
            for mode, r in by_mode.items()
        }
        for name, by_mode in rows.items()
    }
    default_mode = next((s.name for s in args.modes if s.mode == "blend"), args.modes[0].name)
    tables = markdown_tables(summaries)
    targets = target_lines(summaries, default_mode)
    elapsed = time.monotonic() - started
    command = "python -m bench.doc_reuse_accuracy " + shlex.join(list(argv))
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "models": {n: Path(p).name for n, p in models.items()},
        "questions": len(prompts),
        "seeds": seeds,
        "machine": machine(),
        "max_new_tokens": args.max_new_tokens,
        "top_k": args.top_k,
        "modes": [s.name for s in args.modes],
        "servers": servers,
        "elapsed_s": round(elapsed, 1),
    }
    result = {
        "meta": meta,
        "summary": summaries,
        "targets": targets,
        "rows": [
            {
                "rid": p.rid,
                "kind": p.kind,
                "question": p.question.question,
                "gold": p.question.gold,
                "targets": list(p.question.targets),
                "titles": list(p.question.titles),
                "models": {n: {m: r[p.index] for m, r in by_mode.items()} for n, by_mode in rows.items()},
            }
            for p in prompts
        ],
    }
    (args.out / f"{stamp}.json").write_text(json.dumps(result, indent=1, default=str))
    report = "\n".join(
        [
            f"# Document-reuse accuracy, {meta['date']}",
            "",
            f"`{command}` ({elapsed / 60:.1f} min, "
            f"{meta['machine']}; {len(prompts)} test-split questions; models {meta['models']})",
            "",
            tables,
            "",
            "Targets:",
            "",
            *[f"    {line}" for line in targets],
            "",
        ]
    )
    (args.out / f"{stamp}.md").write_text(report)
    print(report)
    print(f"wrote {args.out / stamp}.json and .md ({elapsed:.0f} s)")
    errors = sum("error" in r for by_mode in rows.values() for rs in by_mode.values() for r in rs)
    if errors:
        print(f"{errors} measurements failed (see the JSON rows)", file=sys.stderr)
    return 1 if errors else 0
