"""The one-at-a-time comparison's summary: paired differences on the same requests, the
per-token line, reuse by tier and CPU seconds per request."""

from __future__ import annotations

import pytest

from pcr_eval.ragbench.one_at_a_time import Sent, markdown, summarize


def _sent(rid: str, ttft: float, cached: int, cpu: float, tiers=None, out=(1, 2)) -> Sent:
    return Sent(rid, ttft, 400, cached, tiers or ({"device": cached} if cached else {}), cpu, list(out))


def test_the_summary_pairs_each_configuration_with_the_reference_on_the_same_requests():
    runs = {
        "hicache": [_sent("a", 1000, 0, 3.0), _sent("b", 900, 100, 2.0), _sent("c", 800, 200, 2.5)],
        "pcr": [
            _sent("a", 950, 0, 2.0),
            _sent("b", 600, 200, 2.0, {"device": 100, "storage": 100}),
            _sent("c", 780, 200, 2.0, out=(1, 3)),
            Sent("d", float("nan"), 400, 0, {}, 0.0, [], error="HTTP 500"),
        ],
    }
    rows = {r["config"]: r for r in summarize(runs, "hicache")}
    pcr = rows["pcr"]
    assert pcr["paired_median_diff_ms"] == -50  # -50, -300, -20
    # Requests computing as many tokens on both: a and c.
    assert pcr["same_work_requests"] == 2 and pcr["same_work_median_diff_ms"] == pytest.approx(-35)
    assert pcr["identical_outputs"] == 2 and pcr["requests"] == 3 and pcr["failed"] == 1  # d left out
    assert pcr["cpu_s_per_request"] == pytest.approx(2.0)
    assert pcr["reused_by_tier"] == {"device": pytest.approx(300 / 1200), "storage": pytest.approx(100 / 1200)}
    assert pcr["uncached_mean"] == pytest.approx((400 + 200 + 200) / 3)
    # hicache: TTFT 1000, 900, 800 over 400, 300, 200 uncached tokens: 1 ms a token, 600 ms on top.
    assert rows["hicache"]["ms_per_uncached_token"] == pytest.approx(1.0)
    assert rows["hicache"]["intercept_ms"] == pytest.approx(600)
    assert rows["hicache"]["paired_median_diff_ms"] == 0 and rows["hicache"]["identical_outputs"] is None
    text = markdown(
        {"date": "d", "command": "c", "commit": "x", "machine": "m", "elapsed_s": 60, "trace": "t", "pool_tokens": 1},
        list(rows.values()),
        "hicache",
    )
    assert "| pcr | 777 ms | 780 ms |" in text and "-50 ms; -35 ms (2 requests) | 2/3 | 1 |" in text
    assert "| -/3 | 0 |" in text  # the reference against itself


def test_a_configuration_without_the_reference_has_no_paired_figures():
    rows = summarize({"pcr": [_sent("a", 500, 0, 1.0)]}, "hicache")
    assert rows[0]["paired_median_diff_ms"] is None and rows[0]["same_work_requests"] == 0
    assert rows[0]["ms_per_uncached_token"] is None  # one point: no line
