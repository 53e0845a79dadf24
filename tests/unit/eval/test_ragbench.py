"""The benchmark's workload generator, trace files and report (no server)."""

from __future__ import annotations

import json
import math

import pytest

from pcr_eval.ragbench.report import build_report, markdown, percentile, reuse_potential, write_report
from pcr_eval.ragbench.runner import Budgets, RequestRecord, RunResult, _cached_by_tier, server_config
from pcr_eval.ragbench.workload import (
    HOT_FRACTION,
    HOT_SHARE,
    WorkloadParams,
    calibrated_exponent,
    hot_share,
    load_trace,
    make_trace,
    save_trace,
)


def test_calibrated_exponent_gives_the_published_skew():
    for n in (100, 1000, 10_000):
        exponent = calibrated_exponent(n)
        assert hot_share(n, exponent) == pytest.approx(HOT_SHARE, abs=1e-6)
        assert hot_share(n, exponent + 0.1) > HOT_SHARE > hot_share(n, exponent - 0.1)
    assert HOT_FRACTION == 0.03


@pytest.fixture(scope="module")
def retrieval_trace():
    params = WorkloadParams(num_requests=12, corpus_docs=60, max_doc_chars=400, followups=1, seed=3)
    return make_trace(params)


def test_retrieval_trace_uses_the_embedder_and_is_deterministic(retrieval_trace):
    from pcr_eval.ragbench.retrieval import EmbeddingIndex

    trace = retrieval_trace
    again = make_trace(trace.params)
    assert again.requests == trace.requests
    docs = list(trace.documents.values())
    index = EmbeddingIndex([f"{d.title}. {d.text}" for d in docs])
    first_turns = trace.first_turns()
    assert len(first_turns) == 12 and len(trace.requests) == 24
    for request in first_turns:
        assert 3 <= len(request.doc_ids) <= 5
        # The documents are the question's nearest neighbours, in retrieval order.
        nearest = index.search([request.question], len(request.doc_ids))[0]
        assert request.doc_ids == tuple(docs[i].doc_id for i in nearest)
    arrivals = [r.arrival for r in first_turns]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert 0.1 < (arrivals[-1] / (len(arrivals) - 1)) < 10  # about one per second


def test_shuffled_and_unique_document_traces(retrieval_trace):
    """``doc_order="shuffled"``: the same documents per request, each in its own order, the
    rest of the trace unchanged; ``unique_docs``: no document in two requests."""
    from dataclasses import replace

    base = retrieval_trace.first_turns()
    shuffled = make_trace(replace(retrieval_trace.params, doc_order="shuffled")).first_turns()
    assert [sorted(r.doc_ids) for r in shuffled] == [sorted(r.doc_ids) for r in base]
    assert [(r.question, r.arrival) for r in shuffled] == [(r.question, r.arrival) for r in base]
    assert sum(a.doc_ids != b.doc_ids for a, b in zip(shuffled, base)) >= len(base) // 2
    unique = make_trace(replace(retrieval_trace.params, unique_docs=True)).first_turns()
    seen = [d for r in unique for d in r.doc_ids]
    assert len(seen) == len(set(seen)) and all(r.doc_ids for r in unique)
    assert len(set(d for r in base for d in r.doc_ids)) < sum(len(r.doc_ids) for r in base)  # base has repeats
    with pytest.raises(ValueError, match="too few left"):  # 30 requests of 3+ documents, 60 in the corpus
        make_trace(replace(retrieval_trace.params, unique_docs=True, num_requests=30))
    with pytest.raises(ValueError, match="doc_order"):
        WorkloadParams(doc_order="sorted")


def test_followups_extend_their_session_with_the_answers(retrieval_trace):
    trace = retrieval_trace
    followup = next(r for r in trace.requests if r.parent is not None)
    first = next(r for r in trace.requests if r.rid == followup.parent)
    assert followup.doc_ids == first.doc_ids and followup.arrival is None and followup.turn == 1
    messages = trace.messages(followup, {first.rid: "THE ANSWER"})
    assert messages[:2] == trace.messages(first, {})
    assert messages[2] == {"role": "assistant", "content": "THE ANSWER"}
    assert messages[3]["content"].endswith(followup.question)


def test_trace_round_trips_through_jsonl(retrieval_trace, tmp_path):
    path = tmp_path / "trace.jsonl"
    save_trace(retrieval_trace, path)
    loaded = load_trace(path)
    assert loaded.requests == retrieval_trace.requests
    assert loaded.documents == retrieval_trace.documents
    assert loaded.params == retrieval_trace.params
    assert loaded.stats == retrieval_trace.stats


def test_bad_trace_files_name_the_line(retrieval_trace, tmp_path):
    path = tmp_path / "trace.jsonl"
    save_trace(retrieval_trace, path)
    lines = path.read_text().splitlines()
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines[:3] + ["{not json"] + lines[4:]) + "\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:4: bad request line"):
        load_trace(broken)
    unknown = json.loads(lines[1])
    unknown["doc_ids"] = ["nope"]
    broken.write_text("\n".join([lines[0], json.dumps(unknown)]) + "\n")
    with pytest.raises(ValueError, match="unknown documents"):
        load_trace(broken)
    broken.write_text(lines[1] + "\n")
    with pytest.raises(ValueError, match="bad trace header"):
        load_trace(broken)


def test_synthetic_documents_have_bounded_lognormal_lengths(tokenizer):
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    params = WorkloadParams(source="synthetic", num_requests=30, corpus_docs=40, zipf_exponent=1.0, seed=1)
    trace = make_trace(params, count_tokens=count)
    lengths = [count(d.text) for d in trace.documents.values()]
    # The generator trims to the target; the final period may add a token.
    assert min(lengths) >= params.synthetic_min_tokens * 0.9
    assert max(lengths) <= params.synthetic_max_tokens + 2
    assert len(set(lengths)) > 10  # spread, not one size
    assert make_trace(params, count_tokens=count).requests == trace.requests
    with pytest.raises(ValueError, match="count_tokens"):
        make_trace(params)


def test_workload_params_are_validated():
    with pytest.raises(ValueError, match="source"):
        WorkloadParams(source="web")
    with pytest.raises(ValueError, match="min_docs"):
        WorkloadParams(min_docs=4, max_docs=3)


# ---------------------------------------------------------------------------- runner
def test_server_configs_share_budgets():
    budgets = Budgets(
        device_pool_tokens=1000,
        oracle_pool_tokens=90000,
        host_gb=0.5,
        ssd_gb=2.0,
        context_length=900,
        kv_bytes_per_token=2**16,
        chunk_size=16,
        page_size=16,
    )
    from pathlib import Path

    storage = Path("/nonexistent-store")
    configs = {
        n: server_config(n, budgets, storage)
        for n in (
            "radix",
            "hicache",
            "oracle",
            "pcr",
            "pcr-layerwise",
            "pcr-prefetch",
            "pcr-lookahead",
            "pcr-device",
            "pcr-blend-cal-idle",
            "pcr-blend-cal-request",
        )
    }

    def flag(config, name):
        return config.args[config.args.index(name) + 1]

    for name, config in configs.items():
        expected = "90000" if name == "oracle" else "1000"
        assert flag(config, "--max-total-tokens") == expected
    # The same host bytes: 0.5 GiB is 8192 tokens of 64 KiB, 8.192 device pools of 1000.
    assert flag(configs["pcr"], "--pcr-dram-gb") == "0.5"
    assert flag(configs["hicache"], "--hicache-ratio") == "8.1920"
    assert flag(configs["pcr-layerwise"], "--pcr-layerwise") == "off"
    assert flag(configs["pcr-prefetch"], "--pcr-prefetch-window") == "0"
    assert flag(configs["pcr-lookahead"], "--pcr-lookahead-window") == "0"
    assert "--enable-pcr" not in configs["radix"].args
    # PCR over the device pool alone: no host tier, no SSD tier.
    assert flag(configs["pcr-device"], "--pcr-dram-gb") == "0" and "--pcr-ssd-path" not in configs["pcr-device"].args
    assert flag(configs["pcr-blend-cal-idle"], "--pcr-doc-warmup") == "idle"
    assert flag(configs["pcr-blend-cal-idle"], "--pcr-doc-reuse") == "blend"
    assert flag(configs["pcr-blend-cal-request"], "--pcr-doc-warmup") == "request"
    with pytest.raises(ValueError, match="unknown configuration"):
        server_config("lmcache", budgets, storage)


def test_cached_tokens_are_split_by_tier():
    assert _cached_by_tier({"cached_tokens": 0}) == {}
    assert _cached_by_tier({"cached_tokens": 48}) == {"device": 48}
    assert _cached_by_tier({"cached_tokens": 64, "cached_tokens_details": {"host": 16, "storage": 32}}) == {
        "device": 16,
        "host": 16,
        "storage": 32,
    }


# ---------------------------------------------------------------------------- report
def _record(rid: str, ttft: float, cached: int, output: list[int], tiers=None, input_ids=(), sent=0.0) -> RequestRecord:
    return RequestRecord(
        rid=rid,
        session=rid,
        turn=0,
        scheduled_s=0.0,
        sent_s=sent,
        ttft_s=ttft,
        e2e_s=ttft + 0.5,
        itl_s=0.1,
        prompt_tokens=100,
        cached_tokens=cached,
        cached_by_tier=tiers or ({"device": cached} if cached else {}),
        output_ids=output,
        input_ids=list(input_ids),
    )


def test_reuse_potential_counts_longest_earlier_prefix_in_send_order():
    first = _record("a", 0.1, 0, [7, 8], input_ids=[1, 2, 3, 4], sent=0.0)
    shares_three = _record("b", 0.1, 0, [9], input_ids=[1, 2, 3, 5, 6], sent=1.0)
    follow_up = _record("c", 0.1, 0, [1], input_ids=[1, 2, 3, 4, 7, 8, 5], sent=2.0)  # a's prompt + answer
    repeat = _record("d", 0.1, 0, [1], input_ids=[1, 2, 3, 4], sent=3.0)  # all but its last token
    assert reuse_potential([first]) == 0
    assert reuse_potential([repeat, shares_three, first, follow_up]) == 3 + 6 + 3


def _run(config: str, ttfts: list[float], cached: int, outputs: list[list[int]], rate: float = 2.0) -> RunResult:
    records = [_record(f"r{i}", t, cached, o) for i, (t, o) in enumerate(zip(ttfts, outputs))]
    return RunResult(
        config=config,
        rate=rate,
        label="headline",
        pool_fraction=0.05,
        records=records,
        makespan_s=10.0,
        startup_s=5.0,
        queue_depth_mean=4.5,
        queue_depth_max=9,
    )


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2], 50) == 1.5
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def test_report_ratios_and_outputs_check(tmp_path):
    outputs = [[1, 2], [3, 4]]
    runs = [
        _run("oracle", [0.1, 0.1], 80, outputs),
        _run("radix", [0.4, 0.8], 40, outputs),
        _run("hicache", [0.3, 0.6], 60, outputs),
        _run("pcr", [0.1, 0.2], 78, outputs),
    ]
    report = build_report(runs, {"date": "2026-11-29", "headline_label": "headline"})
    assert report["outputs_identical"] is True
    (headline,) = report["headline"]
    assert headline["mean_vs_radix"] == pytest.approx(0.15 / 0.6)
    assert headline["reuse_vs_oracle"] == pytest.approx(78 / 80)
    pcr = next(s for s in report["runs"] if s["config"] == "pcr")
    assert pcr["hit_ratio"] == pytest.approx(0.78) and pcr["throughput_rps"] == pytest.approx(0.2)
    paths = write_report(report, tmp_path)
    assert {p.name for p in paths} == {
        "report.json",
        "report.md",
        "ttft_vs_rate.png",
        "ttft_percentiles.png",
        "hit_ratio_by_tier.png",
    }
    assert all(p.stat().st_size > 0 for p in paths)
    assert "every configuration's greedy outputs match" in (tmp_path / "report.md").read_text()

    runs.append(_run("pcr-prefetch", [0.1, 0.2], 78, [[1, 2], [3, 5]]))
    report = build_report(runs, {"headline_label": "headline"})
    assert report["outputs_identical"] is False
    assert report["outputs_mismatched"] == ["headline/pcr-prefetch@2"]
    assert "Outputs check FAILED for: headline/pcr-prefetch@2" in markdown(report)
