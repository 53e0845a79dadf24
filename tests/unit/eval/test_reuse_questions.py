"""The re-placed-document workload's measures and summaries (pcr_eval/questions_report.py),
on rows written by hand: the server side is run by the benchmark itself."""

from __future__ import annotations

import math

import pytest

from pcr_eval.forcing import topk_kl
from pcr_eval.gold import GoldPrompt
from pcr_eval.questions_report import FULL, markdown_tables, summarize_full, summarize_mode
from pcr_eval.scores import gold_scores
from pcr_eval.stats import mean_ci, ratio_ci
from pcr_tools.tune.questions import Question


def test_topk_kl_is_zero_for_equal_distributions_and_grows_with_the_difference():
    p = {1: math.log(0.6), 2: math.log(0.3)}
    assert topk_kl(p, dict(p)) == pytest.approx(0.0, abs=1e-12)
    near = topk_kl(p, {1: math.log(0.55), 2: math.log(0.35)})
    far = topk_kl(p, {1: math.log(0.1), 2: math.log(0.1)})
    assert 0 < near < far
    # Exactly the KL of the three-outcome distributions (top tokens and the rest).
    expected = 0.6 * math.log(0.6 / 0.1) + 0.3 * math.log(0.3 / 0.1) + 0.1 * math.log(0.1 / 0.8)
    assert far == pytest.approx(expected)
    assert topk_kl(p, {2: math.log(0.3)}) == math.inf  # a top token the mode gives no mass


def test_intervals_cover_the_mean_and_ratios_pair_questions():
    ci = mean_ci([0.0, 1.0] * 20, seed=1)
    assert ci["low"] < ci["mean"] == 0.5 < ci["high"] and ci["n"] == 40
    assert mean_ci([None, float("nan")])["mean"] is None
    ratio = ratio_ci([1.0, None, 3.0], [2.0, 5.0, 2.0])
    assert ratio["mean"] == pytest.approx(1.0) and ratio["n"] == 2


def _prompt(kind: str, index: int) -> GoldPrompt:
    q = Question(kind, ("d0", "d1", "d2"), "q?", "gold", (1,), ("a", "b", "c"))
    return GoldPrompt(index, f"{kind}-{index}", q, list(range(40)), [5, 15, 15, 25, 25, 35], list(range(40)), [7])


def test_summaries_and_tables():
    prompts = [_prompt("lead", 0), _prompt("needle", 1), _prompt("two_hop", 2)]
    full = [
        {
            "answer_ids": [1],
            "answer": "x",
            "ttft_s": 0.2,
            "top": [],
            "nll": 1.0,
            "gold_nll": 2.0,
            **gold_scores(p.kind, "gold answer", "gold"),
            "noise_f1": 0.5,
            "noise_identical": 0.0,
        }
        for p in prompts
    ]
    mode = [
        {
            **f,
            "ttft_s": 0.1,
            "identical": 1.0,
            "f1": 0.8,
            "recomputed_tokens": 2,
            "all_docs_reused": True,
            "nll": 1.5,
            "kl": 0.2,
            "top1": 0.9,
            "gold_nll": 4.0,
            "em": 0.0 if f["em"] is not None else None,
        }
        for f in full
    ]
    s = summarize_mode(mode, prompts, full, full, seed=0)
    assert s["em_needle"]["mean"] == 0.0 and s["em_needle_pct_of_base_full"]["mean"] == 0.0
    assert s["lead_f1_pct_of_base_full"]["mean"] == pytest.approx(1.0)
    assert s["gold_nll_pct_of_base_full"]["mean"] == pytest.approx(0.5)  # full's NLL over the mode's
    assert s["nll_ratio"]["mean"] == pytest.approx(1.5)
    assert s["recomputed_share_of_doc_tokens"] == pytest.approx(6 / 90)
    assert s["noise_floor_f1"]["mean"] == 0.5 and s["ttft_median_s"] == 0.1
    f = summarize_full(full, prompts, full, seed=0)
    assert f["all_docs_reused"] is None and f["em_two_hop"]["mean"] == 1.0
    table = markdown_tables({"base": {FULL: f, "concat": s}})
    assert "| base | concat |" in table and "0.200 [0.200, 0.200]" in table


def test_gold_scores_by_kind():
    assert gold_scores("lead", "Zebras are equines.", "Zebras are African equines.")["lead_f1"] > 0.5
    assert gold_scores("needle", "It is 48213.", "48213") == {"lead_f1": None, "lead_rouge_l": None, "em": 1.0}
