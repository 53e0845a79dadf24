"""TTFT of the base and the document-reuse tuned model, over several server starts, side by side.

    python -m bench.reuse_ttft [--rounds 3] [--questions 16] [--modes concat,blend:0.15:gradual]

The accuracy benchmark (``python -m bench.doc_reuse_accuracy``) measures TTFT on one server
start per model and mode. On two cores a server start has its own speed (where its threads
and memory landed, what else ran): one start per model cannot tell a slower model from a
slower start. This benchmark starts one document-reuse server per model per round, the
models alternating (base first in even rounds, tuned first in odd ones), and on each start
measures every prompt in every mode:

* ``full``: the prompt unmarked, under a cache namespace of its own (``extra_key``): a cold
  full prefill, as an unmarked request on a cold cache is served;
* each ``--modes`` entry: the prompt marked, warmed once (its documents' canonical KV
  computed), then streamed, under a namespace of the mode's own.

Each start's figure is the median TTFT over its prompts (one token generated, so TTFT is
the whole request). It reports each model's per-start medians, their spread (how much a
server start alone moves TTFT), and the tuned / base ratio per round (the two starts of a
round ran back to back) with its median over rounds: the figure to hold against the
issue's "within 5% of the base model's for the same mode".
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

FULL = "full"


@dataclass(frozen=True)
class StartResult:
    """One server start: its model, round and the median TTFT (s) per mode over the prompts."""

    model: str
    round: int
    startup_s: float
    median_ttft_s: dict[str, float]


def model_order(models: Sequence[str], round_index: int) -> list[str]:
    """The models in ``round_index``'s order: as given in even rounds, reversed in odd ones,
    so neither model always runs on the machine the other has just warmed (or heated)."""
    return list(models) if round_index % 2 == 0 else list(reversed(models))


def summarize(starts: Sequence[StartResult], models: Sequence[str], modes: Sequence[str],
              base: str = "base") -> dict[str, Any]:
    """Per model and mode: the per-start medians, their median and spread (max / min); per
    other model and mode: the ratio to ``base`` per round and the median of those ratios."""
    out: dict[str, Any] = {"per_model": {}, "ratio_to_base": {}}
    for model in models:
        out["per_model"][model] = {}
        for mode in modes:
            values = [s.median_ttft_s[mode] for s in starts if s.model == model and mode in s.median_ttft_s]
            out["per_model"][model][mode] = {
                "starts": values,
                "median_s": statistics.median(values) if values else None,
                "spread": max(values) / min(values) if values and min(values) > 0 else None,
            }
    by_round: dict[tuple[str, int], StartResult] = {(s.model, s.round): s for s in starts}
    rounds = sorted({s.round for s in starts})
    for model in models:
        if model == base:
            continue
        out["ratio_to_base"][model] = {}
        for mode in modes:
            ratios = []
            for r in rounds:
                mine, theirs = by_round.get((model, r)), by_round.get((base, r))
                if mine and theirs and mode in mine.median_ttft_s and theirs.median_ttft_s.get(mode):
                    ratios.append(mine.median_ttft_s[mode] / theirs.median_ttft_s[mode])
            out["ratio_to_base"][model][mode] = {
                "per_round": ratios, "median": statistics.median(ratios) if ratios else None}
    return out


def markdown(summary: dict[str, Any], models: Sequence[str], modes: Sequence[str], base: str = "base") -> str:
    def ms(value: Optional[float]) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f}"

    lines = ["| model | mode | median TTFT (ms) | per start (ms) | spread between starts |",
             "| --- | --- | ---: | --- | ---: |"]
    for model in models:
        for mode in modes:
            s = summary["per_model"][model][mode]
            spread = "n/a" if s["spread"] is None else f"{(s['spread'] - 1) * 100:.0f}%"
            lines.append(f"| {model} | {mode} | {ms(s['median_s'])} | {', '.join(ms(v) for v in s['starts'])} "
                         f"| {spread} |")
    for model, by_mode in summary["ratio_to_base"].items():
        lines += ["", f"| {model} / {base}, same round | median | per round |", "| --- | ---: | --- |"]
        for mode in modes:
            r = by_mode[mode]
            median = "n/a" if r["median"] is None else f"{(r['median'] - 1) * 100:+.1f}%"
            lines.append(f"| {mode} | {median} | {', '.join(f'{(x - 1) * 100:+.0f}%' for x in r['per_round'])} |")
    return "\n".join(lines) + "\n"


def measure_start(server: Any, prompts: Sequence[Any], specs: Sequence[Any], warmup: int) -> dict[str, float]:
    """The median TTFT per mode over ``prompts`` on one server; the first ``warmup``
    prompts are sent once in every mode beforehand and not counted (a fresh server's first
    requests pay one-time costs)."""
    from pcr_sglang.reuse.bounds import WARM_NOW_PARAM
    from pcr_sglang.reuse.prompt import DocPrompt

    def one(p: Any, spec: Any, key: str) -> float:
        sampling = {"temperature": 0.0, "max_new_tokens": 1}
        if spec is None:
            body = {"input_ids": p.input_ids, "sampling_params": sampling, "extra_key": key}
            return server.generate_stream(body).ttft_s
        marked = DocPrompt(p.input_ids, p.doc_bounds).sampling_params(**sampling)
        marked["custom_params"].update(spec.custom_params())
        warm = {**marked, "custom_params": {**marked["custom_params"], WARM_NOW_PARAM: True}}
        server.generate({"input_ids": p.input_ids, "sampling_params": warm, "extra_key": key})
        return server.generate_stream({"input_ids": p.input_ids, "sampling_params": marked, "extra_key": key}).ttft_s

    for i, p in enumerate(prompts[:warmup]):
        one(p, None, f"ttft-warmup-full-{i}")
        for spec in specs:
            one(p, spec, f"ttft-warmup-{spec.name}-{i}")
    ttfts: dict[str, list[float]] = {FULL: [], **{spec.name: [] for spec in specs}}
    for i, p in enumerate(prompts):
        ttfts[FULL].append(one(p, None, f"ttft-full-{i}"))
        for spec in specs:
            ttfts[spec.name].append(one(p, spec, f"ttft-{spec.name}-{i}"))
    return {mode: statistics.median(values) for mode, values in ttfts.items()}


def main(argv: Optional[list[str]] = None) -> int:
    from bench.doc_reuse_accuracy import COMMON_SERVER_ARGS, _affinity, doc_reuse_server_flags, server_mode
    from pcr_tools.tune.measure import parse_modes

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.reuse_ttft", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="server starts per model (default 3)")
    parser.add_argument("--questions", type=int, default=16,
                        help="test-split questions measured on every start, the kinds in turn (default 16)")
    parser.add_argument("--warmup", type=int, default=2, help="questions sent first on every start, not counted")
    parser.add_argument("--seed", type=int, default=0, help="the questions' seed")
    parser.add_argument("--modes", type=parse_modes, default=parse_modes("concat,blend:0.15:gradual"),
                        help="document-reuse configurations, as bench.doc_reuse_accuracy names them "
                             "(default: concat,blend:0.15:gradual); full prefill is always measured")
    parser.add_argument("--chunk-size", type=int, default=16, help="--pcr-chunk-size")
    parser.add_argument("--max-total-tokens", type=int, default=60000, help="device KV pool of every server")
    parser.add_argument("--out", type=Path,
                        default=Path(f"bench/results/{datetime.date.today().isoformat()}/reuse_ttft"),
                        help="where the JSON result and the markdown report go")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.questions < 1 or args.warmup < 0:
        parser.error("--rounds and --questions must be >= 1, --warmup >= 0")

    from transformers import AutoTokenizer

    from pcr_tools.launcher import ServerProcess, cpu_only
    from pcr_tools.models.smollm2 import build_smollm2
    from pcr_tools.tune.measure import gold_prompts
    from pcr_tools.tune.questions import question_set

    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", file=sys.stderr, flush=True)

    paths = {"base": str(build_smollm2()), "tuned": str(build_smollm2(doc_reuse_tuned=True))}
    models = list(paths)
    tokenizer = AutoTokenizer.from_pretrained(paths["base"])
    prompts = gold_prompts(question_set("test", args.questions + args.warmup, args.seed), tokenizer, args.seed)
    warmup_prompts, measured = prompts[:args.warmup], prompts[args.warmup:]
    modes = [FULL, *(spec.name for spec in args.modes)]
    flags = (*doc_reuse_server_flags(server_mode(args.modes), args.chunk_size),
             "--max-total-tokens", str(args.max_total_tokens), *COMMON_SERVER_ARGS)
    starts: list[StartResult] = []
    for r in range(args.rounds):
        for model in model_order(models, r):
            progress(f"round {r + 1}/{args.rounds}: starting the {model} server...")
            with ServerProcess(paths[model], flags) as server:
                medians = measure_start(server, [*warmup_prompts, *measured], args.modes, args.warmup)
                starts.append(StartResult(model, r, round(server.startup_seconds, 1), medians))
            progress(f"round {r + 1}: {model}: " + ", ".join(f"{m} {v * 1000:.0f} ms" for m, v in medians.items()))
    summary = summarize(starts, models, modes)
    report = markdown(summary, models, modes)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.reuse_ttft " + " ".join(argv)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
            "questions": len(measured), "warmup": args.warmup, "rounds": args.rounds, "server_args": list(flags),
            "machine": f"{len(_affinity())} CPU cores" + (", no GPU" if cpu_only() else ""),
            "elapsed_s": round(time.monotonic() - started, 1)}
    (args.out / f"{stamp}.json").write_text(json.dumps(
        {"meta": meta, "starts": [asdict(s) for s in starts], "summary": summary}, indent=1))
    (args.out / f"{stamp}.md").write_text(
        f"# TTFT of the base and tuned models over server starts ({meta['date']})\n\n`{command}`: "
        f"{len(measured)} test-split questions a start, {args.rounds} starts a model, models alternating, "
        f"{meta['elapsed_s'] / 60:.1f} min, {meta['machine']}.\n\n{report}")
    print(report)
    progress(f"wrote {args.out / stamp}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
