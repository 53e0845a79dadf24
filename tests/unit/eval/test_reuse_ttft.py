"""The TTFT benchmark over server starts: its round order, per-round ratios, what one start
measures, and its report."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pcr_eval.modes import ModeSpec
from pcr_eval.ttft import (
    EXACT_HIT,
    FULL,
    StartResult,
    markdown,
    measure_start,
    model_order,
    recompute_bound_name,
    reference_rows,
    summarize,
)
from pcr_sglang.reuse.bounds import WARM_NOW_PARAM
from pcr_tools.launcher import StreamedResponse


def test_models_alternate_between_rounds():
    assert model_order(["base", "tuned"], 0) == ["base", "tuned"]
    assert model_order(["base", "tuned"], 1) == ["tuned", "base"]
    assert model_order(["base", "tuned"], 2) == ["base", "tuned"]


def _starts():
    # Round 0: tuned 10% slower in full prefill; round 1: 10% faster; concat equal in both.
    return [
        StartResult("base", 0, "doc-reuse", 20.0, {FULL: 0.500, "concat": 0.200}),
        StartResult("tuned", 0, "doc-reuse", 20.0, {FULL: 0.550, "concat": 0.200}),
        StartResult("tuned", 1, "doc-reuse", 20.0, {FULL: 0.540, "concat": 0.250}),
        StartResult("base", 1, "doc-reuse", 20.0, {FULL: 0.600, "concat": 0.250}),
    ]


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


@pytest.mark.parametrize("missing", [0, 3], ids=["base-of-round-0", "base-of-round-1"])
def test_a_round_missing_the_base_model_gives_no_ratio_and_shifts_none(missing):
    """Ratios pair by round, not by position: with a base start missing, the other round's
    ratio is still its own (pairing the two models' lists in order would give 1.08 or 0.92)."""
    starts = [s for i, s in enumerate(_starts()) if i != missing]
    expected = [0.9] if missing == 0 else [1.1]
    assert summarize(starts, ["base", "tuned"], [FULL])["ratio_to_base"]["tuned"][FULL]["per_round"] == pytest.approx(
        expected
    )


def test_the_report_names_every_mode_and_the_ratio():
    summary = summarize(_starts(), ["base", "tuned"], [FULL, "concat"])
    text = markdown(summary, ["base", "tuned"], [FULL, "concat"])
    assert "| base | full | 550 | 500, 600 | 20% |" in text
    assert "| full | +0.0% | +10%, -10% |" in text
    assert "| concat | +0.0% | +0%, +0% |" in text


@dataclass
class _Prompt:
    input_ids: list[int]
    doc_bounds: list[int]

    @property
    def last_doc_end(self) -> int:
        return self.doc_bounds[-1]


class _Server:
    """Answers every request; TTFT is the prompt's first token (so each prompt's is known),
    a marked request reuses its documents unless its first token is in ``not_reusing``, and
    a request whose first token is in ``failing`` raises."""

    def __init__(self, failing=(), not_reusing=(), error_chunks=(), cached_marked=6, cached_unmarked=()):
        self.streamed: list[dict] = []
        self.warmed: list[dict] = []
        self.failing, self.not_reusing, self.error_chunks = set(failing), set(not_reusing), set(error_chunks)
        self.cached_marked, self.cached_unmarked = cached_marked, set(cached_unmarked)
        self.prefixes: dict[str, list[int]] = {}  # an exact hit's prefix, sent unmarked, per namespace

    def generate(self, body):
        if "custom_params" not in body["sampling_params"]:
            self.prefixes[body["extra_key"]] = body["input_ids"]
            return {}
        assert body["sampling_params"]["custom_params"][WARM_NOW_PARAM] is True
        self.warmed.append(body)
        return {}

    def generate_stream(self, body):
        first = body["input_ids"][0]
        if first in self.failing:
            raise ConnectionError("server gone")
        self.streamed.append(body)
        if first in self.error_chunks:  # SGLang's way: HTTP 200, then an error chunk
            return StreamedResponse(ttft_s=0.001, latency_s=0.001, final={"error": {"message": "boom"}})
        marked = "custom_params" in body["sampling_params"]
        if marked:
            cached = 0 if first in self.not_reusing else self.cached_marked
        elif body["extra_key"] in self.prefixes:
            cached = len(self.prefixes[body["extra_key"]])
        else:
            cached = 4 if first in self.cached_unmarked else 0
        return StreamedResponse(
            ttft_s=first / 1000, latency_s=first / 1000, final={"meta_info": {"cached_tokens": cached}}
        )


def _prompts(firsts):
    return [_Prompt([first, 1, 2, 3, 4, 5, 6, 7], [1, 3, 3, 6]) for first in firsts]


def test_warm_up_questions_are_sent_but_not_counted():
    server = _Server()
    medians, errors, not_reused = measure_start(
        server, _prompts([900, 800]), _prompts([10, 20, 30]), [ModeSpec("concat")]
    )
    assert medians == {
        FULL: pytest.approx(0.020),
        "concat": pytest.approx(0.020),
        EXACT_HIT: pytest.approx(0.020),
    }  # 900 and 800 left out
    assert len(server.streamed) == 3 * 5 and len(server.warmed) == 5  # every question, every mode, once
    assert errors == {FULL: 0, "concat": 0, EXACT_HIT: 0} and not_reused == {FULL: 0, "concat": 0, EXACT_HIT: 0}
    # Each request under a namespace of its own: nothing one caches is another's prefix.
    keys = [b["extra_key"] for b in server.streamed]
    assert len(set(keys)) == len(keys)


def test_failed_and_not_reusing_requests_are_counted_and_left_out():
    server = _Server(failing={30}, not_reusing={20})
    medians, errors, not_reused = measure_start(server, [], _prompts([10, 20, 30, 40]), [ModeSpec("concat")])
    assert errors == {FULL: 1, "concat": 1, EXACT_HIT: 1}
    assert not_reused == {FULL: 0, "concat": 1, EXACT_HIT: 0}
    assert medians[FULL] == pytest.approx(0.020)  # 10, 20, 40
    assert medians["concat"] == pytest.approx(0.025)  # 10, 40


def test_an_error_inside_the_stream_is_a_failure_not_a_fast_answer():
    server = _Server(error_chunks={20})
    medians, errors, _ = measure_start(server, [], _prompts([10, 20, 30]), [ModeSpec("concat")])
    assert errors == {FULL: 1, "concat": 1, EXACT_HIT: 1}
    assert medians[FULL] == pytest.approx(0.020)  # 10 and 30: the error's 1 ms left out


def test_an_unmarked_request_that_hit_the_cache_is_not_counted_as_cold():
    _, _, not_reused = measure_start(_Server(cached_unmarked={20}), [], _prompts([10, 20, 30]), [])
    assert not_reused == {FULL: 1}


def test_a_marked_request_warms_and_is_measured_under_one_namespace():
    server = _Server()
    measure_start(server, [], _prompts([10]), [ModeSpec("concat")])
    marked = [b for b in server.streamed if "custom_params" in b["sampling_params"]]
    assert [b["extra_key"] for b in server.warmed] == [b["extra_key"] for b in marked]


def test_a_recomputing_mode_counts_its_recomputed_tokens_as_reused():
    """Documents [3, 6) re-placed: blend at R=0.5 recomputes 2 of its 3 tokens, so 4 cached
    tokens are all of them reused; for concat, 4 of 6 are not."""
    _, _, not_reused = measure_start(
        _Server(cached_marked=4), [], _prompts([10]), [ModeSpec("concat"), ModeSpec("blend", 0.5)]
    )
    assert not_reused == {FULL: 0, "concat": 1, "blend:0.5": 0, EXACT_HIT: 0, recompute_bound_name("blend:0.5"): 0}


def test_a_recompute_modes_bound_is_an_exact_hit_short_by_its_recomputed_tokens():
    """Blend at R=0.5 recomputes 2 of the re-placed document's 3 tokens, so its bound's exact
    hit caches the prompt's first 6 - 2 = 4 tokens; the plain exact hit caches all 6."""
    server = _Server(cached_marked=4)  # 4 cached + 2 recomputed: every document reused
    medians, _, not_reused = measure_start(server, [], _prompts([10]), [ModeSpec("blend", 0.5)])
    assert sorted(len(p) for p in server.prefixes.values()) == [4, 6]
    assert not any(not_reused.values()) and recompute_bound_name("blend:0.5") in medians


def test_each_mode_is_set_against_its_reference():
    """concat and reorder against the exact hit; blend against concat + (its bound's exact
    hit - the exact hit): 0.200 + (0.150 - 0.100) = 0.250, so 0.300 is 1.2x."""
    modes = ["concat", "reorder", "blend:0.15", EXACT_HIT, recompute_bound_name("blend:0.15")]
    starts = [StartResult("tuned", 0, "doc-reuse", 1.0, dict(zip(modes, [0.200, 0.105, 0.300, 0.100, 0.150])))]
    summary = summarize(starts, ["tuned"], modes)
    rows = {r["mode"]: r for r in reference_rows(summary, ["tuned"], modes)}
    assert rows["concat"]["ratio"] == pytest.approx(2.0) and rows["concat"]["target"] == 1.3
    assert rows["reorder"]["ratio"] == pytest.approx(1.05) and rows["reorder"]["target"] == 1.10
    assert rows["blend:0.15"]["reference_s"] == pytest.approx(0.250)
    assert rows["blend:0.15"]["ratio"] == pytest.approx(1.2)
    text = markdown(summary, ["tuned"], modes)
    assert "| 2.00x | <= 1.30x: missed |" in text and "| 1.20x | <= 1.30x: met |" in text
    assert "tuned / base" not in text  # one model: no ratio to a base it did not run
