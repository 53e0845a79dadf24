"""The trace workload's figures per mode against full prefill (identical answers, token F1,
the teacher-forced NLL and its ratio, first-token agreement, documents reused), its
markdown table and where each mode stands against the target it is measured against."""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence

FULL = "full prefill"
EXACT = "exact prefix cache"
# What the modes are measured against (reported, never assumed met).
TARGETS = {
    "blend": {
        "recompute_ratio": 0.15,
        "mean_f1_min": 0.90,
        "nll_ratio_max": 1.05,
        "text": "blend with R=15% recompute: mean F1 >= 0.90 and NLL within 5% of full prefill",
    },
}


def mean_or_none(values: Sequence[float]) -> Optional[float]:
    return statistics.fmean(values) if values else None


def summarize(
    rows: Sequence[dict[str, Any]], reference_nll: Optional[float], docs_reused: bool = True
) -> dict[str, Any]:
    """A mode's metrics over its rows without errors (``rows``: the measure_mode dicts)."""
    ok = [r for r in rows if "error" not in r]
    nll = mean_or_none([r["nll"] for r in ok])
    return {
        "requests": len(ok),
        "errors": len(rows) - len(ok),
        "all_docs_reused": (sum(r["all_docs_reused"] for r in ok) / len(ok) if ok else None) if docs_reused else None,
        # The teacher-forced requests too (their logprob_start_len caps reuse, past the documents).
        "tf_all_docs_reused": (sum(bool(r.get("tf_all_docs_reused")) for r in ok) / len(ok) if ok else None)
        if docs_reused
        else None,
        "identical_answers": sum(r["identical"] for r in ok) / len(ok) if ok else None,
        "mean_f1": mean_or_none([r["f1"] for r in ok]),
        "nll": nll,
        "nll_ratio": nll / reference_nll if nll is not None and reference_nll else None,
        "first_token_agreement": sum(r["first_token_agrees"] for r in ok) / len(ok) if ok else None,
        # reorder: the share served in another order than sent (None for the other modes).
        "reordered": _share([r.get("reordered") for r in ok]),
    }


def _share(flags: Sequence[Optional[bool]]) -> Optional[float]:
    known = [bool(f) for f in flags if f is not None]
    return sum(known) / len(known) if known else None


def pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _num(value: Optional[float], digits: int = 3) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def markdown_table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| mode | requests | all docs reused | reordered | identical answers | mean F1 | NLL | NLL / full "
        "| first-token agreement |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, s in summaries.items():
        lines.append(
            f"| {mode} | {s['requests']} | {pct(s['all_docs_reused'])} | {pct(s.get('reordered'))} "
            f"| {pct(s['identical_answers'])} "
            f"| {_num(s['mean_f1'])} | {_num(s['nll'])} | {_num(s['nll_ratio'], 2)} "
            f"| {pct(s['first_token_agreement'])} |"
        )
    return "\n".join(lines)


def target_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """Each target, and where every measured reuse mode stands against it."""
    lines = []
    for name, target in TARGETS.items():
        ran = any(m.split(":")[0] == name for m in summaries)
        lines.append(
            f"target ({target['text']}): " + ("measured below" if ran else f"no {name} configuration was run (--modes)")
        )
        for mode, s in summaries.items():
            if mode in (FULL, EXACT) or s["mean_f1"] is None or s["nll_ratio"] is None:
                continue
            f1_ok = s["mean_f1"] >= target["mean_f1_min"]
            nll_ok = s["nll_ratio"] <= target["nll_ratio_max"]
            lines.append(
                f"  {mode}: mean F1 {s['mean_f1']:.3f} ({'meets' if f1_ok else 'below'} "
                f">= {target['mean_f1_min']:.2f}), NLL / full {s['nll_ratio']:.2f} "
                f"({'within' if nll_ok else 'outside'} {target['nll_ratio_max'] - 1:.0%})"
            )
    return lines
