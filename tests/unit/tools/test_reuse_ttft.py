"""The TTFT benchmark over server starts: its round order, per-round ratios and report."""

from __future__ import annotations

import pytest

from bench.reuse_ttft import FULL, StartResult, markdown, model_order, summarize


def test_models_alternate_between_rounds():
    assert model_order(["base", "tuned"], 0) == ["base", "tuned"]
    assert model_order(["base", "tuned"], 1) == ["tuned", "base"]
    assert model_order(["base", "tuned"], 2) == ["base", "tuned"]


def _starts():
    # Round 0: tuned 10% slower in full prefill; round 1: 10% faster; concat equal in both.
    return [StartResult("base", 0, 20.0, {FULL: 0.500, "concat": 0.200}),
            StartResult("tuned", 0, 20.0, {FULL: 0.550, "concat": 0.200}),
            StartResult("tuned", 1, 20.0, {FULL: 0.540, "concat": 0.250}),
            StartResult("base", 1, 20.0, {FULL: 0.600, "concat": 0.250})]


def test_ratios_pair_the_starts_of_one_round():
    summary = summarize(_starts(), ["base", "tuned"], [FULL, "concat"])
    full = summary["ratio_to_base"]["tuned"][FULL]
    assert full["per_round"] == pytest.approx([1.1, 0.9])
    assert full["median"] == pytest.approx(1.0)
    assert summary["ratio_to_base"]["tuned"]["concat"]["per_round"] == pytest.approx([1.0, 1.0])
    assert "base" not in summary["ratio_to_base"]


def test_the_spread_between_starts_is_reported_per_model():
    summary = summarize(_starts(), ["base", "tuned"], [FULL, "concat"])
    base_full = summary["per_model"]["base"][FULL]
    assert base_full["starts"] == [0.5, 0.6]
    assert base_full["median_s"] == pytest.approx(0.55)
    assert base_full["spread"] == pytest.approx(1.2)


def test_a_round_missing_a_model_gives_no_ratio():
    summary = summarize(_starts()[:3], ["base", "tuned"], [FULL])
    assert summary["ratio_to_base"]["tuned"][FULL]["per_round"] == pytest.approx([1.1])


def test_the_report_names_every_mode_and_the_ratio():
    summary = summarize(_starts(), ["base", "tuned"], [FULL, "concat"])
    text = markdown(summary, ["base", "tuned"], [FULL, "concat"])
    assert "| base | full | 550 | 500, 600 | 20% |" in text
    assert "| full | +0.0% | +10%, -10% |" in text
    assert "| concat | +0.0% | +0%, +0% |" in text
