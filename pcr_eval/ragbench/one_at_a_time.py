"""The headline's trace sent one request at a time: what each configuration costs a request.

Under load, TTFT mixes what a configuration costs each request with how requests queue and
batch, and over 30 Poisson arrivals the second dominates (the headline's P99 is its slowest
request). Sent one at a time, no request waits for another: each configuration's TTFT is
its own work, paired request by request across configurations on the same prompts (all
servers up at once, each request sent to each in turn), beside
the CPU seconds its server's processes used (scheduler, detokenizer, PCR's I/O process).
What a configuration loses under load that it does not lose here comes from queueing and
batching, not from its per-request work.

Writes ``one_at_a_time.json`` and ``one_at_a_time.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import shlex
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import requests

from pcr_eval.ragbench.common import (
    config_list,
    machine,
    workload_args,
)
from pcr_eval.ragbench.report import least_squares, reuse_by_tier
from pcr_eval.ragbench.runner import ServerPool, _cached_by_tier, plan_run

logger = logging.getLogger(__name__)

DEFAULT_CONFIGS = ("hicache", "pcr", "radix")
SETTLE_S = 0.3  # after each reply, so write-backs finish before the next request is sent


@dataclass
class Sent:
    """One request's reply on one configuration."""

    rid: str
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    cpu_s: float  # the server's processes, from send to reply
    output_ids: list[int] = field(default_factory=list)
    error: Optional[str] = None  # failed: left out of every figure, counted

    @property
    def uncached(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def summarize(runs: dict[str, list[Sent]], reference: str) -> list[dict[str, Any]]:
    """Per configuration: TTFT mean and median, uncached tokens, reuse by tier, CPU seconds
    per request, the least-squares TTFT per uncached token and intercept, and against
    ``reference`` on the same requests: the median paired TTFT difference (all requests,
    and those computing as many tokens on both) and how many outputs are identical."""
    by_rid = {s.rid: s for s in runs.get(reference, []) if s.error is None}
    rows = []
    for config, every in runs.items():
        sent = [s for s in every if s.error is None]
        ttft = [s.ttft_ms for s in sent]
        xs = [float(s.uncached) for s in sent]
        slope, intercept = least_squares(list(zip(xs, ttft)))
        pairs = [(s, by_rid[s.rid]) for s in sent if s.rid in by_rid]
        same_work = [a.ttft_ms - b.ttft_ms for a, b in pairs if a.uncached == b.uncached]
        rows.append(
            {
                "config": config,
                "requests": len(sent),
                "failed": len(every) - len(sent),
                "ttft_mean_ms": statistics.mean(ttft) if ttft else None,
                "ttft_median_ms": statistics.median(ttft) if ttft else None,
                "uncached_mean": statistics.mean(xs) if xs else None,
                "reused_by_tier": reuse_by_tier(sent),
                "cpu_s_per_request": statistics.mean(s.cpu_s for s in sent) if sent else None,
                "ms_per_uncached_token": slope,
                "intercept_ms": intercept,
                "paired_median_diff_ms": statistics.median(a.ttft_ms - b.ttft_ms for a, b in pairs) if pairs else None,
                "same_work_requests": len(same_work),
                "same_work_median_diff_ms": statistics.median(same_work) if same_work else None,
                "identical_outputs": (
                    None if config == reference else sum(a.output_ids == b.output_ids for a, b in pairs)
                ),
            }
        )
    return rows


def _fmt(value: Optional[float], pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def markdown(meta: dict[str, Any], rows: Sequence[dict[str, Any]], reference: str) -> str:
    lines = [
        f"# The headline trace, one request at a time ({meta['date']})",
        "",
        f"`{meta['command']}` on {meta['commit']}: {meta['machine']}, {meta['elapsed_s'] / 60:.1f} min.",
        "",
        f"- trace: {meta['trace']}; device pool {meta['pool_tokens']} tokens, the headline's budgets",
        "- every server up at once; each request sent to each configuration in turn (the first rotating), after the "
        f"previous reply and {SETTLE_S:g} s: no queueing, no batching, and a drift of the machine's speed falls on all "
        "alike",
        "",
        "| config | TTFT mean | TTFT median | uncached tokens, mean | reused by tier | ms per uncached token "
        f"| intercept | CPU s per request | vs {reference}: median paired TTFT difference "
        "(all; same uncached tokens) | identical outputs | failed |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        tiers = ", ".join(f"{t} {v:.0%}" for t, v in r["reused_by_tier"].items()) or "-"
        lines.append(
            f"| {r['config']} | {_fmt(r['ttft_mean_ms'], '{:.0f} ms')} | {_fmt(r['ttft_median_ms'], '{:.0f} ms')} "
            f"| {_fmt(r['uncached_mean'], '{:.0f}')} | {tiers} | {_fmt(r['ms_per_uncached_token'], '{:.2f}')} "
            f"| {_fmt(r['intercept_ms'], '{:.0f} ms')} | {_fmt(r['cpu_s_per_request'], '{:.2f}')} "
            f"| {_fmt(r['paired_median_diff_ms'], '{:+.0f} ms')}; "
            f"{_fmt(r['same_work_median_diff_ms'], '{:+.0f} ms')} ({r['same_work_requests']} requests) "
            f"| {_fmt(r['identical_outputs'], '{}')}/{r['requests']} | {r['failed']} |"
        )
    lines += [
        "",
        "The per-token line is a least-squares fit of TTFT against uncached prompt tokens over every request; CPU "
        "seconds are the server's processes (scheduler, detokenizer, PCR's I/O process) from send to reply.",
    ]
    return "\n".join(lines) + "\n"


def _server_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its descendants."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return total
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # it exited meanwhile
            continue
        total += times.user + times.system
    return total


def _send(server: Any, request: Any, ids: list[int]) -> Sent:
    """Send one request (greedy) and wait for its reply and for write-backs to settle."""
    pid = server.pid
    assert pid is not None, "the server was not started"
    before = _server_cpu_s(pid)
    try:
        reply = server.generate_stream(
            {"input_ids": list(ids), "sampling_params": {"temperature": 0.0, "max_new_tokens": request.max_new_tokens}}
        )
    except (requests.RequestException, ValueError) as e:
        logger.error("request %s failed: %s", request.rid, e)
        return Sent(request.rid, math.nan, len(ids), 0, {}, 0.0, error=str(e)[:200])
    cpu_s = _server_cpu_s(pid) - before
    time.sleep(SETTLE_S)
    meta = reply.final.get("meta_info", {})
    return Sent(
        rid=request.rid,
        ttft_ms=1000 * (reply.latency_s if math.isnan(reply.ttft_s) else reply.ttft_s),
        prompt_tokens=int(meta.get("prompt_tokens", len(ids))),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        cached_by_tier=_cached_by_tier(meta),
        cpu_s=cpu_s,
        output_ids=list(reply.final.get("output_ids") or []),
    )


def main(argv: list[str]) -> int:
    intro, _, details = (__doc__ or "").partition("\n\n")
    parser = argparse.ArgumentParser(
        prog="python -m bench.ragbench one-at-a-time",
        description=intro,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=details,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(f"bench/results/{datetime.date.today().isoformat()}/headline/one-at-a-time"),
        help="where the report, trace and server logs go",
    )
    parser.add_argument(
        "--configs",
        type=config_list,
        default=DEFAULT_CONFIGS,
        help=f"comma-separated configurations, the first the reference of the paired differences "
        f"(default: {','.join(DEFAULT_CONFIGS)})",
    )
    workload_args(parser)
    parser.set_defaults(requests=30, max_new_tokens=16)
    args = parser.parse_args(argv)
    if args.followups:
        parser.error("--followups: first turns only (a follow-up holds each server's own earlier answers)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from pcr_eval.ragbench.headline import _commit, headline_setup
    from pcr_eval.ragbench.runner import build_hicache_extension

    started = time.monotonic()
    out_dir: Path = args.out
    work = out_dir / "runs"
    work.mkdir(parents=True, exist_ok=True)
    setup = headline_setup(args)
    model, trace, budgets = setup.model, setup.trace, setup.budgets
    if "hicache" in args.configs:
        build_hicache_extension()
    firsts = sorted(trace.first_turns(), key=lambda r: r.arrival)
    planned = [plan_run(c, budgets, trace, 1.0, "one-at-a-time", setup.pool_fraction, work) for c in args.configs]
    runs: dict[str, list[Sent]] = {run.config: [] for run in planned}
    with ServerPool(model.path, [run.plan for run in planned]) as servers:
        # Every server up at once, each idle while another serves: request i goes to each
        # configuration in turn, the first one rotating, so a drift of the machine's speed
        # over the run falls on every configuration alike.
        started_servers = [servers.acquire(index)[0] for index in range(len(planned))]
        for i, request in enumerate(firsts):
            ids, _bounds = model.prompt(trace, request, {})
            for k in range(len(planned)):
                index = (i + k) % len(planned)
                runs[planned[index].config].append(_send(started_servers[index], request, ids))
            logger.info("%d/%d requests sent to every configuration", i + 1, len(firsts))
        for index, server in enumerate(started_servers):
            servers.release(index, server)
    reference = args.configs[0]
    rows = summarize(runs, reference)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.ragbench one-at-a-time " + shlex.join(argv),
        "commit": _commit(),
        "trace": f"{len(firsts)} first turns of the headline trace (seed {args.seed})",
        "pool_tokens": budgets.device_pool_tokens,
        "elapsed_s": time.monotonic() - started,
    }
    (out_dir / "one_at_a_time.json").write_text(
        json.dumps(
            {"meta": meta, "rows": rows, "requests": {c: [s.__dict__ for s in v] for c, v in runs.items()}}, indent=1
        )
    )
    text = markdown(meta, rows, reference)
    (out_dir / "one_at_a_time.md").write_text(text)
    print(text)
    return 0 if not any(s.error for sent in runs.values() for s in sent) else 1
