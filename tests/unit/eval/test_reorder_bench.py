"""``reorder`` in the document-reuse benchmarks: the mode's spec, the warm-up that sets the
order it follows (the noise floor's shuffle, no question), what counts as all documents
reused (an exact hit in whole chunks), the offline applicability replay of a trace, and
the TTFT benchmark's exact-prefix-hit reference."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pcr_eval.gold import GoldPrompt
from pcr_eval.modes import ModeSpec, parse_mode, parse_modes
from pcr_eval.reorder_applicability import reorder_applicability, reorder_applicability_table
from pcr_eval.requests import all_docs_reused, warm_request
from pcr_eval.serving import server_mode
from pcr_eval.ttft import EXACT_HIT, FULL, StartResult, markdown, measure_start, summarize
from pcr_sglang.reuse.bounds import DOC_BOUNDS_PARAM, DOC_MODE_PARAM, parse_doc_bounds
from pcr_sglang.reuse.reorder import OrderStore, Tenant
from pcr_tools.launcher import StreamedResponse

LEAD = [1, 2, 3]
DOCS = {"A": [10, 11, 12, 13, 14], "B": [20, 21, 22], "C": [30, 31, 32, 33]}
QUESTION = [90, 91]


def tokens(names: str, question: list[int] = QUESTION) -> tuple[list[int], list[int]]:
    ids, bounds = list(LEAD), []
    for name in names:
        bounds += [len(ids), len(ids) + len(DOCS[name])]
        ids += DOCS[name]
    return ids + question, bounds


def gold(names: str, shuffled: str) -> GoldPrompt:
    ids, bounds = tokens(names)
    shuffled_ids, shuffled_bounds = tokens(shuffled)
    return GoldPrompt(0, "q-0", None, ids, bounds, shuffled_ids, [7], shuffled_bounds)


def test_the_reorder_spec_takes_no_value_and_asks_for_the_mode():
    assert parse_mode("reorder") == ModeSpec("reorder")
    assert ModeSpec("reorder").custom_params() == {DOC_MODE_PARAM: "reorder"}
    assert ModeSpec("reorder").recomputed_if_all_reused([3, 8, 8, 11]) == 0
    with pytest.raises(argparse.ArgumentTypeError, match="takes no :value"):
        parse_mode("reorder:3")
    assert server_mode(parse_modes("reorder")) == "concat"  # any document-reuse server serves it
    assert server_mode(parse_modes("reorder,blend:0.1")) == "blend"


def test_the_warm_up_sets_the_shuffled_order_and_the_measured_prompt_is_served_as_the_shuffled_one():
    p = gold("ABC", "CAB")
    warm = warm_request(p, ModeSpec("reorder"), "ns")
    ids, bounds = warm["input_ids"], warm["sampling_params"]["custom_params"][DOC_BOUNDS_PARAM]
    assert ids == p.shuffled_ids[: p.shuffled_bounds[-1]]  # the documents, no question
    assert warm["sampling_params"]["custom_params"][DOC_MODE_PARAM] == "reorder" and warm["extra_key"] == "ns"
    # Replayed through the server's own order store: the measured request becomes the shuffled prompt.
    store = OrderStore()
    store.plan(ids, parse_doc_bounds(bounds, len(ids)), Tenant(extra_key="ns"))
    served = store.plan(p.input_ids, parse_doc_bounds(p.doc_bounds, len(p.input_ids)), Tenant(extra_key="ns"))
    assert served.input_ids == p.shuffled_ids
    from pcr_sglang.reuse.bounds import WARM_NOW_PARAM

    assert warm_request(p, ModeSpec("concat"), "ns")["sampling_params"]["custom_params"][WARM_NOW_PARAM] is True
    with pytest.raises(ValueError, match="shuffled bounds"):
        warm_request(
            GoldPrompt(0, "q", None, p.input_ids, p.doc_bounds, p.shuffled_ids, [7]), ModeSpec("reorder"), "ns"
        )


def test_reorder_reuses_all_documents_when_its_exact_hit_reaches_their_last_whole_chunk():
    p = gold("ABC", "CAB")  # the documents end at token 15
    reorder = ModeSpec("reorder")
    assert all_docs_reused(p, reorder, 12, chunk_size=4) and all_docs_reused(p, reorder, 16, chunk_size=4)
    assert not all_docs_reused(p, reorder, 8, chunk_size=4)
    assert not all_docs_reused(p, reorder, 12)  # token-granular: all 15 needed
    assert not all_docs_reused(p, ModeSpec("concat"), 16, chunk_size=4)  # composed: exactly the documents' end


def test_the_applicability_replay_counts_reordered_requests_and_exact_document_tokens():
    prompts = [tokens("AB"), tokens("BA"), tokens("AB"), tokens("CA"), tokens("C")]
    stats = reorder_applicability(prompts)
    assert stats["requests"] == 5
    assert stats["reordered"] == pytest.approx(2 / 5)  # BA and CA moved
    assert stats["follow_a_served_run"] == pytest.approx(3 / 5)  # BA, AB, CA (C starts no served sequence)
    assert stats["all_documents_follow"] == pytest.approx(2 / 5)  # BA, AB
    a, b, c = (len(DOCS[name]) for name in "ABC")
    total = 3 * (a + b) + a + 2 * c
    assert stats["doc_tokens_exact_hit_reorder"] == pytest.approx((2 * (a + b) + a) / total)
    # As sent: the second AB, and C (after CA; reorder served that one as AC, so C starts nothing).
    assert stats["doc_tokens_exact_hit_as_sent"] == pytest.approx((a + b + c) / total)
    table = reorder_applicability_table({"t": stats})
    assert "| t | 5 | 40% | 60% | 40% |" in table


@dataclass
class _Prompt:
    input_ids: list[int]
    doc_bounds: list[int]
    shuffled_ids: list[int]
    shuffled_bounds: list[int]

    @property
    def last_doc_end(self) -> int:
        return self.doc_bounds[-1]


class _Server:
    """TTFT is the first token; a marked request hits ``cached`` tokens, an unmarked one
    ``cached`` only when its prefix was sent before under its namespace."""

    def __init__(self, cached: int):
        self.cached, self.sent, self.prefixes = cached, [], set()

    def generate(self, body):
        self.sent.append(body)
        self.prefixes.add((body["extra_key"], tuple(body["input_ids"])))
        return {}

    def generate_stream(self, body):
        self.sent.append(body)
        marked = "custom_params" in body["sampling_params"]
        key, ids = body["extra_key"], body["input_ids"]
        hit = any((key, tuple(ids[:n])) in self.prefixes for n in range(1, len(ids)))
        cached = self.cached if marked or hit else 0
        return StreamedResponse(
            ttft_s=ids[0] / 1000, latency_s=ids[0] / 1000, final={"meta_info": {"cached_tokens": cached}}
        )


def test_the_ttft_benchmark_measures_reorder_beside_an_exact_hit_of_the_same_length():
    ids, bounds = tokens("ABC")
    shuffled_ids, shuffled_bounds = tokens("BCA")
    prompt = _Prompt(ids, bounds, shuffled_ids, shuffled_bounds)
    server = _Server(cached=12)
    medians, errors, not_reused = measure_start(server, [], [prompt], [ModeSpec("reorder")], chunk_size=4)
    assert set(medians) == {FULL, "reorder", EXACT_HIT} and not any(errors.values())
    assert not any(not_reused.values())
    warm = next(
        b
        for b in server.sent
        if b["sampling_params"].get("custom_params", {}).get(DOC_MODE_PARAM) == "reorder" and b["input_ids"] != ids
    )
    assert warm["input_ids"] == shuffled_ids[: shuffled_bounds[-1]]
    exact_warm = [b for b in server.sent if b["input_ids"] == ids[: bounds[-1]]]
    assert len(exact_warm) == 1 and "custom_params" not in exact_warm[0]["sampling_params"]
    _, _, short = measure_start(_Server(cached=8), [], [prompt], [ModeSpec("reorder")], chunk_size=4)
    assert short == {FULL: 0, "reorder": 1, EXACT_HIT: 1}  # 8 cached: the last chunk of the documents missed
    starts = [StartResult("base", 0, "doc-reuse", 1.0, {"reorder": 0.105, EXACT_HIT: 0.100})]
    text = markdown(summarize(starts, ["base"], ["reorder", EXACT_HIT]), ["base"], ["reorder", EXACT_HIT])
    assert "| base | reorder | 105 | exact prefix hit | 100 | 1.05x | <= 1.10x: met |" in text


def test_the_accuracy_report_holds_reorder_to_the_noise_floor_on_every_model():
    from pcr_eval.questions_report import FULL as QUESTIONS_FULL
    from pcr_eval.questions_report import target_lines

    summaries = {
        "base": {QUESTIONS_FULL: {"noise_floor_f1": {"mean": 0.6}}, "reorder": {"f1": {"mean": 0.6}}},
        "tuned": {QUESTIONS_FULL: {"noise_floor_f1": {"mean": 0.7}}, "reorder": {"f1": {"mean": 0.65}}},
    }
    lines = target_lines({"base": summaries["base"]}, "blend")
    assert "base, reorder" in lines[0] and lines[0].endswith("0.600 vs 0.600 -> met")
    assert lines[-1].startswith("targets: need both")
    both = "\n".join(target_lines(summaries, "blend"))
    assert "tuned, reorder" in both and "0.650 vs 0.700 -> missed by 0.050" in both


class _TraceServer:
    """The trace workload's server as far as a measurement sees it: every answer is [7, 8],
    a marked request reports ``cached`` tokens and the order ``served``."""

    def __init__(self, cached: int, served: list[int]):
        self.bodies, self.cached, self.served = [], cached, served

    def generate(self, body):
        self.bodies.append(body)
        tail = body["input_ids"][body.get("logprob_start_len", len(body["input_ids"])) :]
        logprobs = [[None if i == 0 else -1.0, t, None] for i, t in enumerate(tail)]
        return {
            "output_ids": [7, 8],
            "text": "a b",
            "meta_info": {"cached_tokens": self.cached, "input_token_logprobs": logprobs, "pcr_doc_order": self.served},
        }


def test_the_trace_workload_sends_reorder_unwarmed_and_records_the_order_served():
    from pcr_eval.trace_report import summarize
    from pcr_eval.trace_workload import Prompt, measure_mode

    prompt = Prompt(0, "r0", "Why?", ["d1", "d2"], list(range(40)), [3, 13, 13, 30])
    server = _TraceServer(cached=16, served=[1, 0])
    row = measure_mode(server, prompt, {"answer_ids": [7, 8]}, 2, ModeSpec("reorder"), lambda ids: "a b", chunk_size=16)
    assert len(server.bodies) == 2 and row["warm_cached_tokens"] is None  # measured, teacher-forced: no warm-up
    assert row["served_order"] == [1, 0] and row["reordered"] and row["all_docs_reused"]  # 16: the last whole chunk
    short = measure_mode(
        _TraceServer(cached=0, served=[0, 1]),
        prompt,
        {"answer_ids": [7, 8]},
        2,
        ModeSpec("reorder"),
        lambda ids: "a b",
        chunk_size=16,
    )
    assert not short["reordered"] and not short["all_docs_reused"]
    assert summarize([row, short], reference_nll=1.0)["reordered"] == 0.5
