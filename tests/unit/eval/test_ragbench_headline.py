"""The headline benchmark's own logic: the noise floor's shuffled prompts, the agreement
with full prefill, the table's figures and the targets."""

from __future__ import annotations

import random

import pytest

from pcr_eval.ragbench.headline import (
    Reference,
    agreement,
    anatomy,
    anatomy_table,
    check_targets,
    markdown,
    online_reuse_bound,
    per_request,
    run_row,
    shuffled_prompt,
    table,
)
from pcr_eval.ragbench.runner import RequestRecord, RunResult
from pcr_eval.ragbench.workload import Document, Trace, TraceRequest, WorkloadParams


def test_a_shuffled_prompt_moves_whole_documents_and_keeps_what_lies_between():
    # [sys 1 2][doc 10 11][sep 0][doc 20][sep 0][doc 30 31 32][question 9]
    ids = [1, 2, 10, 11, 0, 20, 0, 30, 31, 32, 9]
    bounds = [2, 4, 5, 6, 7, 10]
    for seed in range(5):
        out = shuffled_prompt(ids, bounds, random.Random(seed))
        assert out != ids and sorted(out) == sorted(ids)
        assert out[:2] == [1, 2] and out[-1] == 9
        docs = {(10, 11), (20,), (30, 31, 32)}
        # Every document whole, separated by the separators in their places.
        text = " ".join(map(str, out[2:-1]))
        assert text.count(" 0 ") == 2 and {tuple(map(int, part.split())) for part in text.split(" 0 ")} == docs


def test_a_prompt_with_one_document_is_not_shuffled():
    assert shuffled_prompt([1, 5, 6, 9], [1, 3], random.Random(0)) == [1, 5, 6, 9]


def test_agreement_is_token_f1_over_decoded_answers_and_the_identical_share():
    decode = {(1, 2): "Paris France", (1, 3): "Paris", (4,): "Berlin"}.__getitem__
    out = agreement(
        {"a": [1, 2], "b": [1, 3], "c": [4]}, {"a": [1, 2], "b": [1, 2], "c": [1, 3]}, lambda ids: decode(tuple(ids))
    )
    # a: identical (1.0); b: "paris" vs "paris france" (2/3); c: nothing shared (0).
    assert out["f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert out["identical"] == pytest.approx(1 / 3) and out["requests"] == 3


def _record(rid: str, ttft: float, cached: int, output: list[int], error: str | None = None) -> RequestRecord:
    return RequestRecord(
        rid=rid,
        session=rid,
        turn=0,
        scheduled_s=0.0,
        sent_s=0.0,
        ttft_s=ttft,
        e2e_s=2 * ttft,
        itl_s=None,
        prompt_tokens=100,
        cached_tokens=cached,
        cached_by_tier={},
        output_ids=output,
        error=error,
    )


def test_a_rows_figures_leave_failed_requests_out_and_count_them():
    run = RunResult(
        "pcr-blend-cal",
        0.5,
        "load-0.6",
        0.1,
        [_record("a", 0.1, 80, [1]), _record("b", 0.3, 60, [2]), _record("c", float("nan"), 0, [], "x")],
        makespan_s=10.0,
        startup_s=0.0,
        queue_depth_mean=0.0,
        queue_depth_max=0.0,
    )
    run.server_state = {"doc_reuse": {"counters": {"canonical_requests": 2}}}
    row = run_row(run, 0.6, Reference({"a": [1], "b": [3], "c": [1]}, {}), lambda ids: str(ids))
    assert row["doc_reuse_counters"] == {"canonical_requests": 2}
    assert row["failed"] == 1 and row["reused_share"] == pytest.approx(140 / 200)
    assert row["ttft_median_ms"] == pytest.approx(200) and row["ttft_mean_ms"] == pytest.approx(200)
    assert row["identical_to_full"] == pytest.approx(0.5)
    assert "| 60% (0.50/s) | pcr-blend-cal | 200 ms |" in table([row], {"f1": 0.5, "identical": 0.25})


def _row(config, load, mean, p99, f1=0.8):
    return {"config": config, "load": load, "ttft_mean_ms": mean, "ttft_p99_ms": p99, "f1_vs_full": f1}


def test_the_targets_hold_document_reuse_to_hicache_the_noise_floor_and_radix():
    rows = [
        _row("radix", 0.6, 500, 900),
        _row("hicache", 0.6, 400, 1000),
        _row("pcr-blend-cal", 0.6, 150, 600),
        _row("pcr-blend-cal-pre", 0.6, 100, 400, f1=0.5),
        _row("pcr", 0.3, 300, 500),
        _row("radix", 0.3, 250, 400),
    ]
    checks = {c["what"]: c for c in check_targets(rows, noise_floor_f1=0.6)}
    p99 = checks["pcr-blend-cal at 60% load: HiCache's P99 TTFT / its own"]
    assert p99["value"] == pytest.approx(1000 / 600) and p99["met"] is False
    assert checks["pcr-blend-cal at 60% load: HiCache's mean TTFT / its own"]["met"] is True
    assert checks["pcr-blend-cal-pre at 60% load: HiCache's P99 TTFT / its own"]["met"] is True
    assert checks["pcr-blend-cal at 60% load: answers' F1 vs full prefill"]["met"] is True
    assert checks["pcr-blend-cal-pre at 60% load: answers' F1 vs full prefill"]["met"] is False
    assert checks["pcr at 30% load: mean TTFT / radix's"]["met"] is False  # 300 vs 250
    assert checks["pcr-blend-cal at 60% load: mean TTFT / radix's"]["met"] is True
    assert not any(c["what"].startswith(("radix", "hicache")) for c in checks.values())


def test_the_anatomy_fits_ttft_to_uncached_tokens_and_finds_the_slowest_requests_wait():
    """TTFT = 50 ms + 1 ms per uncached token, except one request that waited 300 ms more."""
    records = [
        _record(rid, (50 + uncached + extra) / 1000, 100 - uncached, [1])
        for rid, uncached, extra in (("a", 10, 0), ("b", 40, 0), ("c", 70, 0), ("d", 20, 300))
    ]
    run = RunResult(
        "pcr",
        0.4,
        "load-0.6",
        0.1,
        records,
        makespan_s=10.0,
        startup_s=0.0,
        queue_depth_mean=1.5,
        queue_depth_max=3.0,
        server_state={
            "scheduler_step": {"pcr": {"p50_ms": 0.5, "p99_ms": 2.0}, "iteration": {"p50_ms": 40, "p99_ms": 90}},
            "ssd": {"counters": {"hit_chunks": 9, "held_requests": 4, "held_expired": 1, "held_ms": 500}},
        },
    )
    row = anatomy(run, 0.6)
    assert row["slowest_uncached"] == 20 and row["slowest_ttft_ms"] == pytest.approx(370)
    assert row["ms_per_uncached_token"] == pytest.approx(1.0) and row["intercept_ms"] == pytest.approx(50)
    assert row["slowest_wait_ms"] == pytest.approx(300)
    assert row["pcr_step_p99_ms"] == 2.0 and row["iteration_p50_ms"] == 40
    text = anatomy_table([row])
    assert "| 60% | pcr |" in text and "| 4 (1), 125 ms |" in text  # 4 held (1 ran out), 500 ms in all


def _meta(name, rows, failed=()):
    """A run's ``headline.json`` meta, as ``main`` writes it (rates keyed by load, as JSON has them)."""
    return {
        "date": "2026-12-07",
        "command": f"python -m bench.ragbench headline ({name})",
        "commit": name,
        "machine": "m",
        "elapsed_s": 60.0,
        "model": "tuned",
        "trace": "t",
        "pool_tokens": 100,
        "working_set_over_pool": 2.0,
        "host_gb": 0.1,
        "ssd_gb": 1.0,
        "capacity_rps": 0.4,
        "capacity_requests": 12,
        "capacity_makespan_s": 30.0,
        "rates": {str(r["load"]): r["rate"] for r in rows},
        "capacity_measured": False,
        "failed_runs": list(failed),
    }


def _run_dir(tmp_path, name, rows, noise_f1=0.6, failed=()):
    import json

    d = tmp_path / name
    d.mkdir()
    meta = _meta(name, rows, failed)
    (d / "headline.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "anatomy": [], "noise_floor": {"f1": noise_f1, "identical": 0.3}})
    )
    return d


def _full_row(config, load, mean, p99):
    return {
        "config": config,
        "load": load,
        "rate": load * 0.4,
        "requests": 12,
        "failed": 0,
        "ttft_median_ms": mean,
        "ttft_p99_ms": p99,
        "ttft_mean_ms": mean,
        "e2e_p99_ms": 2 * p99,
        "reused_tokens": 10,
        "prompt_tokens": 100,
        "reused_share": 0.1,
        "f1_vs_full": 1.0,
        "identical_to_full": 1.0,
    }


def test_merged_runs_make_one_report_a_later_row_replacing_an_earlier_one(tmp_path):
    from pcr_eval.ragbench.headline import merge

    first = _run_dir(
        tmp_path,
        "a",
        [_full_row("radix", 0.6, 500, 900), _full_row("pcr-blend-cal-pre", 0.6, 300, 500)],
        failed=["hicache@60%: no memory"],
    )
    second = _run_dir(tmp_path, "b", [_full_row("hicache", 0.6, 700, 1200), _full_row("radix", 0.6, 520, 950)])
    assert merge([first, second], tmp_path / "out") == 0
    text = (tmp_path / "out" / "headline.md").read_text()
    assert "| 60% (0.24/s) | radix | 520 ms |" in text and "| radix | 500 ms |" not in text
    assert "Rows replaced by a later run: radix@60%." in text
    assert "HiCache's P99 TTFT / its own >= 2.0x: 2.40x (met)" in text  # 1200 / 500
    assert "Failed runs" not in text  # hicache@60% was measured by the later run
    other = _run_dir(tmp_path, "c", [_full_row("radix", 0.3, 400, 800)], noise_f1=0.5)
    with pytest.raises(SystemExit, match="noise floors differ"):
        merge([first, other], tmp_path / "out2")


class _SaturatedServer:
    """Answers every streamed request with one token; ``failing``: first token ids that fail."""

    base_url = "http://127.0.0.1:9"  # the queue sampler's reads fail and are skipped

    def __init__(self, failing=()):
        self.failing = set(failing)

    def generate_stream(self, body, timeout_s=None):
        from pcr_tools.launcher import StreamedResponse

        if body["input_ids"][0] in self.failing:
            raise ValueError("server said no")
        return StreamedResponse(ttft_s=0.01, latency_s=0.02, final={"output_ids": [7], "meta_info": {}})


def test_saturate_sends_every_first_turn_and_a_failed_one_raises_with_its_label():
    from types import SimpleNamespace

    from pcr_eval.ragbench.operating_points import saturate
    from pcr_eval.ragbench.workload import WorkloadParams, make_trace

    trace = make_trace(
        WorkloadParams(source="synthetic", num_requests=3, corpus_docs=10, seed=1),
        count_tokens=lambda text: len(text.split()),
    )
    ids = {r.rid: [i + 1, 0, 0] for i, r in enumerate(trace.first_turns())}
    model = SimpleNamespace(prompt=lambda t, r, a: (ids[r.rid], []), decode=str)
    capacity, records = saturate(_SaturatedServer(), model, trace, "capacity run")
    assert capacity.requests == 3 and [r.output_ids for r in records] == [[7]] * 3
    with pytest.raises(RuntimeError, match=r"^reference run: 1 of 3 requests failed"):
        saturate(_SaturatedServer(failing={2}), model, trace, "reference run")


def test_run_all_replays_every_run_in_order_and_reports_a_failed_one_under_its_key(monkeypatch):
    """The loop the headline and the operating points share: a run that fails is None in
    the results and ``"<key>: <last line of the error>"`` in the failures; the others keep
    their results, in order, with the budgets they ran under."""
    from types import SimpleNamespace

    from pcr_eval.ragbench import operating_points

    class Pool:
        def __init__(self, path, plans):
            self.plans = plans

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def run_planned(run, servers, index, prompt_of, decode, on_done):
        if run.config == "broken":
            raise RuntimeError("server exited\nwith code -9")
        on_done()
        return SimpleNamespace(config=run.config, server_state={})

    monkeypatch.setattr(operating_points, "ServerPool", Pool)
    monkeypatch.setattr(operating_points, "run_planned", run_planned)
    planned = [
        SimpleNamespace(config=c, plan=c, budgets=SimpleNamespace(pool=i))
        for i, c in enumerate(("radix", "broken", "pcr"))
    ]
    model = SimpleNamespace(path="m", prompt=None, decode=None)
    trace = SimpleNamespace(requests=[1, 2])
    results, failed = operating_points.run_all(
        planned, [(c, f"{c}@60%") for c in ("radix", "broken", "pcr")], model, trace
    )
    assert [r.config if r else None for r in results] == ["radix", None, "pcr"]
    assert results[2].server_state["budgets"] == {"pool": 2}
    assert failed == ["broken@60%: with code -9"]


def test_per_request_keeps_each_request_for_pairing_runs_a_failed_one_without_a_ttft():
    records = [_record("a", 0.25, 80, [1]), _record("b", float("nan"), 0, [], "x")]
    run = RunResult("pcr", 0.5, "load-0.6", 0.1, records, 10.0, 0.0, 0.0, 0.0)
    rows = per_request(run)
    assert [r["rid"] for r in rows] == ["a", "b"]
    assert rows[0]["ttft_ms"] == 250.0 and rows[0]["uncached"] == 20
    assert rows[1]["ttft_ms"] is None and rows[1]["uncached"] == 100


def test_the_online_reuse_bound_counts_documents_from_their_second_sighting():
    # Each prompt: 2 leading tokens, its documents (a: 4 tokens, b: 3, c: 5), 1 question token.
    lengths = {"a": 4, "b": 3, "c": 5}
    requests = [("a", "b"), ("b", "a"), ("c", "a"), ("b",)]
    trace = Trace(
        WorkloadParams(),
        {d: Document(d, d, d) for d in lengths},
        [TraceRequest(f"r{i}", docs, "q", 4, arrival=float(i)) for i, docs in enumerate(requests)]
        + [TraceRequest("follow-up", (), "q", 4, parent="r0")],  # not a first turn: not counted
    )

    def prompt_of(trace, request, answers):
        bounds, at = [], 2
        for doc_id in request.doc_ids:
            bounds += [at, at + lengths[doc_id]]
            at += lengths[doc_id]
        return list(range(at + 1)), bounds

    bound = online_reuse_bound(trace, prompt_of)
    total = (2 + 7 + 1) * 2 + (2 + 9 + 1) + (2 + 3 + 1)
    # Leading tokens from the second request on; a in r1 and r2, b in r1 and r3; c never.
    assert bound == pytest.approx((3 * 2 + 7 + 4 + 3) / total)

    meta = {**_meta("bound", []), "online_reuse_bound": bound}
    text = markdown(meta, [], {"f1": None, "identical": None}, [])
    assert f"at most {bound:.0%} of the prompt tokens" in text
    del meta["online_reuse_bound"]  # a report of an earlier run has none
    assert "online reuse bound" not in markdown(meta, [], {"f1": None, "identical": None}, [])
