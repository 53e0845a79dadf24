"""Routing and the shared remote tier: the retrieval trace through SGLang's gateway.

    python -m bench.fleet_bench                       # about 15 min on 2 cores
    python -m bench.fleet_bench --requests 12 --rate 0.3   # shorter

Four fleets replay the same seeded retrieval trace (bench.ragbench's, SmolLM2-135M) at the
same rate through ``smg`` (SGLang Model Gateway), each started by
:class:`pcr_tools.fleet.Fleet` and stopped before the next:

* ``round_robin``: two PCR servers, no shared tier;
* ``cache_aware``: two PCR servers, no shared tier;
* ``cache_aware+remote``: two PCR servers sharing a Mooncake Store;
* ``single``: one PCR server with the two servers' memory combined (device pool, host
  memory and SSD), the reference;
* ``cache_aware+remote+docs``: ``cache_aware+remote`` with document reuse (``concat``) and
  the trace's documents marked: a document one server computed is reused by the other at
  any position. Its answers are not full prefill's (document reuse changes answers), so
  its outputs are not compared with ``single``'s.

Per fleet: hit ratio (cached prompt tokens over prompt tokens) by tier as SGLang reports
them (device, host, storage; the storage share read from the remote tier apart), each
server's share of prompt tokens (load balance), TTFT mean and P99. Greedy outputs must
match the single server's token for token. The target: ``cache_aware+remote`` within 5%
of ``single``'s hit ratio and above both other fleets.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import requests

from pcr_eval.ragbench.common import Model, budgets_for, trace_shape, workload_args, workload_params
from pcr_eval.ragbench.report import percentile
from pcr_eval.ragbench.runner import RequestRecord, replay
from pcr_eval.ragbench.workload import make_trace, save_trace
from pcr_tools.fleet import Fleet
from pcr_tools.launcher import ServerProcess

logger = logging.getLogger(__name__)

FLEETS = ("round_robin", "cache_aware", "cache_aware+remote", "single", "cache_aware+remote+docs")


@dataclass(frozen=True)
class FleetSpec:
    name: str
    servers: int
    policy: str
    remote: bool
    memory_scale: int  # per-server budgets times this
    doc_reuse: str = "off"  # --pcr-doc-reuse; on: the trace's documents are marked


SPECS = {
    "round_robin": FleetSpec("round_robin", 2, "round_robin", False, 1),
    "cache_aware": FleetSpec("cache_aware", 2, "cache_aware", False, 1),
    "cache_aware+remote": FleetSpec("cache_aware+remote", 2, "cache_aware", True, 1),
    "single": FleetSpec("single", 1, "round_robin", False, 2),
    "cache_aware+remote+docs": FleetSpec("cache_aware+remote+docs", 2, "cache_aware", True, 1, "concat"),
}


def _remote_read_chunks(server: ServerProcess) -> int:
    report = server.pcr_state().get("remote") or {}
    return int((report.get("store") or {}).get("read_ok", 0))


def _prompt_tokens(server: ServerProcess) -> float:
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sglang:prompt_tokens_total{")
    )


def summarize(
    name: str, records: list[RequestRecord], servers: list[ServerProcess], chunk: int, remote_chunks: int
) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    tiers: dict[str, int] = {}
    for r in ok:
        for tier, tokens in r.cached_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + tokens
    loads = [_prompt_tokens(s) for s in servers]
    ttft = [1000 * r.ttft_s for r in ok]
    return {
        "fleet": name,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "hit_ratio": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "by_tier": {t: v / prompt for t, v in sorted(tiers.items())} if prompt else {},
        "remote_tokens_share": remote_chunks * chunk / prompt if prompt else 0.0,
        "server_prompt_share": [v / sum(loads) for v in loads] if sum(loads) else [],
        "ttft_mean_ms": statistics.mean(ttft) if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99),
        "outputs": [r.output_ids for r in records],
    }


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# Fleets through the gateway ({meta['date']})",
        "",
        f"Command: `{meta['command']}`.",
        "",
        f"- trace: {meta['trace']}",
        f"- per server: {meta['budgets']}",
        f"- rate: {meta['rate']:g} req/s",
        "",
        "| fleet | hit ratio | device | host | storage (remote reads) | documents reused | "
        "per-server prompt share | TTFT mean | P99 | outputs = single's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        t = r["by_tier"]
        lines.append(
            f"| {r['fleet']} | {r['hit_ratio']:.1%} | {t.get('device', 0):.1%} | {t.get('host', 0):.1%} | "
            f"{t.get('storage', 0):.1%} ({r['remote_tokens_share']:.1%}) | {t.get('documents', 0):.1%} | "
            f"{' / '.join(f'{s:.0%}' for s in r['server_prompt_share'])} | {r['ttft_mean_ms']:.0f} ms | "
            f"{r['ttft_p99_ms']:.0f} ms | {r.get('outputs_match_single', '-')} |"
        )
    single = next((r for r in rows if r["fleet"] == "single"), None)
    remote = next((r for r in rows if r["fleet"] == "cache_aware+remote"), None)
    if single and remote:
        others = [r["hit_ratio"] for r in rows if r["fleet"] in ("round_robin", "cache_aware")]
        within = remote["hit_ratio"] >= 0.95 * single["hit_ratio"]
        above = all(remote["hit_ratio"] > o for o in others)
        lines += [
            "",
            f"Target: cache_aware+remote within 5% of single's hit ratio: "
            f"{remote['hit_ratio']:.1%} vs {single['hit_ratio']:.1%} ({'met' if within else 'MISSED'}); "
            f"above both other fleets: {'met' if above else 'MISSED'}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    import datetime

    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(f"bench/results/{datetime.date.today().isoformat()}/fleet_bench"),
        help="where the report, traces and server logs go (default: bench/results/<today>/fleet_bench)",
    )
    parser.add_argument("--fleets", default=",".join(FLEETS), help=f"comma-separated subset of {','.join(FLEETS)}")
    parser.add_argument("--rate", type=float, default=0.4, help="first turns per second (default: 0.4)")
    parser.add_argument(
        "--pool-fraction",
        type=float,
        default=0.05,
        help="each server's device pool as a fraction of the trace's working set",
    )
    parser.add_argument(
        "--host-fraction", type=float, default=0.1, help="each server's host memory as a fraction of the working set"
    )
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--model-path", default=None)
    workload_args(parser)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.fleets.split(",") if n.strip()]
    unknown = [n for n in names if n not in SPECS]
    if unknown or not names:
        parser.error(f"unknown fleets {unknown}; known: {', '.join(FLEETS)}")
    if args.rate <= 0:
        parser.error("--rate must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pcr_tools.models.smollm2 import build_smollm2

    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    model = Model(args.model_path or str(build_smollm2()))
    trace = make_trace(workload_params(args), count_tokens=model.count_tokens)
    save_trace(trace, args.out / "trace.jsonl")
    shape = trace_shape(trace, model, args.chunk_size)
    base = budgets_for(shape, args.pool_fraction, args.host_fraction, args.chunk_size, model.kv_bytes_per_token())
    rows = []
    for name in names:
        spec = SPECS[name]
        k = spec.memory_scale
        server_args = (
            "--max-total-tokens",
            str(base.device_pool_tokens * k),
            "--context-length",
            str(base.context_length),
            "--log-level",
            "warning",
            "--sleep-on-idle",
            "--enable-metrics",
            "--enable-pcr",
            "--pcr-chunk-size",
            str(args.chunk_size),
            "--pcr-dram-gb",
            f"{base.host_gb * k:.4f}",
            "--pcr-ssd-gb",
            f"{base.ssd_gb * k:.3f}",
            "--pcr-ssd-reserve-gb",
            "0",
        )
        if spec.doc_reuse != "off":
            server_args += ("--pcr-doc-reuse", spec.doc_reuse)
        work = args.out / name
        logger.info("fleet %s: starting %d server(s)", name, spec.servers)
        with Fleet(model.path, work, spec.servers, spec.remote, spec.policy, 1 << 30, server_args) as fleet:
            client = ServerProcess(model.path, port=fleet.gateway.port)  # a handle on the gateway, never started
            records, makespan, _ = replay(
                client,
                trace,
                lambda r, a: model.prompt(trace, r, a),
                model.decode,
                args.rate,
                mark_docs=spec.doc_reuse != "off",
            )
            time.sleep(1.5)  # the I/O processes' next status reports
            remote = sum(_remote_read_chunks(s) for s in fleet.servers) if spec.remote else 0
            rows.append(summarize(name, records, fleet.servers, args.chunk_size, remote))
        logger.info("fleet %s: hit ratio %.1f%%", name, 100 * rows[-1]["hit_ratio"])
    single = next((r for r in rows if r["fleet"] == "single"), None)
    for r in rows:
        if single is not None and SPECS[r["fleet"]].doc_reuse == "off":
            r["outputs_match_single"] = r["outputs"] == single["outputs"]
        elif single is not None:
            r["outputs_match_single"] = "approximate (document reuse)"
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m bench.fleet_bench " + " ".join(argv or sys.argv[1:]),
        "trace": f"{len(trace.requests)} requests, {shape['working_set']} working-set tokens, "
        f"longest prompt {shape['longest']}",
        "budgets": f"device pool {base.device_pool_tokens} tokens, host {base.host_gb:.3f} GB, "
        f"SSD {base.ssd_gb:.2f} GB (single: twice each)",
        "rate": args.rate,
        "elapsed_s": time.monotonic() - started,
    }
    (args.out / "fleet.json").write_text(
        json.dumps({"meta": meta, "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}, indent=1)
    )
    text = markdown(meta, rows)
    (args.out / "fleet.md").write_text(text)
    print(text)
    return 0 if all(r.get("outputs_match_single", True) is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
