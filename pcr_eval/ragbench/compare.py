"""The RAG serving benchmark: PCR against SGLang's radix cache, HiCache and the oracle.

    python -m bench.ragbench                 # the full comparison (under 30 min on 2 CPU cores)
    python -m bench.ragbench --quick         # the headline trace only: no sweeps, no cross-check
    python -m bench.ragbench generate --out trace.jsonl [--followups 2] [--source synthetic]
    python -m bench.ragbench operating-points   # document reuse at 50% / 80% of no-cache capacity, repeated
    python -m bench.ragbench headline [--quick]  # the tuned model at 30/60/90% load: radix, HiCache, PCR, reuse
    python -m bench.ragbench one-at-a-time       # the headline trace one request at a time: per-request cost

The full comparison: one seeded retrieval trace with the device pool at 5% of its working
set, every configuration at each ``--rates`` entry (ablations at the highest rate); then,
at the highest rate, the Zipf-exponent sweep (pcr, oracle), the pool-fraction sweep
(radix, pcr) and the multi-turn workload (radix, hicache, pcr, oracle); then
SGLang's own ``sglang.benchmark.serving`` client against radix, hicache and pcr. Writes
``report.json``, ``report.md`` and PNG plots under ``--out``, with the traces as JSONL.
HiCache and PCR get a fresh server for each run (about 35 s to start on two cores, mostly
imports); radix and oracle servers, whose cache a flush empties, are kept and flushed
between runs.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import requests

from pcr_eval.ragbench.common import (
    Model,
    budgets_for,
    config_list,
    float_list,
    trace_shape,
    workload_args,
    workload_params,
)
from pcr_eval.ragbench.report import build_report, write_report
from pcr_eval.ragbench.runner import (
    CONFIG_NAMES,
    DEFAULT_CONFIGS,
    DOC_REUSE_CONFIGS,
    RunResult,
    ServerPool,
    build_hicache_extension,
    plan_run,
    run_planned,
)
from pcr_eval.ragbench.workload import Trace, calibrated_exponent, load_trace, make_trace, save_trace
from pcr_tools.launcher import cpu_only

logger = logging.getLogger(__name__)

MAIN_CONFIGS = ("radix", "hicache", "pcr", "oracle")
# The Zipf sweep runs PCR and the oracle only, to keep the whole comparison within 30 minutes
# on two cores (each server start costs about 35 s there): it shows how the reuse potential
# (oracle) and PCR's share of it move with the skew. The baselines are in the headline.
ZIPF_SWEEP_CONFIGS = ("pcr", "oracle")
POOL_SWEEP_CONFIGS = ("radix", "pcr")  # the oracle's pool does not depend on the fraction


@dataclass(frozen=True)
class Point:
    """One trace at one device-pool fraction: the unit runs are grouped by."""

    label: str
    trace: Trace
    pool_fraction: float
    configs: tuple[str, ...]
    rates: tuple[float, ...]


def plan(args: argparse.Namespace, model: Model, out_dir: Path) -> list[Point]:
    def trace_for(label: str, **overrides) -> Trace:
        path = out_dir / f"trace-{label}.jsonl"
        if args.trace and label == "headline":
            return load_trace(Path(args.trace))
        trace = make_trace(workload_params(args, **overrides), count_tokens=model.count_tokens)
        save_trace(trace, path)
        return trace

    top = (max(args.rates),)
    headline = trace_for("headline")
    # Document reuse runs at every rate; PCR's ablations at the top one.
    points = [
        Point(
            "headline",
            headline,
            args.pool_fraction,
            tuple(c for c in args.configs if not c.startswith("pcr-") or c in DOC_REUSE_CONFIGS),
            args.rates,
        )
    ]
    ablations = tuple(c for c in args.configs if c.startswith("pcr-") and c not in DOC_REUSE_CONFIGS)
    if ablations:
        points.append(Point("headline", headline, args.pool_fraction, ablations, top))
    if args.quick:
        return points
    sweep_configs = tuple(c for c in MAIN_CONFIGS if c in args.configs)
    for z in args.zipf_sweep:
        points.append(
            Point(
                f"zipf-{z:g}",
                trace_for(f"zipf-{z:g}", zipf_exponent=z, num_requests=args.sweep_requests),
                args.pool_fraction,
                tuple(c for c in ZIPF_SWEEP_CONFIGS if c in args.configs),
                top,
            )
        )
    for fraction in args.pool_sweep:
        if fraction != args.pool_fraction:
            points.append(
                Point("headline", headline, fraction, tuple(c for c in POOL_SWEEP_CONFIGS if c in args.configs), top)
            )
    if args.multiturn_followups:
        points.append(
            Point(
                "multiturn",
                trace_for("multiturn", followups=args.multiturn_followups, num_requests=args.multiturn_sessions),
                args.pool_fraction,
                sweep_configs,
                top,
            )
        )
    return points


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["generate"]:
        return generate(argv[1:])
    if argv[:1] == ["headline"]:
        from pcr_eval.ragbench.headline import main as headline

        return headline(argv[1:])
    if argv[:1] == ["one-at-a-time"]:
        from pcr_eval.ragbench.one_at_a_time import main as one_at_a_time

        return one_at_a_time(argv[1:])
    if argv[:1] == ["operating-points"]:
        from pcr_eval.ragbench.operating_points import main as operating_points

        return operating_points(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m bench.ragbench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(f"bench/results/{datetime.date.today().isoformat()}/ragbench"),
        help="where the report, plots, traces and server logs go (default: bench/results/<today>/ragbench)",
    )
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct (built offline)")
    parser.add_argument(
        "--configs",
        type=config_list,
        default=DEFAULT_CONFIGS,
        help=f"comma-separated subset of {','.join(CONFIG_NAMES)} "
        f"(default: all but nocache,pcr-docs-eager,pcr-docs-idle)",
    )
    parser.add_argument(
        "--rates",
        type=float_list,
        default=(0.5, 1.25),
        help="first turns per second; SmolLM2 on two cores serves 0.5-0.9/s with a 5%% pool, "
        "so at 1.25/s the waiting queue averages 4 or more (the issue's headline load)",
    )
    parser.add_argument(
        "--pool-fraction", type=float, default=0.05, help="device KV pool as a fraction of the trace's working set"
    )
    parser.add_argument(
        "--host-fraction",
        type=float,
        default=0.25,
        help="host-memory budget (PCR and HiCache) as a fraction of the working set",
    )
    parser.add_argument("--chunk-size", type=int, default=16, help="PCR chunk = HiCache page, in tokens")
    parser.add_argument(
        "--zipf-sweep",
        type=float_list,
        default=(0.6, 0.9, 1.2),
        help="topic-popularity exponents, one trace each (pcr and oracle at the top rate)",
    )
    parser.add_argument("--sweep-requests", type=int, default=12, help="requests in each Zipf-sweep trace")
    parser.add_argument(
        "--pool-sweep",
        type=float_list,
        default=(0.05, 0.20),
        help="device pool fractions of the headline trace (at the top rate)",
    )
    parser.add_argument("--multiturn-sessions", type=int, default=5, help="sessions in the multi-turn workload")
    parser.add_argument(
        "--multiturn-followups",
        type=int,
        default=2,
        help="follow-ups per session in the multi-turn workload (0: skip it)",
    )
    parser.add_argument("--trace", default=None, help="replay this JSONL trace as the headline trace")
    parser.add_argument("--no-cross-check", action="store_true", help="skip the sglang.benchmark.serving cross-check")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: the headline trace only, no sweeps, no cross-check"
    )
    workload_args(parser)
    args = parser.parse_args(argv)
    if not 0 < args.pool_fraction <= 1 or not 0 < args.host_fraction:
        parser.error("--pool-fraction must be in (0, 1] and --host-fraction > 0")
    if any(r <= 0 for r in args.rates):
        parser.error("--rates must be > 0")
    if args.sweep_requests < 1 or args.multiturn_sessions < 1:
        parser.error("--sweep-requests and --multiturn-sessions must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tqdm import tqdm

    from pcr_tools.models.smollm2 import build_smollm2

    started = time.monotonic()
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Model(args.model_path or str(build_smollm2()))
    points = plan(args, model, out_dir)
    shapes = {id(p.trace): trace_shape(p.trace, model, args.chunk_size) for p in points}
    total = sum(len(p.trace.requests) * len(p.configs) * len(p.rates) for p in points)
    runs: list[RunResult] = []
    work = out_dir / "runs"  # server logs; each run's storage directory is removed after it
    work.mkdir(exist_ok=True)
    meta_traces = {}
    failed: list[str] = []
    budgets = {
        id(p): budgets_for(
            shapes[id(p.trace)], p.pool_fraction, args.host_fraction, args.chunk_size, model.kv_bytes_per_token()
        )
        for p in points
    }
    # One oracle server serves every trace (the pool of the largest), flushed between runs.
    oracle_budgets = {
        "oracle_pool_tokens": max(b.oracle_pool_tokens for b in budgets.values()),
        "context_length": max(b.context_length for b in budgets.values()),
    }
    planned = []
    for point in points:
        shape = shapes[id(point.trace)]
        meta_traces[point.label] = (
            f"{len(point.trace.requests)} requests, {shape['working_set']} working-set tokens "
            f"(first turns), longest prompt {shape['longest']} tokens, "
            f"Zipf {point.trace.stats['zipf_exponent']:.2f} (top 3% of documents: "
            f"{point.trace.stats['hot_doc_share']:.0%} of uses), follow-ups {point.trace.params.followups}"
        )
        for rate in point.rates:
            for config in point.configs:
                run_budgets = budgets[id(point)]
                if config == "oracle":
                    run_budgets = replace(run_budgets, **oracle_budgets)
                planned.append(plan_run(config, run_budgets, point.trace, rate, point.label, point.pool_fraction, work))
    if "hicache" in args.configs:
        build_hicache_extension()
    servers = ServerPool(model.path, [r.plan for r in planned])
    with tqdm(total=total, unit="req", dynamic_ncols=True) as bar, servers:
        for index, run in enumerate(planned):
            bar.set_description(f"{run.label} {run.config} @{run.rate:g}/s pool {run.pool_fraction:.0%}")
            try:
                result = run_planned(
                    run,
                    servers,
                    index,
                    lambda r, a, t=run.trace: model.prompt(t, r, a),
                    model.decode,
                    on_done=lambda: bar.update(1),
                )
            except (RuntimeError, TimeoutError, OSError, requests.RequestException) as e:
                # A server that would not start or failed mid-run: say so, go on.
                logger.error("%s %s @%g/s failed: %s", run.label, run.config, run.rate, e)
                failed.append(
                    f"{run.label}/{run.config}@{run.rate:g} (pool {run.pool_fraction:.0%}): "
                    f"{str(e).splitlines()[-1][:200] if str(e) else type(e).__name__}"
                )
                continue
            result.server_state["budgets"] = run.budgets.__dict__
            runs.append(result)
    cross = None
    if not args.quick and not args.no_cross_check:
        from pcr_eval.ragbench.cross_check import run_cross_check

        headline = points[0]
        like = budgets_for(
            shapes[id(headline.trace)],
            headline.pool_fraction,
            args.host_fraction,
            args.chunk_size,
            model.kv_bytes_per_token(),
        )
        cross = run_cross_check(
            model.path,
            like,
            tuple(c for c in ("radix", "hicache", "pcr") if c in args.configs),
            rate=max(args.rates),
            work_dir=work,
            pool_fraction=args.pool_fraction,
            host_fraction=args.host_fraction,
            bytes_per_token=model.kv_bytes_per_token(),
        )
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {_cpu_count()} CPU cores, no GPU" if cpu_only() else platform.machine(),
        "model": Path(model.path).name,
        "command": "python -m bench.ragbench " + shlex.join(argv),
        "traces": meta_traces,
        "headline_label": "headline",
        "headline_pool_fraction": args.pool_fraction,
        "elapsed_s": time.monotonic() - started,
        "cross_check": cross,
        "failed_runs": failed,
    }
    report = build_report(runs, meta)
    paths = write_report(report, out_dir)
    print((out_dir / "report.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if report["outputs_identical"] and not failed else 1


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ragbench generate", description="Write a seeded RAG trace as JSONL."
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--model-path", default=None, help="tokenizer for synthetic document lengths (default: SmolLM2-135M-Instruct)"
    )
    workload_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    count_tokens = None
    if args.source == "synthetic":
        from pcr_tools.models.smollm2 import build_smollm2

        count_tokens = Model(args.model_path or str(build_smollm2())).count_tokens
    trace = make_trace(workload_params(args), count_tokens=count_tokens)
    save_trace(trace, args.out)
    s = trace.stats
    print(
        f"wrote {args.out}: {len(trace.requests)} requests over {len(trace.documents)} documents; "
        f"Zipf {s['zipf_exponent']:.3f} (calibrated would be {calibrated_exponent(args.corpus_docs):.3f}); "
        f"top 3% of documents carry {s['hot_doc_share']:.0%} of {s['doc_uses']} uses; "
        f"{s['distinct_docs_used']} distinct documents used"
    )
    return 0
