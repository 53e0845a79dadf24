"""TTFT of the base and the document-reuse tuned model, over several server starts, side by side.

    python -m bench.reuse_ttft [--rounds 4] [--questions 12] [--modes concat,blend:0.15:gradual,reorder]
    python -m bench.reuse_ttft --models tuned --rounds 2     # one model: each mode against its reference

The accuracy benchmark (``python -m bench.doc_reuse_accuracy``) measures TTFT on one server
start per model and server kind, between its other requests (teacher-forced and shuffled
ones): its TTFT columns hold one start of each model against one of the other. This
benchmark repeats the comparison over rounds, the models alternating (base first in even
rounds, tuned first in odd ones; the default, 4 rounds, puts each first as often). In each
round every model gets two server starts, one after the other:

* ``full (no cache)``: a server with ``--disable-radix-cache``, the accuracy benchmark's
  full-prefill server; every question unmarked;
* a document-reuse server (``--enable-pcr --pcr-doc-reuse ...``) measuring ``full``, every
  question unmarked under a cache namespace of its own (``extra_key``), so a cold full
  prefill as PCR serves an unmarked request, and each ``--modes`` entry: the question
  marked, warmed once under a namespace of its own (its documents' canonical KV
  computed), then streamed. A marked request must reuse every document (its cached plus
  recomputed tokens reach the last document's end); one that does not is counted and left
  out of the medians. ``reorder`` (exact) is warmed instead with the documents in another
  order (the accuracy benchmark's shuffled one) and no question, so the measured request
  is served in that order.

Every mode is set against an exact prefix hit of the same tokens on the same server (the
issue's targets: ``concat`` within 1.3x of it, ``reorder`` within 10%): ``exact prefix hit``
is the question unmarked after its own leading tokens and documents were sent (unmarked, no
question), both reaching the last whole chunk before the documents' end (or left out). A
recompute mode (``blend``, ``lego``) is set against its recompute bound, the concat cost plus
its recomputed tokens' prefill: ``exact prefix hit + <mode> recompute`` is the same exact hit
with its cached prefix shorter by the tokens that mode recomputes, so the bound is
``concat + (that - exact prefix hit)`` (medians; without ``concat`` in ``--modes``, that
figure alone).

Every request generates one token, so TTFT is the whole request, streamed. ``--warmup``
questions of another seed are sent first on every start and not counted (a fresh server's
first requests pay one-time costs). Each start's figure is the median TTFT over its
questions. The report gives each model's per-start medians and their spread, and the tuned
/ base ratio per round (the same kind of server, started within minutes of each other) with the
median of those ratios. The JSON result is rewritten after every start, so a failure late
in the run keeps what was measured; a server that fails to start is recorded and the run
goes on; the exit status is 1 if any request failed, was not served as measured, or a
start failed. The report records the OpenMP threads each server ran with
(``OMP_NUM_THREADS``; torch's default is one per core).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from pcr_eval.gold import gold_prompts
from pcr_eval.modes import parse_modes
from pcr_eval.requests import all_docs_reused, marked_request, warm_request
from pcr_eval.serving import COMMON_SERVER_ARGS, doc_reuse_server_flags, machine, server_mode

logger = logging.getLogger(__name__)

FULL = "full"  # unmarked, on the document-reuse server
FULL_NO_CACHE = "full (no cache)"  # unmarked, on a --disable-radix-cache server
EXACT_HIT = "exact prefix hit"  # unmarked, its leading tokens and documents cached: every mode's reference
TARGETS = {"concat": 1.3, "reorder": 1.10}  # mode -> most its TTFT may be of an exact prefix hit's
RECOMPUTE_TARGET = 1.3  # a recompute mode -> most its TTFT may be of its recompute bound


def recompute_bound_name(spec_name: str) -> str:
    """The run measuring ``spec_name``'s recomputed tokens on top of an exact prefix hit."""
    return f"{EXACT_HIT} + {spec_name} recompute"


WARMUP_SEED_OFFSET = 10_000  # the warm-up questions' seed: seed + this, never a measured question


@dataclass
class StartResult:
    """One server start: its model, round, kind, and the median TTFT (s) per mode over the
    questions; per mode, ``errors`` failed requests and ``not_reused`` requests not served
    as measured (an unmarked one that hit the cache, a marked one that did not reuse every
    document), both left out of the medians."""

    model: str
    round: int
    server: str
    startup_s: float
    median_ttft_s: dict[str, float]
    errors: dict[str, int] = field(default_factory=dict)
    not_reused: dict[str, int] = field(default_factory=dict)


def model_order(models: Sequence[str], round_index: int) -> list[str]:
    """The models in ``round_index``'s order: as given in even rounds, reversed in odd ones,
    so neither model always runs on the machine the other has just warmed (or heated)."""
    return list(models) if round_index % 2 == 0 else list(reversed(models))


def summarize(
    starts: Sequence[StartResult], models: Sequence[str], modes: Sequence[str], base: str = "base"
) -> dict[str, Any]:
    """Per model and mode: the per-start medians, their median and spread (max / min); per
    other model and mode: the ratio to ``base`` in each round both measured it, and the
    median of those ratios."""
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

    def in_round(model: str, r: int, mode: str) -> Optional[float]:
        return next(
            (s.median_ttft_s[mode] for s in starts if s.model == model and s.round == r and mode in s.median_ttft_s),
            None,
        )

    rounds = sorted({s.round for s in starts})
    for model in models:
        if model == base or base not in models:
            continue
        out["ratio_to_base"][model] = {}
        for mode in modes:
            ratios = []
            for r in rounds:
                mine, theirs = in_round(model, r, mode), in_round(base, r, mode)
                if mine is not None and theirs:
                    ratios.append(mine / theirs)
            out["ratio_to_base"][model][mode] = {
                "per_round": ratios,
                "median": statistics.median(ratios) if ratios else None,
            }
    return out


def reference_rows(summary: dict[str, Any], models: Sequence[str], modes: Sequence[str]) -> list[dict[str, Any]]:
    """Each mode against its reference, per model (medians over starts): ``concat`` and
    ``reorder`` against the exact prefix hit, a recompute mode against its recompute bound
    (``concat`` plus the extra its recomputed tokens cost an exact hit)."""
    rows: list[dict[str, Any]] = []
    for model in models:
        median = {m: summary["per_model"][model][m]["median_s"] for m in modes}
        exact = median.get(EXACT_HIT)
        for mode in modes:
            kind = mode.split(":")[0]
            if kind in TARGETS:
                reference, ref_s, target = EXACT_HIT, exact, TARGETS[kind]
            elif recompute_bound_name(mode) in median:
                extra = median[recompute_bound_name(mode)]
                concat = median.get("concat")
                reference, target = "concat + its recomputed tokens' prefill", RECOMPUTE_TARGET
                ref_s = (
                    None if extra is None or exact is None else extra if concat is None else concat + (extra - exact)
                )
            else:
                continue
            mode_s = median[mode]
            rows.append(
                {
                    "model": model,
                    "mode": mode,
                    "mode_s": mode_s,
                    "reference": reference,
                    "reference_s": ref_s,
                    "target": target,
                    "ratio": None if not mode_s or not ref_s else mode_s / ref_s,
                }
            )
    return rows


def markdown(summary: dict[str, Any], models: Sequence[str], modes: Sequence[str], base: str = "base") -> str:
    def ms(value: Optional[float]) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f}"

    lines = [
        "| model | mode | median TTFT (ms) | per start, in round order (ms) | spread between starts |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for model in models:
        for mode in modes:
            s = summary["per_model"][model][mode]
            spread = "n/a" if s["spread"] is None else f"{(s['spread'] - 1) * 100:.0f}%"
            lines.append(
                f"| {model} | {mode} | {ms(s['median_s'])} | {', '.join(ms(v) for v in s['starts'])} | {spread} |"
            )
    targets = reference_rows(summary, models, modes)
    if targets:
        lines += [
            "",
            "| model | mode | median TTFT (ms) | reference | reference TTFT (ms) | ratio | target |",
            "| --- | --- | ---: | --- | ---: | ---: | --- |",
        ]
        for row in targets:
            verdict = "n/a" if row["ratio"] is None else ("met" if row["ratio"] <= row["target"] else "missed")
            ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            lines.append(
                f"| {row['model']} | {row['mode']} | {ms(row['mode_s'])} | {row['reference']} "
                f"| {ms(row['reference_s'])} | {ratio} | <= {row['target']:.2f}x: {verdict} |"
            )
    for model, by_mode in summary["ratio_to_base"].items():
        lines += ["", f"| {model} / {base}, same round | median | per round |", "| --- | ---: | --- |"]
        for mode in modes:
            r = by_mode[mode]
            median = "n/a" if r["median"] is None else f"{(r['median'] - 1) * 100:+.1f}%"
            lines.append(f"| {mode} | {median} | {', '.join(f'{(x - 1) * 100:+.0f}%' for x in r['per_round'])} |")
    return "\n".join(lines) + "\n"


def measure_start(
    server: Any,
    warmup_prompts: Sequence[Any],
    prompts: Sequence[Any],
    specs: Sequence[Any],
    full_mode: str = FULL,
    chunk_size: int = 1,
) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    """On one server: ``warmup_prompts`` sent once in every mode, not counted; then every
    prompt unmarked (as ``full_mode``) and in every spec. Returns the median TTFT per mode,
    and per mode the failed requests and those not served as measured (an unmarked one that
    hit the cache, a marked one that did not reuse every document), both left out of the
    medians."""

    def streamed_meta(body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """TTFT and ``meta_info`` of a streamed request; an error SGLang sent inside the
        stream (HTTP 200, then an ``error`` chunk) or an aborted request raises."""
        streamed = server.generate_stream(body)
        meta = streamed.final.get("meta_info")
        if "error" in streamed.final or not isinstance(meta, dict):
            raise RuntimeError(f"the stream ended with {str(streamed.final)[:200]}")
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            raise RuntimeError(f"aborted: {meta['finish_reason']}")
        return streamed.ttft_s, meta

    def one(p: Any, spec: Any, key: str) -> tuple[float, bool]:
        """(TTFT, whether it was served as measured: unmarked, from a cold cache; marked,
        reusing every document; the exact prefix hit, hitting its documents)."""
        sampling = {"temperature": 0.0, "max_new_tokens": 1}
        if spec is None:
            ttft, meta = streamed_meta({"input_ids": p.input_ids, "sampling_params": sampling, "extra_key": key})
            return ttft, int(meta.get("cached_tokens", 0)) == 0
        if isinstance(spec, tuple):  # (EXACT_HIT, tokens recomputed by the mode it bounds)
            cached_end = p.last_doc_end - spec[1](p.doc_bounds)
            server.generate({"input_ids": p.input_ids[:cached_end], "sampling_params": sampling, "extra_key": key})
            ttft, meta = streamed_meta({"input_ids": p.input_ids, "sampling_params": sampling, "extra_key": key})
            cached = int(meta.get("cached_tokens", 0))
            return ttft, cached >= cached_end - cached_end % max(1, chunk_size)
        server.generate(warm_request(p, spec, key))
        ttft, meta = streamed_meta(marked_request(p, spec, 1, key))
        return ttft, all_docs_reused(p, spec, int(meta.get("cached_tokens", 0)), chunk_size)

    runs: list[tuple[str, Any]] = [(full_mode, None), *((spec.name, spec) for spec in specs)]
    if specs:
        runs.append((EXACT_HIT, (EXACT_HIT, lambda bounds: 0)))
        runs += [
            (recompute_bound_name(spec.name), (EXACT_HIT, spec.recomputed_if_all_reused))
            for spec in specs
            if spec.mode in ("blend", "lego")
        ]
    for i, p in enumerate(warmup_prompts):
        for name, spec in runs:
            try:
                one(p, spec, f"ttft-warmup-{name}-{i}")
            except Exception as e:  # noqa: BLE001 - a warm-up request is not measured
                logger.warning("warm-up request %s (%s) failed: %s", i, name, e)
    ttfts: dict[str, list[float]] = {name: [] for name, _ in runs}
    errors = {name: 0 for name, _ in runs}
    not_reused = {name: 0 for name, _ in runs}
    for i, p in enumerate(prompts):
        for name, spec in runs:
            try:
                ttft, reused = one(p, spec, f"ttft-{name}-{i}")
            except Exception as e:  # noqa: BLE001 - one failed request must not lose the run
                logger.error("request %s (%s) failed: %s", i, name, e)
                errors[name] += 1
                continue
            if math.isnan(ttft):
                errors[name] += 1  # no data chunk came back
            elif not reused:
                not_reused[name] += 1
            else:
                ttfts[name].append(ttft)
    medians = {name: statistics.median(values) for name, values in ttfts.items() if values}
    return medians, errors, not_reused


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    intro, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        prog="python -m bench.reuse_ttft",
        description=intro,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=details,
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each starts two servers per model (default 4)")
    parser.add_argument(
        "--questions",
        type=int,
        default=12,
        help="test-split questions measured on every start, the kinds in turn (default 12)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="questions (of another seed) sent first on every start, not counted (default 2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the measured questions' seed (default 0)")
    parser.add_argument(
        "--models",
        default="base,tuned",
        help="comma-separated: base (SmolLM2-135M-Instruct), tuned (with the document-reuse "
        "adapter merged); the tuned / base ratios need both (default base,tuned)",
    )
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=parse_modes("concat,blend:0.15:gradual,reorder"),
        help="document-reuse configurations, as bench.doc_reuse_accuracy names them "
        "(default: concat,blend:0.15:gradual,reorder); full prefill and every mode's reference "
        "(an exact prefix hit of the same tokens; a recompute mode's bound) are always measured",
    )
    parser.add_argument("--chunk-size", type=int, default=16, help="--pcr-chunk-size (default 16)")
    parser.add_argument(
        "--max-total-tokens", type=int, default=60000, help="device KV pool of every server (default 60000)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(f"bench/results/{datetime.date.today().isoformat()}/reuse_ttft"),
        help="where the JSON result and the markdown report go (default: bench/results/<today>/reuse_ttft)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.questions < 1 or args.warmup < 0:
        parser.error("--rounds and --questions must be >= 1, --warmup >= 0")
    unknown = {m.strip() for m in args.models.split(",")} - {"base", "tuned"}
    if unknown or not args.models.strip():
        parser.error(f"--models: base and/or tuned, not {sorted(unknown) or 'nothing'}")

    from transformers import AutoTokenizer

    from pcr_tools.launcher import ServerProcess
    from pcr_tools.models.smollm2 import build_smollm2
    from pcr_tools.tune.questions import question_set

    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", file=sys.stderr, flush=True)

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    paths = {m: str(build_smollm2(doc_reuse_tuned=(m == "tuned"))) for m in models}
    tokenizer = AutoTokenizer.from_pretrained(paths[models[0]])
    measured = gold_prompts(question_set("test", args.questions, args.seed), tokenizer, args.seed)
    warmup_seed = args.seed + WARMUP_SEED_OFFSET
    warmup_prompts = gold_prompts(question_set("test", args.warmup, warmup_seed), tokenizer, warmup_seed)
    modes = [FULL_NO_CACHE, FULL, *(spec.name for spec in args.modes)]
    modes += [EXACT_HIT, *(recompute_bound_name(spec.name) for spec in args.modes if spec.mode in ("blend", "lego"))]
    common = ("--max-total-tokens", str(args.max_total_tokens), *COMMON_SERVER_ARGS)
    servers: dict[str, tuple[tuple[str, ...], str, Sequence[Any]]] = {
        "no-cache": (("--disable-radix-cache", *common), FULL_NO_CACHE, ()),
        "doc-reuse": ((*doc_reuse_server_flags(server_mode(args.modes), args.chunk_size), *common), FULL, args.modes),
    }
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.reuse_ttft " + shlex.join(argv)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "questions": len(measured),
        "warmup": len(warmup_prompts),
        "rounds": args.rounds,
        "server_args": {name: list(flags) for name, (flags, _, _) in servers.items()},
        "machine": machine(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset (one per core)"),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    failed_starts: list[str] = []
    starts: list[StartResult] = []

    def write(final: bool) -> dict[str, Any]:
        summary = summarize(starts, models, modes)
        meta["elapsed_s"] = round(time.monotonic() - started, 1)
        meta["complete"] = final
        (args.out / f"{stamp}.json").write_text(
            json.dumps({"meta": meta, "starts": [asdict(s) for s in starts], "summary": summary}, indent=1)
        )
        return summary

    for r in range(args.rounds):
        for model in model_order(models, r):
            for kind, (flags, full_mode, specs) in servers.items():
                progress(f"round {r + 1}/{args.rounds}: starting the {model} {kind} server...")
                server = ServerProcess(paths[model], flags)
                try:
                    server.start()
                    medians, errors, not_reused = measure_start(
                        server, warmup_prompts, measured, specs, full_mode, args.chunk_size
                    )
                except Exception as e:  # noqa: BLE001 - a failed start must not lose the other rounds
                    logger.error("round %d: the %s %s server failed: %s", r + 1, model, kind, e)
                    failed_starts.append(f"round {r + 1} {model} {kind}: {type(e).__name__}")
                    continue
                finally:
                    server.kill()  # nothing of it is wanted; a graceful stop costs seconds
                starts.append(
                    StartResult(model, r, kind, round(server.startup_seconds, 1), medians, errors, not_reused)
                )
                progress(
                    f"round {r + 1}: {model} {kind}: "
                    + ", ".join(f"{m} {v * 1000:.0f} ms" for m, v in medians.items())
                    + f" ({sum(errors.values())} failed, {sum(not_reused.values())} not as measured)"
                )
                write(final=False)
    meta["failed_starts"] = failed_starts
    summary = write(final=True)
    failed = sum(sum(s.errors.values()) for s in starts)
    skipped = sum(sum(s.not_reused.values()) for s in starts)
    report = markdown(summary, models, modes)
    notes = [
        f"{failed} requests failed" if failed else "",
        f"{skipped} requests not served as measured (left out)" if skipped else "",
        f"failed starts: {'; '.join(failed_starts)}" if failed_starts else "",
    ]
    (args.out / f"{stamp}.md").write_text(
        f"# TTFT of the base and tuned models over server starts ({meta['date']})\n\n`{command}`: "
        f"{len(measured)} test-split questions a start ({len(warmup_prompts)} more first, not counted), "
        f"{args.rounds} rounds of two server starts a model, models alternating, "
        f"{meta['elapsed_s'] / 60:.1f} min, {meta['machine']}, OMP_NUM_THREADS {meta['omp_num_threads']}, "
        f"load average {meta['load_average_at_start'][0]} at the start."
        f"{''.join(f' {n}.' for n in notes if n)}\n\n{report}"
    )
    print(report)
    progress(f"wrote {args.out / stamp}.md and .json")
    return 1 if failed or skipped or failed_starts else 0
