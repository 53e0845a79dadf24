"""The questions workload's figures per model and mode (gold scores, fidelity to the same
model's full prefill beside the noise floor, reuse and TTFT, each mean with its bootstrap
interval), its three markdown tables and issue 28's targets, each with where it stands.
One run's rows (:mod:`pcr_eval.questions_workload`) or several runs' pooled
(:mod:`pcr_eval.pool`) are summarized alike."""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence

from pcr_eval.gold import GoldPrompt
from pcr_eval.stats import mean_ci, ratio_ci

FULL = "full prefill"


# ------------------------------------------------------------------- summary
GOLD_METRICS = ("lead_f1", "lead_rouge_l", "em_needle", "em_two_hop", "gold_nll")


def _gold_values(rows: Sequence[dict[str, Any]], prompts: Sequence[GoldPrompt], metric: str) -> list[Optional[float]]:
    if metric == "em_needle":
        return [r.get("em") if p.kind == "needle" else None for r, p in zip(rows, prompts)]
    if metric == "em_two_hop":
        return [r.get("em") if p.kind == "two_hop" else None for r, p in zip(rows, prompts)]
    return [r.get(metric) for r in rows]


def summarize_mode(
    rows: Sequence[dict[str, Any]],
    prompts: Sequence[GoldPrompt],
    base_full: Sequence[dict[str, Any]],
    own_full: Sequence[dict[str, Any]],
    seed: int,
) -> dict[str, Any]:
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
        out[metric + "_pct_of_base_full"] = (
            ratio_ci(base, mine, seed) if metric == "gold_nll" else ratio_ci(mine, base, seed)
        )
    for metric in ("kl", "top1", "f1", "identical", "ttft_s"):
        out[metric] = mean_ci([r.get(metric) for r in rows_ok], seed)
    out["nll_ratio"] = ratio_ci([r.get("nll") for r in rows_ok], [f.get("nll") for f in own_ok], seed)
    out["noise_floor_f1"] = mean_ci([f.get("noise_f1") for f in own_ok], seed)
    out["noise_floor_identical"] = mean_ci([f.get("noise_identical") for f in own_ok], seed)
    doc_tokens = sum(p.doc_tokens for p in prompts_ok)
    out["recomputed_share_of_doc_tokens"] = (
        sum(r.get("recomputed_tokens", 0) for r in rows_ok) / doc_tokens if doc_tokens else None
    )
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
    gold = [
        "| model | mode | lead F1 | lead ROUGE-L | needle EM | two-hop EM | gold NLL | lead F1 % base full "
        "| needle EM % | two-hop EM % | gold NLL % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fidelity = [
        "| model | mode | KL (top-k) | top-1 agreement | NLL / own full | F1 vs own full "
        "| identical | noise floor F1 | noise floor identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    speed = [
        "| model | mode | questions | all docs reused | reordered | recomputed share of document tokens "
        "| median TTFT (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, modes in summaries.items():
        for mode, s in modes.items():
            gold.append(
                f"| {model} | {mode} | {_fmt(s['lead_f1'])} | {_fmt(s['lead_rouge_l'])} "
                f"| {_fmt(s['em_needle'], True)} | {_fmt(s['em_two_hop'], True)} | {_fmt(s['gold_nll'])} "
                f"| {_fmt(s['lead_f1_pct_of_base_full'], True)} "
                f"| {_fmt(s['em_needle_pct_of_base_full'], True)} "
                f"| {_fmt(s['em_two_hop_pct_of_base_full'], True)} "
                f"| {_fmt(s['gold_nll_pct_of_base_full'], True)} |"
            )
            if mode == FULL:
                fidelity.append(
                    f"| {model} | {mode} | 0 | 100% | 1.00 | 1.000 | 100% "
                    f"| {_fmt(s['noise_floor_f1'])} | {_fmt(s['noise_floor_identical'], True)} |"
                )
            else:
                fidelity.append(
                    f"| {model} | {mode} | {_fmt(s['kl'])} | {_fmt(s['top1'], True)} "
                    f"| {_fmt(s['nll_ratio'], digits=2)} | {_fmt(s['f1'])} | {_fmt(s['identical'], True)} "
                    f"| {_fmt(s['noise_floor_f1'])} | {_fmt(s['noise_floor_identical'], True)} |"
                )
            reused = s.get("all_docs_reused")
            share = s.get("recomputed_share_of_doc_tokens")
            ttft = s.get("ttft_median_s")
            reordered = s.get("reordered")
            speed.append(
                f"| {model} | {mode} | {s['questions']} | {'n/a' if reused is None else f'{reused:.0%}'} "
                f"| {'n/a' if reordered is None else f'{reordered:.0%}'} "
                f"| {'n/a' if share is None else f'{share:.1%}'} "
                f"| {'n/a' if ttft is None else f'{ttft:.3f}'} |"
            )
    return "\n".join(
        [
            "Gold answers (95% bootstrap intervals over questions):",
            *gold,
            "",
            "Fidelity to the same model's full prefill (teacher-forced along its answer; free-running "
            "beside the noise floor, full prefill with the documents shuffled):",
            *fidelity,
            "",
            "Reuse and speed:",
            *speed,
        ]
    )


def summarize_full(
    rows: Sequence[dict[str, Any]], prompts: Sequence[GoldPrompt], base_full: Sequence[dict[str, Any]], seed: int
) -> dict[str, Any]:
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
            verdict = (
                "n/a"
                if f1 is None or floor is None
                else f"{f1:.3f} vs {floor:.3f} -> {'met' if f1 >= floor else f'missed by {floor - f1:.3f}'}"
            )
            lines.append(
                f"{name}, reorder (exact; served in the noise floor's shuffled order): free-running F1 vs "
                f"own full prefill >= noise floor: {verdict}"
            )
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
        lines.append(
            f"tuned, {default_mode} (recomputes {share:.1%} of document tokens; target <= 15%):"
            if share is not None
            else f"tuned, {default_mode}:"
        )
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
