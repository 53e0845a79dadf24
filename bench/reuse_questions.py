"""The re-placed-document workload of ``bench.doc_reuse_accuracy`` (its default): questions
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

import math
import statistics
from typing import Any, Optional, Sequence

from pcr_tools.tune.measure import (  # noqa: F401 - the measures, re-exported for the tests
    GoldPrompt,
    gold_prompts,
    gold_scores,
    mean_ci,
    measure_full,
    measure_reuse,
    nll,
    ratio_ci,
    teacher_forced,
    topk_kl,
)

FULL = "full prefill"


# ------------------------------------------------------------------- summary
GOLD_METRICS = ("lead_f1", "lead_rouge_l", "em_needle", "em_two_hop", "gold_nll")


def _gold_values(rows: Sequence[dict[str, Any]], prompts: Sequence[GoldPrompt], metric: str) -> list[Optional[float]]:
    if metric == "em_needle":
        return [r.get("em") if p.kind == "needle" else None for r, p in zip(rows, prompts)]
    if metric == "em_two_hop":
        return [r.get("em") if p.kind == "two_hop" else None for r, p in zip(rows, prompts)]
    return [r.get(metric) for r in rows]


def summarize_mode(rows: Sequence[dict[str, Any]], prompts: Sequence[GoldPrompt], base_full: Sequence[dict[str, Any]],
                   own_full: Sequence[dict[str, Any]], seed: int) -> dict[str, Any]:
    """One (model, mode)'s figures; ``base_full``: the base model's full-prefill rows (the
    gold reference), ``own_full``: this model's (fidelity and the noise floor)."""
    ok = [i for i, r in enumerate(rows) if "error" not in r]
    pick = lambda seq: [seq[i] for i in ok]  # noqa: E731
    rows_ok, prompts_ok, base_ok, own_ok = pick(rows), pick(prompts), pick(base_full), pick(own_full)
    out: dict[str, Any] = {"questions": len(ok), "errors": len(rows) - len(ok)}
    for metric in GOLD_METRICS:
        mine = _gold_values(rows_ok, prompts_ok, metric)
        out[metric] = mean_ci(mine, seed)
        base = _gold_values(base_ok, prompts_ok, metric)
        # NLL: lower is better, so its "% of full prefill" is full prefill's over this one's.
        out[metric + "_pct_of_base_full"] = ratio_ci(base, mine, seed) if metric == "gold_nll" else \
            ratio_ci(mine, base, seed)
    for metric in ("kl", "top1", "f1", "identical", "ttft_s"):
        out[metric] = mean_ci([r.get(metric) for r in rows_ok], seed)
    out["nll_ratio"] = ratio_ci([r.get("nll") for r in rows_ok], [f.get("nll") for f in own_ok], seed)
    out["noise_floor_f1"] = mean_ci([f.get("noise_f1") for f in own_ok], seed)
    out["noise_floor_identical"] = mean_ci([f.get("noise_identical") for f in own_ok], seed)
    doc_tokens = sum(p.doc_tokens for p in prompts_ok)
    out["recomputed_share_of_doc_tokens"] = (sum(r.get("recomputed_tokens", 0) for r in rows_ok) / doc_tokens
                                             if doc_tokens else None)
    ttfts = [r["ttft_s"] for r in rows_ok if r.get("ttft_s") is not None and not math.isnan(r["ttft_s"])]
    out["ttft_median_s"] = statistics.median(ttfts) if ttfts else None
    reused = [float(r["all_docs_reused"]) for r in rows_ok if r.get("all_docs_reused") is not None]
    out["all_docs_reused"] = statistics.fmean(reused) if reused else None
    reordered = [float(r["reordered"]) for r in rows_ok if r.get("reordered") is not None]
    out["reordered"] = statistics.fmean(reordered) if reordered else None  # reorder: served in another order
    return out


def _fmt(stat: Optional[dict[str, Any]], pct: bool = False, digits: int = 3) -> str:
    if not stat or stat.get("mean") is None:
        return "n/a"
    mean, low, high = stat["mean"], stat["low"], stat["high"]
    if pct:
        return f"{mean:.0%} [{low:.0%}, {high:.0%}]"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def markdown_tables(summaries: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Three tables (gold, fidelity, speed), one row per model and mode."""
    gold = ["| model | mode | lead F1 | lead ROUGE-L | needle EM | two-hop EM | gold NLL | lead F1 % base full "
            "| needle EM % | two-hop EM % | gold NLL % |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fidelity = ["| model | mode | KL (top-k) | top-1 agreement | NLL / own full | F1 vs own full "
                "| identical | noise floor F1 | noise floor identical |", "|---|---|---|---|---|---|---|---|---|"]
    speed = ["| model | mode | questions | all docs reused | reordered | recomputed share of document tokens "
             "| median TTFT (s) |", "|---|---|---:|---:|---:|---:|---:|"]
    for model, modes in summaries.items():
        for mode, s in modes.items():
            gold.append(f"| {model} | {mode} | {_fmt(s['lead_f1'])} | {_fmt(s['lead_rouge_l'])} "
                        f"| {_fmt(s['em_needle'], True)} | {_fmt(s['em_two_hop'], True)} | {_fmt(s['gold_nll'])} "
                        f"| {_fmt(s['lead_f1_pct_of_base_full'], True)} "
                        f"| {_fmt(s['em_needle_pct_of_base_full'], True)} "
                        f"| {_fmt(s['em_two_hop_pct_of_base_full'], True)} "
                        f"| {_fmt(s['gold_nll_pct_of_base_full'], True)} |")
            if mode == FULL:
                fidelity.append(f"| {model} | {mode} | 0 | 100% | 1.00 | 1.000 | 100% "
                                f"| {_fmt(s['noise_floor_f1'])} | {_fmt(s['noise_floor_identical'], True)} |")
            else:
                fidelity.append(f"| {model} | {mode} | {_fmt(s['kl'])} | {_fmt(s['top1'], True)} "
                                f"| {_fmt(s['nll_ratio'], digits=2)} | {_fmt(s['f1'])} | {_fmt(s['identical'], True)} "
                                f"| {_fmt(s['noise_floor_f1'])} | {_fmt(s['noise_floor_identical'], True)} |")
            reused = s.get("all_docs_reused")
            share = s.get("recomputed_share_of_doc_tokens")
            ttft = s.get("ttft_median_s")
            reordered = s.get("reordered")
            speed.append(f"| {model} | {mode} | {s['questions']} | {'n/a' if reused is None else f'{reused:.0%}'} "
                         f"| {'n/a' if reordered is None else f'{reordered:.0%}'} "
                         f"| {'n/a' if share is None else f'{share:.1%}'} "
                         f"| {'n/a' if ttft is None else f'{ttft:.3f}'} |")
    return "\n".join(["Gold answers (95% bootstrap intervals over questions):", *gold, "",
                      "Fidelity to the same model's full prefill (teacher-forced along its answer; free-running "
                      "beside the noise floor, full prefill with the documents shuffled):", *fidelity, "",
                      "Reuse and speed:", *speed])


def summarize_full(rows: Sequence[dict[str, Any]], prompts: Sequence[GoldPrompt], base_full: Sequence[dict[str, Any]],
                   seed: int) -> dict[str, Any]:
    """Full prefill's own row of the tables (its fidelity is 1 by definition)."""
    out = summarize_mode([{**r, "recomputed_tokens": 0} for r in rows], prompts, base_full, rows, seed)
    out["all_docs_reused"] = None
    out["recomputed_share_of_doc_tokens"] = None
    return out



# ------------------------------------------------------------------- targets
def target_lines(summaries: dict[str, dict[str, dict[str, Any]]], default_mode: str) -> list[str]:
    """Issue 28's targets for the tuned model, each with where it stands (never assumed met)."""
    tuned, base = summaries.get("tuned"), summaries.get("base")
    lines = []
    for name, modes in summaries.items():  # reorder (issue 40): on every model measured
        s, own_full = modes.get("reorder"), modes.get(FULL)
        if s and own_full:
            f1, floor = (s.get("f1") or {}).get("mean"), (own_full.get("noise_floor_f1") or {}).get("mean")
            verdict = "n/a" if f1 is None or floor is None else \
                f"{f1:.3f} vs {floor:.3f} -> {'met' if f1 >= floor else f'missed by {floor - f1:.3f}'}"
            lines.append(f"{name}, reorder (exact; served in the noise floor's shuffled order): free-running F1 vs "
                         f"own full prefill >= noise floor: {verdict}")
    if not tuned or not base:
        return lines + ["targets: need both the base and the tuned model (--models base,tuned)"]

    def pct(s: dict[str, Any], metric: str) -> Optional[float]:
        return (s.get(metric + "_pct_of_base_full") or {}).get("mean")

    def mean(s: dict[str, Any], metric: str) -> Optional[float]:
        return (s.get(metric) or {}).get("mean")

    def check(text: str, value: Optional[float], bound: Optional[float], at_least: bool = True) -> None:
        if value is None or bound is None:
            lines.append(f"  {text}: n/a")
            return
        ok = value >= bound if at_least else value <= bound
        verdict = "met" if ok else f"missed by {abs(bound - value):.3f}"
        lines.append(f"  {text}: {value:.3f} vs {bound:.3f} -> {verdict}")

    if default_mode in tuned:
        s, own_full = tuned[default_mode], tuned[FULL]
        share = s.get("recomputed_share_of_doc_tokens")
        lines.append(f"tuned, {default_mode} (recomputes {share:.1%} of document tokens; target <= 15%):"
                     if share is not None else f"tuned, {default_mode}:")
        check("free-running F1 vs own full prefill >= noise floor", mean(s, "f1"), mean(own_full, "noise_floor_f1"))
        check("lead F1, % of base full prefill >= 95%", pct(s, "lead_f1"), 0.95)
        check("two-hop EM, % of base full prefill >= 95%", pct(s, "em_two_hop"), 0.95)
        check("needle EM >= base full prefill's", mean(s, "em_needle"), mean(base[FULL], "em_needle"))
    if "concat" in tuned:
        s, own_full = tuned["concat"], tuned[FULL]
        floor = mean(own_full, "noise_floor_f1")
        lines.append("tuned, concat:")
        check("free-running F1 >= 90% of the noise floor", mean(s, "f1"), None if floor is None else 0.9 * floor)
        for metric in ("lead_f1", "em_needle", "em_two_hop"):
            check(f"{metric}, % of base full prefill >= 90%", pct(s, metric), 0.90)
    lines.append("tuned, unmarked (full prefill on the tuned weights):")
    for metric in ("lead_f1", "em_needle", "em_two_hop"):
        check(f"{metric}, % of base full prefill >= 98%", pct(tuned[FULL], metric), 0.98)
    for mode in tuned:
        b, t = (base.get(mode) or {}).get("ttft_median_s"), tuned[mode].get("ttft_median_s")
        if mode != FULL and b and t:
            lines.append(f"  TTFT {mode}: tuned {t:.3f} s vs base {b:.3f} s ({t / b - 1:+.1%}; target within 5%)")
    return lines


# ------------------------------------------------------------------- the run
def run_questions(args: Any, argv: Sequence[str]) -> int:
    """The questions workload of ``python -m bench.doc_reuse_accuracy`` (its default)."""
    import contextlib
    import datetime
    import json
    import shlex
    import sys
    import time
    from pathlib import Path

    from transformers import AutoTokenizer

    from bench.doc_reuse_accuracy import (
        COMMON_SERVER_ARGS,
        DEFAULT_QUESTIONS,
        QUICK_QUESTIONS,
        doc_reuse_server_flags,
        machine,
        run_all,
        server_mode,
    )
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
    progress(f"{len(prompts)} test-split questions ({', '.join(sorted({p.kind for p in prompts}))}), "
             f"longest prompt {max(len(p.input_ids) for p in prompts)} tokens")
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
            rows[name][FULL] = run_all(prompts, lambda p: measure_full(server, p, args.max_new_tokens, args.top_k,
                                                                      decode), args.concurrency, f"{name} {FULL}")
        reference = rows[name][FULL]
        with serving(f"{name} doc-reuse", path, flags) as server:
            for spec in args.modes:
                rows[name][spec.name] = run_all(
                    prompts, lambda p: measure_reuse(server, p, reference[p.index], spec, args.max_new_tokens, decode,
                                                     args.chunk_size)
                    if "error" not in reference[p.index] else {"error": "no reference"},
                    args.concurrency, f"{name} {spec.name}")
    # The measurements first: a failure while summarizing must not lose them.
    (args.out / f"{stamp}-rows.json").write_text(json.dumps(rows, default=str))
    base_name = "base" if "base" in rows else next(iter(rows))
    base_full = rows[base_name][FULL]
    summaries = {name: {mode: (summarize_full(r, prompts, base_full, 0) if mode == FULL else
                               summarize_mode(r, prompts, base_full, rows[name][FULL], 0))
                        for mode, r in by_mode.items()}
                 for name, by_mode in rows.items()}
    default_mode = next((s.name for s in args.modes if s.mode == "blend"), args.modes[0].name)
    tables = markdown_tables(summaries)
    targets = target_lines(summaries, default_mode)
    elapsed = time.monotonic() - started
    command = "python -m bench.doc_reuse_accuracy " + shlex.join(list(argv))
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
            "models": {n: Path(p).name for n, p in models.items()}, "questions": len(prompts), "seeds": seeds,
            "machine": machine(),
            "max_new_tokens": args.max_new_tokens, "top_k": args.top_k, "modes": [s.name for s in args.modes],
            "servers": servers, "elapsed_s": round(elapsed, 1)}
    result = {"meta": meta, "summary": summaries, "targets": targets,
              "rows": [{"rid": p.rid, "kind": p.kind, "question": p.question.question, "gold": p.question.gold,
                        "targets": list(p.question.targets), "titles": list(p.question.titles),
                        "models": {n: {m: r[p.index] for m, r in by_mode.items()} for n, by_mode in rows.items()}}
                       for p in prompts]}
    (args.out / f"{stamp}.json").write_text(json.dumps(result, indent=1, default=str))
    report = "\n".join([f"# Document-reuse accuracy, {meta['date']}", "", f"`{command}` ({elapsed / 60:.1f} min, "
                        f"{meta['machine']}; {len(prompts)} test-split questions; models {meta['models']})", "",
                        tables, "", "Targets:", "", *[f"    {line}" for line in targets], ""])
    (args.out / f"{stamp}.md").write_text(report)
    print(report)
    print(f"wrote {args.out / stamp}.json and .md ({elapsed:.0f} s)")
    errors = sum("error" in r for by_mode in rows.values() for rs in by_mode.values() for r in rs)
    if errors:
        print(f"{errors} measurements failed (see the JSON rows)", file=sys.stderr)
    return 1 if errors else 0
