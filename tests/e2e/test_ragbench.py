"""The benchmark end to end on the tiny model: real servers per configuration, one trace.

HiCache's configuration is left out here (its server is checked in test_http_server, and
its flags in the unit tests): each configuration costs a server start per rate."""

from __future__ import annotations

import json

import pytest

from pcr_eval.ragbench.compare import main

pytestmark = pytest.mark.e2e


def test_quick_benchmark_runs_every_configuration_and_reports(tiny_model, tmp_path):
    out = tmp_path / "report"
    code = main(
        [
            "--quick",
            "--model-path",
            tiny_model,
            "--configs",
            "radix,pcr,oracle",
            "--requests",
            "4",
            "--followups",
            "1",
            "--corpus-docs",
            "60",
            "--rates",
            "8,16",
            "--out",
            str(out),
        ]
    )
    report = json.loads((out / "report.json").read_text())
    assert code == 0 and report["outputs_identical"] and not report["meta"]["failed_runs"]
    assert {(r["config"], r["rate"]) for r in report["runs"]} == {
        (c, rate) for c in ("radix", "pcr", "oracle") for rate in (8, 16)
    }
    for run in report["runs"]:
        assert run["requests"] == 8 and run["errors"] == 0  # 4 sessions of two turns
        assert run["ttft_ms"]["p99"] >= run["ttft_ms"]["p50"] > 0
        # No run reuses more than the trace allows from an empty cache: the radix and
        # oracle servers kept for the second rate were flushed in between. A fresh server's
        # own warm-up request (SGLang sends one at startup) leaves its BOS token in a radix
        # tree of page 1, which the first prompt (BOS first) then reuses: one token.
        warmup_bos = 1 if run["config"] in ("radix", "oracle") and run["startup_s"] > 0 else 0
        assert run["cached_tokens"] <= run["reuse_potential_tokens"] + warmup_bos
        assert (run["startup_s"] == 0) == (run["config"] in ("radix", "oracle") and run["rate"] == 16)
    runs = {r["config"]: r for r in report["runs"] if r["rate"] == 16}
    # Follow-ups repeat their session's prompt: every configuration reuses something, and
    # the oracle, which never evicts, reuses at least as much as the radix cache.
    assert all(run["hit_ratio"] > 0 for run in runs.values())
    assert runs["oracle"]["cached_tokens"] >= runs["radix"]["cached_tokens"]
    assert [h["rate"] for h in report["headline"]] == [8, 16]  # PCR's ratios at each rate
    for headline in report["headline"]:
        assert {"mean_vs_radix", "p99_vs_radix", "mean_vs_oracle"} <= set(headline)
    assert (out / "trace-headline.jsonl").is_file()
    for name in ("report.md", "ttft_vs_rate.png", "ttft_percentiles.png", "hit_ratio_by_tier.png"):
        assert (out / name).stat().st_size > 0
