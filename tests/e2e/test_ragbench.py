"""The benchmark end to end on the tiny model: real servers per configuration, one trace."""

from __future__ import annotations

import json

from bench.ragbench.__main__ import main


def test_quick_benchmark_runs_every_configuration_and_reports(tiny_model, tmp_path):
    out = tmp_path / "report"
    code = main(["--quick", "--model-path", tiny_model, "--configs", "radix,hicache,pcr,oracle",
                 "--requests", "6", "--followups", "1", "--corpus-docs", "60", "--rates", "8",
                 "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert code == 0 and report["outputs_identical"] and not report["meta"]["failed_runs"]
    runs = {r["config"]: r for r in report["runs"]}
    assert set(runs) == {"radix", "hicache", "pcr", "oracle"}
    for run in runs.values():
        assert run["requests"] == 12 and run["errors"] == 0  # 6 sessions of two turns
        assert run["ttft_ms"]["p99"] >= run["ttft_ms"]["p50"] > 0
    # Follow-ups repeat their session's prompt: every configuration reuses something, and
    # the oracle, which never evicts, reuses at least as much as the radix cache.
    assert all(run["hit_ratio"] > 0 for run in runs.values())
    assert runs["oracle"]["cached_tokens"] >= runs["radix"]["cached_tokens"]
    (headline,) = report["headline"]
    assert {"mean_vs_radix", "p99_vs_hicache", "mean_vs_oracle"} <= set(headline)
    assert (out / "trace-headline.jsonl").is_file()
    for name in ("report.md", "ttft_vs_rate.png", "ttft_percentiles.png", "hit_ratio_by_tier.png"):
        assert (out / name).stat().st_size > 0
