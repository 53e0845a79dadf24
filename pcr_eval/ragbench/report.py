"""Figures from runs: a JSON of everything, a markdown report, and PNG plots.

Per run: mean / P50 / P95 / P99 of TTFT and end-to-end latency, mean inter-token latency,
reused prompt tokens by tier (and against the oracle on the same trace), throughput, the
waiting queue's mean depth, PCR's prefetch timeliness, and whether the greedy outputs match
the oracle's token for token. The headline compares ``pcr`` with ``radix``, ``hicache`` and
``oracle`` at each rate.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol, Sequence

import numpy as np

from pcr_eval.ragbench.runner import DOC_REUSE_CONFIGS, RequestRecord, RunResult

BASELINES = ("radix", "hicache", "oracle")
# Configurations that serve blended KV (document reuse): their outputs are not expected to
# match the oracle's; the share that does is reported, and the outputs check skips them.
# Document reuse: answers differ from full prefill's by design (accuracy is measured apart).
APPROXIMATE_CONFIGS = tuple(DOC_REUSE_CONFIGS)
PLOTTED_PERCENTILES = (50, 75, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in 0..100); NaN for no values."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def least_squares(points: Sequence[tuple[float, float]]) -> tuple[Optional[float], Optional[float]]:
    """The least-squares line ``y = slope * x + intercept`` through ``points``: (slope,
    intercept), or (None, None) where no line is defined (fewer than two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None, None
    mx, my = statistics.mean(x for x, _ in points), statistics.mean(y for _, y in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope, my - slope * mx


class Served(Protocol):
    """A request as served: its prompt's tokens and its cached tokens by tier."""

    prompt_tokens: int
    cached_by_tier: dict[str, int]


def reuse_by_tier(served: Iterable[Served]) -> dict[str, float]:
    """Prompt tokens reused, by the tier they came from, as shares of all prompt tokens."""
    prompt = 0
    tiers: dict[str, int] = {}
    for r in served:
        prompt += r.prompt_tokens
        for tier, tokens in r.cached_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + tokens
    return {t: v / prompt for t, v in sorted(tiers.items())} if prompt else {}


def reuse_potential(records: Sequence[RequestRecord]) -> int:
    """Prompt tokens a prefix cache that never evicts could reuse, serving the requests one
    at a time in the order they were sent: for each prompt, its longest common prefix with
    an earlier request's prompt and output (at most all but its last token). The oracle
    server does not always reach this: at a high rate it admits requests that share a
    prefix into one batch, and they compute it side by side."""
    earlier: list[np.ndarray] = []
    total = 0
    for record in sorted((r for r in records if r.error is None), key=lambda r: r.sent_s):
        prompt = np.asarray(record.input_ids, dtype=np.int64)
        best = 0
        for seen in earlier:
            n = min(len(seen), len(prompt) - 1)
            if n <= best:
                continue
            differ = np.flatnonzero(seen[:n] != prompt[:n])
            best = max(best, int(differ[0]) if len(differ) else n)
        total += best
        earlier.append(np.concatenate([prompt, np.asarray(record.output_ids, dtype=np.int64)]))
    return total


def summarize(run: RunResult, oracle: Optional[RunResult]) -> dict[str, Any]:
    ok = [r for r in run.records if r.error is None]
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    itl = [r.itl_s for r in ok if r.itl_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    potential = reuse_potential(ok)
    summary: dict[str, Any] = {
        "config": run.config,
        "rate": run.rate,
        "label": run.label,
        "pool_fraction": run.pool_fraction,
        "device_pool_tokens": (run.server_state.get("budgets") or {}).get(
            "oracle_pool_tokens" if run.config == "oracle" else "device_pool_tokens"
        ),
        "requests": len(run.records),
        "errors": len(run.records) - len(ok),
        "ttft_ms": {k: 1000 * v for k, v in _stats(ttft).items()},
        "e2e_ms": {k: 1000 * v for k, v in _stats(e2e).items()},
        "ttft_percentiles_ms": {str(q): 1000 * percentile(ttft, q) for q in PLOTTED_PERCENTILES},
        "itl_ms_mean": 1000 * statistics.mean(itl) if itl else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else 0.0,
        "reuse_potential_tokens": potential,
        "reuse_vs_potential": cached / potential if potential else None,
        "hit_ratio_by_tier": reuse_by_tier(ok),
        "throughput_rps": len(ok) / run.makespan_s if run.makespan_s else 0.0,
        "output_tokens_per_s": sum(len(r.output_ids) for r in ok) / run.makespan_s if run.makespan_s else 0.0,
        "makespan_s": run.makespan_s,
        "startup_s": run.startup_s,
        "queue_depth_mean": run.queue_depth_mean,
        "queue_depth_max": run.queue_depth_max,
        "prefetch_timeliness": (run.server_state.get("ssd") or {}).get("prefetch_timeliness"),
    }
    if oracle is not None:
        oracle_cached = sum(r.cached_tokens for r in oracle.records if r.error is None)
        summary["reuse_vs_oracle"] = cached / oracle_cached if oracle_cached else None
        same = [a.output_ids == b.output_ids for a, b in zip(run.records, oracle.records)]
        if run.config in APPROXIMATE_CONFIGS:
            summary["answers_match_oracle_share"] = sum(same) / len(same) if same else None
        else:
            summary["outputs_match_oracle"] = [r.output_ids for r in run.records] == [
                r.output_ids for r in oracle.records
            ]
        summary["cached_tokens"] = cached
        summary["oracle_cached_tokens"] = oracle_cached
    return summary


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    return {
        "mean": statistics.mean(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
    }


def build_report(runs: Sequence[RunResult], meta: dict[str, Any]) -> dict[str, Any]:
    """Summaries of every run, with each run checked against the oracle on its trace."""

    def oracle_for(run: RunResult) -> Optional[RunResult]:
        """The oracle's run on the same trace, at the same rate when there is one."""
        candidates = [o for o in runs if o.config == "oracle" and o.label == run.label]
        same_rate = [o for o in candidates if o.rate == run.rate]
        return (same_rate or candidates or [None])[0]

    summaries = [summarize(run, oracle_for(run)) for run in runs]
    headline = []
    for s in summaries:
        if s["config"] != "pcr":
            continue
        row = {
            "label": s["label"],
            "rate": s["rate"],
            "pool_fraction": s["pool_fraction"],
            "pcr_ttft_mean_ms": s["ttft_ms"]["mean"],
            "pcr_ttft_p99_ms": s["ttft_ms"]["p99"],
            "reuse_vs_potential": s["reuse_vs_potential"],
            "reuse_vs_oracle": s.get("reuse_vs_oracle"),
            "queue_depth_mean": s["queue_depth_mean"],
        }
        for base in BASELINES:
            other = _find(summaries, base, s)
            if other is not None:
                row[f"mean_vs_{base}"] = s["ttft_ms"]["mean"] / other["ttft_ms"]["mean"]
                row[f"p99_vs_{base}"] = s["ttft_ms"]["p99"] / other["ttft_ms"]["p99"]
        headline.append(row)
    doc_headline = []
    for s in summaries:
        if s["config"] not in APPROXIMATE_CONFIGS:
            continue
        row = {
            "label": s["label"],
            "rate": s["rate"],
            "pool_fraction": s["pool_fraction"],
            "config": s["config"],
            "ttft_mean_ms": s["ttft_ms"]["mean"],
            "ttft_p99_ms": s["ttft_ms"]["p99"],
            "reuse_vs_oracle": s.get("reuse_vs_oracle"),
            "hit_ratio": s["hit_ratio"],
            "answers_match_oracle_share": s.get("answers_match_oracle_share"),
        }
        for base in ("radix", "pcr", "oracle"):
            other = _find(summaries, base, s)
            if other is not None:
                row[f"mean_vs_{base}"] = s["ttft_ms"]["mean"] / other["ttft_ms"]["mean"]
        doc_headline.append(row)
    checked = [s for s in summaries if "outputs_match_oracle" in s]
    return {
        "meta": meta,
        "runs": summaries,
        "headline": headline,
        "doc_headline": doc_headline,
        "outputs_identical": bool(checked) and all(s["outputs_match_oracle"] for s in checked),
        "outputs_mismatched": [
            f"{s['label']}/{s['config']}@{s['rate']:g}" for s in checked if not s["outputs_match_oracle"]
        ],
    }


def _find(summaries: Sequence[dict[str, Any]], config: str, like: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The run of ``config`` on the same trace, rate and pool as ``like``. The oracle bounds
    reuse on a trace whatever the rate or pool: any of its runs on the trace will do."""
    for s in summaries:
        if (
            s["config"] == config
            and s["label"] == like["label"]
            and (config == "oracle" or (s["rate"] == like["rate"] and s["pool_fraction"] == like["pool_fraction"]))
        ):
            return s
    return None


# ---------------------------------------------------------------------------- writers
def _fmt(value: Any, pattern: str = "{:.0f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return pattern.format(value)


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"# RAG serving benchmark ({meta.get('date', '')})",
        "",
        f"Machine: {meta.get('machine', '')}. Model: {meta.get('model', '')}. Command: `{meta.get('command', '')}`.",
        "",
    ]
    for label, trace in meta.get("traces", {}).items():
        lines.append(f"- trace `{label}`: {trace}")
    lines += [
        "",
        "## Headline: PCR against the baselines",
        "",
        "| trace | pool | rate (req/s) | queue | PCR TTFT mean | P99 | reuse vs potential | vs oracle run | "
        "mean vs radix | P99 vs radix | mean vs hicache | P99 vs hicache | mean vs oracle | P99 vs oracle |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for h in report["headline"]:
        lines.append(
            f"| {h['label']} | {h['pool_fraction']:.0%} | {h['rate']:g} | {h['queue_depth_mean']:.1f} | "
            f"{_fmt(h['pcr_ttft_mean_ms'])} ms | "
            f"{_fmt(h['pcr_ttft_p99_ms'])} ms | {_fmt(h['reuse_vs_potential'], '{:.1%}')} | "
            f"{_fmt(h.get('reuse_vs_oracle'), '{:.1%}')} | "
            + " | ".join(f"{_fmt(h.get(f'{k}_vs_{b}'), '{:.2f}x')}" for b in BASELINES for k in ("mean", "p99"))
            + " |"
        )
    lines += [
        "",
        "Ratios are PCR's figure divided by the baseline's (below 1: PCR is faster). Reuse vs "
        "potential: PCR's reused prompt tokens over what a never-evicting cache could reuse serving "
        "the same requests one at a time; vs oracle run: over what the oracle server reused in "
        "the same trace's run (the oracle admits concurrent requests that share a prefix into one "
        "batch, so under load it can reuse less than a small pool that serialises them).",
        "",
        *_doc_section(report),
        "## All runs",
        "",
        "| trace | pool (tokens) | config | rate | TTFT mean | P50 | P95 | P99 | E2E mean | P50 | P95 | P99 | "
        "ITL | hit ratio (by tier) | reuse vs potential | vs oracle run | req/s | queue | timeliness | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- | --- | --- | --- |",
    ]
    for s in report["runs"]:
        t, e = s["ttft_ms"], s["e2e_ms"]
        tiers = ", ".join(f"{k} {v:.0%}" for k, v in s["hit_ratio_by_tier"].items())
        lines.append(
            f"| {s['label']} | {s['pool_fraction']:.0%} ({_fmt(s['device_pool_tokens'])}) | {s['config']} | "
            f"{s['rate']:g} | {_fmt(t['mean'])} | {_fmt(t['p50'])} | "
            f"{_fmt(t['p95'])} | {_fmt(t['p99'])} | {_fmt(e['mean'])} | {_fmt(e['p50'])} | {_fmt(e['p95'])} | "
            f"{_fmt(e['p99'])} | {_fmt(s['itl_ms_mean'])} | {s['hit_ratio']:.0%} ({tiers or '-'}) | "
            f"{_fmt(s['reuse_vs_potential'], '{:.1%}')} | {_fmt(s.get('reuse_vs_oracle'), '{:.1%}')} | "
            f"{s['throughput_rps']:.2f} | "
            f"{s['queue_depth_mean']:.1f} | {_fmt(s['prefetch_timeliness'], '{:.0%}')} | {s['errors']} |"
        )
    lines += [
        "",
        "Latencies in ms. Hit ratio: cached prompt tokens over prompt tokens, split by the "
        "tier SGLang reports (`device`, `host`, `storage`). Queue: mean of SGLang's "
        "`sglang:num_queue_reqs` during the run.",
        "",
    ]
    if meta.get("failed_runs"):
        lines += ["## Runs that failed", ""] + [f"- {f}" for f in meta["failed_runs"]] + [""]
    cross = meta.get("cross_check")
    if cross:
        w = cross["workload"]
        lines += [
            "## Cross-check with `sglang.benchmark.serving`",
            "",
            f"generated-shared-prefix, {w['num_groups']} groups with Zipf alpha {w['zipf_alpha']:g}, "
            f"{w['prompts']} prompts ({w['system_prompt_len']}-token shared prefix + {w['question_len']}-token "
            f"question, {w['output_len']} output tokens) at {cross['rate']:g} req/s; device pool "
            f"{cross['budgets']['device_pool_tokens']} tokens. Figures from SGLang's client.",
            "",
            "| config | TTFT mean | P50 | P99 | E2E mean | P99 | req/s | completed | "
            "hit rate (device / host / storage tokens) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in cross["configs"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:80]} |  |  |  |  |  |  |  |")
                continue
            lines.append(
                f"| {name} | {_fmt(r['mean_ttft_ms'])} | {_fmt(r['median_ttft_ms'])} | "
                f"{_fmt(r['p99_ttft_ms'])} | {_fmt(r['mean_e2e_latency_ms'])} | "
                f"{_fmt(r['p99_e2e_latency_ms'])} | {_fmt(r['request_throughput'], '{:.2f}')} | "
                f"{_fmt(r['completed'])} | {_fmt(r.get('cache_hit_rate_pct'), '{:.1f}%')} "
                f"({_fmt(r.get('device_cached_tokens'))} / {_fmt(r.get('host_cached_tokens'))} / "
                f"{_fmt(r.get('storage_cached_tokens'))}) |"
            )
        lines.append("")
    if report["outputs_identical"]:
        lines.append("Outputs check: every configuration's greedy outputs match the oracle's, token for token.")
    else:
        lines.append("Outputs check FAILED for: " + ", ".join(report["outputs_mismatched"] or ["(no oracle run)"]))
    return "\n".join(lines) + "\n"


def _doc_section(report: dict[str, Any]) -> list[str]:
    rows = report.get("doc_headline") or []
    if not rows:
        return []
    lines = [
        "## Document reuse (`--pcr-doc-reuse concat`)",
        "",
        "| trace | pool | rate | config | hit ratio | reuse vs oracle run | TTFT mean | P99 | mean vs radix | "
        "mean vs pcr | mean vs oracle | answers equal to the oracle's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for h in rows:
        lines.append(
            f"| {h['label']} | {h['pool_fraction']:.0%} | {h['rate']:g} | {h['config']} | {h['hit_ratio']:.0%} | "
            f"{_fmt(h.get('reuse_vs_oracle'), '{:.2f}x')} | {_fmt(h['ttft_mean_ms'])} ms | "
            f"{_fmt(h['ttft_p99_ms'])} ms | "
            + " | ".join(_fmt(h.get(f"mean_vs_{b}"), "{:.2f}x") for b in ("radix", "pcr", "oracle"))
            + f" | {_fmt(h.get('answers_match_oracle_share'), '{:.0%}')} |"
        )
    lines += [
        "",
        "Reuse vs oracle run: prompt tokens reused over what the oracle (a prefix cache that never "
        "evicts) reused on the same trace (recomputed document tokens are not reused ones). `-pre` "
        "configurations start on a store filled with every trace document's canonical KV (then "
        "restarted). `pcr-docs` is concat (no recompute), `pcr-blend` recomputes 15% of re-placed "
        "tokens; both warm a document when it recurs (`-eager`: at its first sighting, before its "
        "request; `-idle`: at its first sighting, after its request, when nothing else runs); answers "
        "differ from full prefill's (see bench/README's accuracy table) and are not "
        "part of the outputs check below.",
        "",
    ]
    return lines


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(report, indent=1, default=_json_default))
    paths[1].write_text(markdown(report))
    paths += plot(report, out_dir)
    return paths


def _json_default(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """TTFT against rate (mean and P99), TTFT percentiles at the highest rate, and hit
    ratio by tier; each for the headline trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = report["meta"]
    runs = [
        s
        for s in report["runs"]
        if s["label"] == meta.get("headline_label")
        and s["pool_fraction"] == meta.get("headline_pool_fraction", s["pool_fraction"])
    ]
    if not runs:
        return []
    configs = list(dict.fromkeys(s["config"] for s in runs))
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for config in configs:
        points = sorted((s["rate"], s["ttft_ms"]["mean"], s["ttft_ms"]["p99"]) for s in runs if s["config"] == config)
        axes[0].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=config)
        axes[1].plot([p[0] for p in points], [p[2] for p in points], marker="o", label=config)
    for ax, title in zip(axes, ("mean TTFT", "P99 TTFT")):
        ax.set(xlabel="request rate (req/s)", ylabel="ms", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "ttft_vs_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    top = max(s["rate"] for s in runs)
    fig, ax = plt.subplots(figsize=(6, 4))
    qs = list(PLOTTED_PERCENTILES)
    for s in runs:
        if s["rate"] == top:
            ax.plot(qs, [s["ttft_percentiles_ms"][str(q)] for q in qs], marker="o", label=s["config"])
    ax.set(xlabel="percentile", ylabel="TTFT (ms)", title=f"TTFT percentiles at {top:g} req/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "ttft_percentiles.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    at_top = [s for s in runs if s["rate"] == top]
    bottom = [0.0] * len(at_top)
    for tier in sorted({t for s in at_top for t in s["hit_ratio_by_tier"]}):
        values = [s["hit_ratio_by_tier"].get(tier, 0.0) for s in at_top]
        ax.bar([s["config"] for s in at_top], values, bottom=bottom, label=tier)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="share of prompt tokens reused", title=f"Hit ratio by tier at {top:g} req/s")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    paths.append(out_dir / "hit_ratio_by_tier.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
