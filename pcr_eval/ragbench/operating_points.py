"""Document reuse at the operating points a user would serve at, repeated, with medians.

    python -m bench.ragbench operating-points                       # about 25 min on 2 cores
    python -m bench.ragbench operating-points --repeats 1 --requests 12   # a smoke run
    python -m bench.ragbench operating-points --repeats 0 --capacity-rps 0.6   # the 80% rate alone

1. The device pool holds ``--batch-prompts`` of the trace's longest prompts (so several
   requests batch) while the trace's working set stays several times larger (printed).
2. The no-cache capacity: a ``--disable-radix-cache`` server on that pool is sent every
   first turn at once; capacity = first turns / makespan.
3. Every configuration replays the trace at 50% of that capacity ``--repeats`` times and at
   80% ``--high-repeats`` times, configurations interleaved within each repeat so that the
   machine's noise falls on all of them alike. Each repeat's ratios are taken within the
   repeat (same trace, same minutes); the table gives their medians.
4. The issue's targets are checked at the 50% rate and printed as met or missed.

Writes ``report.json`` / ``report.md`` (every run, as the main benchmark does) and
``operating_points.json`` / ``operating_points.md`` (the medians) under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import requests

from pcr_eval.ragbench.common import (
    Model,
    batch_pool_budgets,
    config_list,
    machine,
    trace_shape,
    workload_args,
    workload_params,
)
from pcr_eval.ragbench.report import build_report, write_report
from pcr_eval.ragbench.runner import (
    Budgets,
    PlannedRun,
    RequestRecord,
    RunResult,
    ServerPool,
    plan_run,
    replay,
    run_planned,
)
from pcr_eval.ragbench.workload import Trace, make_trace, save_trace

logger = logging.getLogger(__name__)

DEFAULT_CONFIGS = ("radix", "oracle", "pcr-docs", "pcr-blend-pre")
# Fractions of the measured no-cache capacity the issue asks for.
LOW_LOAD, HIGH_LOAD = 0.5, 0.8
# The targets at the 50% rate: reuse against the prefix oracle's, and mean TTFT
# against the oracle's (precomputed corpus, lego or blend mode); reuse without precompute.
TARGETS = (
    ("pcr-blend-pre", "reuse_vs_oracle", ">=", 3.0),
    ("pcr-blend-pre", "mean_vs_oracle", "<=", 1 / 3),
    ("pcr-docs", "reuse_vs_oracle", ">=", 1.25),
)
MEDIAN_FIELDS = (
    "ttft_mean_ms",
    "ttft_p99_ms",
    "hit_ratio",
    "reuse_vs_oracle",
    "mean_vs_radix",
    "mean_vs_oracle",
    "throughput_rps",
    "queue_depth_mean",
)


@dataclass(frozen=True)
class Capacity:
    """The no-cache server's saturated throughput on the trace's first turns."""

    requests: int
    makespan_s: float

    @property
    def rps(self) -> float:
        return self.requests / self.makespan_s


def run_all(
    planned: Sequence[PlannedRun], names: Sequence[tuple[str, str]], model: Model, trace: Trace
) -> tuple[list[Optional[RunResult]], list[str]]:
    """Replay every planned run in order on one server pool, with one progress bar: each
    run's result (None where it failed), and the failures as ``"<key>: <reason>"``.
    ``names[i]`` is run ``i``'s progress label and the key its failure is reported under."""
    from tqdm import tqdm

    results: list[Optional[RunResult]] = []
    failed: list[str] = []
    servers = ServerPool(model.path, [run.plan for run in planned])
    with tqdm(total=len(planned) * len(trace.requests), unit="req", dynamic_ncols=True) as bar, servers:
        for index, (run, (label, key)) in enumerate(zip(planned, names)):
            bar.set_description(label)
            try:
                result = run_planned(
                    run,
                    servers,
                    index,
                    lambda r, a: model.prompt(trace, r, a),
                    model.decode,
                    on_done=lambda: bar.update(1),
                )
            except (RuntimeError, TimeoutError, OSError, requests.RequestException) as e:
                logger.error("%s failed: %s", label, e)
                reason = str(e).splitlines()[-1][:200] if str(e) else type(e).__name__
                failed.append(f"{key}: {reason}")
                results.append(None)
                continue
            result.server_state["budgets"] = run.budgets.__dict__
            results.append(result)
    return results, failed


def saturate(server: Any, model: Model, trace: Trace, label: str) -> tuple[Capacity, list[RequestRecord]]:
    """Every first turn sent at once to ``server``: its throughput, and the records (a
    failed request raises, naming ``label``)."""
    records, makespan, _ = replay(server, trace, lambda r, a: model.prompt(trace, r, a), model.decode, 1e6)
    failed = [r for r in records if r.error is not None]
    if failed:
        raise RuntimeError(f"{label}: {len(failed)} of {len(records)} requests failed: {failed[0].error}")
    return Capacity(len(records), makespan), records


def measure_capacity(model: Model, trace: Trace, budgets: Budgets, work_dir: Path) -> Capacity:
    """Every first turn at once to a ``--disable-radix-cache`` server on the run's pool."""
    run = plan_run("nocache", budgets, trace, 1e6, "capacity", 0.0, work_dir)
    with ServerPool(model.path, [run.plan]) as servers:
        server, _ = servers.acquire(0)
        try:
            capacity, _ = saturate(server, model, trace, "capacity run")
        finally:
            servers.release(0, server)
    return capacity


def medians(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per configuration and rate: the medians over repeats of each run's figures, its
    ratios taken against the baselines of the same repeat."""
    runs = report["runs"]
    rows: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for s in runs:
        same = {o["config"]: o for o in runs if o["label"] == s["label"] and o["rate"] == s["rate"]}
        oracle = same.get("oracle")
        values = {
            "ttft_mean_ms": s["ttft_ms"]["mean"],
            "ttft_p99_ms": s["ttft_ms"]["p99"],
            "hit_ratio": s["hit_ratio"],
            "reuse_vs_oracle": s.get("reuse_vs_oracle"),
            "throughput_rps": s["throughput_rps"],
            "queue_depth_mean": s["queue_depth_mean"],
            "mean_vs_radix": (s["ttft_ms"]["mean"] / same["radix"]["ttft_ms"]["mean"] if "radix" in same else None),
            "mean_vs_oracle": (s["ttft_ms"]["mean"] / oracle["ttft_ms"]["mean"] if oracle else None),
            "errors": s["errors"],
        }
        rows.setdefault((s["config"], s["rate"]), []).append(values)
    table = []
    for (config, rate), repeats in rows.items():
        row: dict[str, Any] = {
            "config": config,
            "rate": rate,
            "repeats": len(repeats),
            "errors": sum(r["errors"] for r in repeats),
        }
        for name in MEDIAN_FIELDS:
            values = [r[name] for r in repeats if r[name] is not None]
            row[name] = statistics.median(values) if values else None
            row[f"{name}_range"] = (min(values), max(values)) if values else None
        table.append(row)
    return sorted(table, key=lambda r: (r["rate"], r["config"]))


def check_targets(table: list[dict[str, Any]], low_rate: float) -> list[dict[str, Any]]:
    checks = []
    for config, field_name, op, target in TARGETS:
        row = next((r for r in table if r["config"] == config and r["rate"] == low_rate), None)
        value = row.get(field_name) if row else None
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        checks.append(
            {"config": config, "figure": field_name, "target": f"{op} {target:.2f}", "value": value, "met": met}
        )
    return checks


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def markdown(meta: dict[str, Any], table: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    lines = [
        f"# Document reuse at operating points ({meta['date']})",
        "",
        f"Machine: {meta['machine']}. Command: `{meta['command']}`.",
        "",
        f"- trace: {meta['trace']}",
        f"- device pool: {meta['pool_tokens']} tokens ({meta['batch_prompts']} longest prompts; the working set "
        f"is {meta['working_set_over_pool']:.1f}x the pool)",
        f"- no-cache capacity: {meta['capacity_rps']:.2f} first turns/s ({meta['capacity_requests']} at once in "
        f"{meta['capacity_makespan_s']:.1f} s); rates {meta['low_rate']:g} (50%) and {meta['high_rate']:g} (80%)",
        f"- elapsed: {meta['elapsed_s'] / 60:.1f} min",
        "",
        "| rate | config | repeats | TTFT mean (median) | range | P99 | hit ratio | reuse vs oracle | "
        "mean vs radix | mean vs oracle | req/s | queue | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in table:
        low, high = r["ttft_mean_ms_range"] or (None, None)
        lines.append(
            f"| {r['rate']:g} | {r['config']} | {r['repeats']} | {_fmt(r['ttft_mean_ms'], '{:.0f}')} ms | "
            f"{_fmt(low, '{:.0f}')}-{_fmt(high, '{:.0f}')} | {_fmt(r['ttft_p99_ms'], '{:.0f}')} ms | "
            f"{_fmt(r['hit_ratio'], '{:.0%}')} | {_fmt(r['reuse_vs_oracle'], '{:.2f}x')} | "
            f"{_fmt(r['mean_vs_radix'], '{:.2f}x')} | {_fmt(r['mean_vs_oracle'], '{:.2f}x')} | "
            f"{_fmt(r['throughput_rps'], '{:.2f}')} | {_fmt(r['queue_depth_mean'], '{:.1f}')} | {r['errors']} |"
        )
    lines += [
        "",
        "Medians over the repeats; ratios are taken within each repeat, then their median. "
        "Reuse vs oracle: prompt tokens reused over what the oracle (a prefix cache that never evicts) "
        "reused in the same repeat.",
        "",
        "Targets at the 50% rate:",
        "",
    ]
    for c in checks:
        verdict = "not measured" if c["met"] is None else ("met" if c["met"] else "MISSED")
        lines.append(f"- {c['config']} {c['figure']} {c['target']}: {_fmt(c['value'], '{:.2f}')} ({verdict})")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ragbench operating-points",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(f"bench/results/{datetime.date.today().isoformat()}/ragbench-operating-points"),
        help="where the report, traces and server logs go (default: bench/results/<today>/ragbench-operating-points)",
    )
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct (built offline)")
    parser.add_argument(
        "--configs",
        type=config_list,
        default=DEFAULT_CONFIGS,
        help="comma-separated configurations (default: %(default)s); the targets need "
        "oracle, pcr-docs and pcr-blend-pre",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each configuration at the 50%% rate (0: only the 80%% rate)"
    )
    parser.add_argument("--high-repeats", type=int, default=1, help="runs of each configuration at the 80%% rate")
    parser.add_argument(
        "--batch-prompts",
        type=int,
        default=3,
        help="device pool in longest prompts (plus slack): how many requests can batch",
    )
    parser.add_argument(
        "--host-fraction", type=float, default=0.25, help="host-memory budget (PCR) as a fraction of the working set"
    )
    parser.add_argument("--chunk-size", type=int, default=16, help="PCR chunk, in tokens")
    parser.add_argument(
        "--capacity-rps",
        type=float,
        default=None,
        help="skip the capacity run and use this no-cache capacity (first turns/s)",
    )
    workload_args(parser)
    parser.set_defaults(requests=30)
    args = parser.parse_args(argv)
    if args.repeats < 0 or args.high_repeats < 0 or args.repeats + args.high_repeats < 1 or args.batch_prompts < 1:
        parser.error("--repeats and --high-repeats must be >= 0 and not both 0, --batch-prompts >= 1")
    if args.capacity_rps is not None and args.capacity_rps <= 0:
        parser.error("--capacity-rps must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from pcr_tools.models.smollm2 import build_smollm2

    started = time.monotonic()
    out_dir: Path = args.out
    work = out_dir / "runs"
    work.mkdir(parents=True, exist_ok=True)
    model = Model(args.model_path or str(build_smollm2()))
    trace = make_trace(workload_params(args), count_tokens=model.count_tokens)
    save_trace(trace, out_dir / "trace.jsonl")
    shape = trace_shape(trace, model, args.chunk_size)
    budgets, fraction = batch_pool_budgets(
        shape, args.batch_prompts, args.host_fraction, args.chunk_size, model.kv_bytes_per_token()
    )
    pool_tokens = budgets.device_pool_tokens
    logger.info(
        "pool %d tokens; working set %d tokens (%.1fx the pool)",
        pool_tokens,
        shape["working_set"],
        shape["working_set"] / pool_tokens,
    )
    if args.capacity_rps is None:
        capacity = measure_capacity(model, trace, budgets, work)
    else:
        capacity = Capacity(len(trace.first_turns()), len(trace.first_turns()) / args.capacity_rps)
    low, high = round(LOW_LOAD * capacity.rps, 3), round(HIGH_LOAD * capacity.rps, 3)
    logger.info("no-cache capacity %.2f first turns/s: rates %g and %g", capacity.rps, low, high)

    planned = []
    for repeat in range(max(args.repeats, args.high_repeats)):
        for rate in [r for r, n in ((low, args.repeats), (high, args.high_repeats)) if repeat < n]:
            for config in args.configs:
                # The oracle's server takes its never-evicting pool from the same budgets.
                planned.append(plan_run(config, budgets, trace, rate, f"repeat-{repeat + 1}", fraction, work))
    results, failed = run_all(
        planned,
        [(f"{run.label} {run.config} @{run.rate:g}/s", f"{run.label}/{run.config}@{run.rate:g}") for run in planned],
        model,
        trace,
    )
    runs = [result for result in results if result is not None]
    meta: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": "python -m bench.ragbench operating-points " + shlex.join(argv),
        "trace": (
            f"{len(trace.requests)} requests, {shape['working_set']} working-set tokens, longest prompt "
            f"{shape['longest']} tokens, Zipf {trace.stats['zipf_exponent']:.2f}, documents in "
            f"{trace.params.doc_order} order"
        ),
        "traces": {},
        "pool_tokens": pool_tokens,
        "batch_prompts": args.batch_prompts,
        "working_set_over_pool": shape["working_set"] / pool_tokens,
        "capacity_rps": capacity.rps,
        "capacity_requests": capacity.requests,
        "capacity_makespan_s": capacity.makespan_s,
        "low_rate": low,
        "high_rate": high,
        "failed_runs": failed,
    }
    report = build_report(runs, meta)
    write_report(report, out_dir)
    meta["elapsed_s"] = time.monotonic() - started
    table = medians(report)
    checks = check_targets(table, low)
    (out_dir / "operating_points.json").write_text(
        json.dumps({"meta": meta, "table": table, "targets": checks}, indent=1)
    )
    text = markdown(meta, table, checks)
    (out_dir / "operating_points.md").write_text(text)
    print(text)
    return 0 if report["outputs_identical"] and not failed else 1
