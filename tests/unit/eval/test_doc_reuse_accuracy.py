"""The document-reuse accuracy benchmark's metrics, mode parsing and summary (no server)."""

from __future__ import annotations

import argparse

import pytest

from pcr_eval.forcing import answer_nll
from pcr_eval.modes import ModeSpec, parse_modes
from pcr_eval.scores import normalize_answer, token_f1
from pcr_eval.serving import doc_reuse_server_flags, server_mode
from pcr_eval.trace_report import EXACT, FULL, markdown_table, summarize, target_lines
from pcr_eval.trace_workload import Prompt, mode_request


def test_normalize_answer_is_squad_style():
    assert normalize_answer("The Eiffel Tower, in Paris!") == ["eiffel", "tower", "in", "paris"]
    assert normalize_answer("  An  apple a day ") == ["apple", "day"]
    # Unicode punctuation goes too; words joined by it are split, as by ASCII punctuation.
    assert normalize_answer("“Hello”—world’s end…") == ["hello", "world", "s", "end"]
    assert normalize_answer("theory, anthem, athena") == ["theory", "anthem", "athena"]  # articles are whole words


def test_token_f1_identical_and_reordered_answers_score_one():
    assert token_f1("Paris is the capital.", "paris is the capital") == 1.0
    assert token_f1("capital is Paris", "Paris is capital") == 1.0  # a bag of tokens


def test_token_f1_partial_overlap():
    # prediction: [paris, capital, of, france] ; reference: [paris]
    assert token_f1("Paris, the capital of France", "Paris") == pytest.approx(2 * 0.25 * 1 / 1.25)
    # Counts matter: "b b" against "b" has precision 1/2, recall 1.
    assert token_f1("b b", "b") == pytest.approx(2 / 3)
    assert token_f1("x y", "z w") == 0.0


def test_token_f1_empty_answers():
    assert token_f1("", "") == 1.0
    assert token_f1("...", "the") == 1.0  # both normalize to nothing
    assert token_f1("", "Paris") == 0.0
    assert token_f1("Paris", "") == 0.0
    assert token_f1("!!", "Paris") == 0.0


def test_answer_nll_skips_the_last_prompt_token():
    entries = [[None, 198, "\n"], [-1.0, 5, "a"], [-0.5, 6, "b"], [-3.0, 7, "c"]]
    assert answer_nll(entries, [5, 6, 7]) == pytest.approx(1.5)
    assert answer_nll([[None, 1, ""], [-0.25, 2, ""]], [2]) == pytest.approx(0.25)


def test_answer_nll_rejects_misaligned_logprobs():
    with pytest.raises(ValueError, match="expected 3"):
        answer_nll([[-1.0, 5, ""], [-0.5, 6, ""]], [5, 6])  # started at len(prompt): one short
    with pytest.raises(ValueError, match="not the answer"):
        answer_nll([[None, 1, ""], [-1.0, 9, ""]], [5])
    with pytest.raises(ValueError, match="no logprob"):
        answer_nll([[None, 1, ""], [None, 5, ""]], [5])
    with pytest.raises(ValueError, match="empty"):
        answer_nll([[None, 1, ""]], [])


def test_parse_modes():
    assert parse_modes("concat") == (ModeSpec("concat"),)
    assert parse_modes(" concat , concat ") == (ModeSpec("concat"),)
    specs = parse_modes("concat,lego:16,blend,blend:0.3")
    assert [s.name for s in specs] == ["concat", "lego:16", "blend", "blend:0.3"]
    assert specs[1].custom_params() == {"pcr_doc_reuse": "lego", "pcr_doc_recompute_tokens": 16}
    assert specs[3].custom_params() == {"pcr_doc_reuse": "blend", "pcr_doc_recompute_ratio": 0.3}
    assert specs[2].custom_params() == {"pcr_doc_reuse": "blend"}  # the server's R
    assert server_mode(specs) == "blend" and server_mode(parse_modes("concat")) == "concat"
    for bad, message in [
        ("bogus", "unknown mode 'bogus'"),
        (" , ", "at least one"),
        ("concat:3", "no :value"),
        ("lego:x", "integer K"),
        ("lego:-1", "K must be >= 0"),
        ("blend:1.5", "R must be in"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_modes(bad)


def test_recomputed_tokens_when_every_document_is_reused():
    bounds = [3, 13, 13, 53, 60, 70]  # documents of 10, 40 and 10 tokens; the first is not re-placed
    assert ModeSpec("concat").recomputed_if_all_reused(bounds) == 0
    assert ModeSpec("lego", 16).recomputed_if_all_reused(bounds) == 16 + 10
    assert ModeSpec("blend", 0.5).recomputed_if_all_reused(bounds) == 25


def test_main_refuses_unknown_modes_before_starting_anything(capsys):
    from pcr_eval.accuracy import main

    with pytest.raises(SystemExit) as exc:
        main(["--modes", "mosaic"])
    assert exc.value.code == 2
    assert "unknown mode 'mosaic'" in capsys.readouterr().err


def _row(identical: bool, f1: float, nll: float, first: bool, reused: bool = True) -> dict:
    return {"identical": identical, "f1": f1, "nll": nll, "first_token_agrees": first, "all_docs_reused": reused}


def test_summarize_and_table():
    rows = [
        _row(True, 1.0, 1.0, True),
        _row(False, 0.5, 2.0, True, reused=False),
        _row(False, 0.0, 3.0, False),
        {"error": "HTTPError: 500"},
    ]
    s = summarize(rows, reference_nll=1.0)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["identical_answers"] == pytest.approx(1 / 3)
    assert s["all_docs_reused"] == pytest.approx(2 / 3)
    assert s["mean_f1"] == pytest.approx(0.5)
    assert s["nll"] == pytest.approx(2.0) and s["nll_ratio"] == pytest.approx(2.0)
    assert s["first_token_agreement"] == pytest.approx(2 / 3)
    control = summarize([_row(True, 1.0, 1.0, True)], reference_nll=1.0, docs_reused=False)
    assert control["all_docs_reused"] is None and control["nll_ratio"] == 1.0
    full = {
        "requests": 3,
        "errors": 0,
        "all_docs_reused": None,
        "identical_answers": 1.0,
        "mean_f1": 1.0,
        "nll": 1.0,
        "nll_ratio": 1.0,
        "first_token_agreement": 1.0,
    }
    table = markdown_table({FULL: full, EXACT: control, "concat": s})
    lines = table.splitlines()
    assert lines[0].startswith(
        "| mode | requests | all docs reused | reordered | identical answers | mean F1 | NLL | NLL / full"
    )
    assert lines[4] == "| concat | 3 | 67% | n/a | 33% | 0.500 | 2.000 | 2.00 | 67% |"  # reordered: reorder's only
    assert "| n/a |" in lines[3]  # the control reuses no documents
    targets = "\n".join(target_lines({FULL: full, EXACT: control, "concat": s}))
    assert "no blend configuration was run" in targets and "concat: mean F1 0.500 (below >= 0.90)" in targets
    assert "outside 5%" in targets


def test_summarize_without_rows():
    s = summarize([{"error": "x"}], reference_nll=1.0)
    assert s["requests"] == 0 and s["identical_answers"] is None and s["nll_ratio"] is None


def test_each_mode_reads_only_what_it_cached_and_its_warm_up_warms_every_document():
    """A prompt one mode served by plain prefill is cached exactly; without a namespace per
    mode, the next mode's measured request hit that exact prefix (seen: 105 of 120
    measured requests answered from it, scored as perfect reuse)."""
    prompt = Prompt(0, "r0", "Why?", ["d1", "d2"], list(range(40)), [3, 13, 13, 30])
    bodies = [
        mode_request(prompt, spec, **{"temperature": 0.0, "max_new_tokens": 1})
        for spec in (ModeSpec("blend", 0.7), ModeSpec("blend", 0.85), ModeSpec("lego", 256))
    ]
    assert len({b["extra_key"] for b in bodies}) == 3
    assert all(b["sampling_params"]["custom_params"]["pcr_doc_bounds"] == [3, 13, 13, 30] for b in bodies)
    assert "extra_key" not in mode_request(prompt, None)  # the control: plain prefix caching
    flags = doc_reuse_server_flags("blend", 16)
    assert flags[flags.index("--pcr-doc-warmup-after") + 1] == "1"
    assert flags[flags.index("--pcr-doc-warmup") + 1] == "request"  # 'idle' would not wait for the warm-ups


class _RecordingServer:
    """Keeps the bodies a measurement sends (what reaches the server is under test here,
    not what it answers)."""

    def __init__(self):
        self.bodies = []

    def generate(self, body):
        self.bodies.append(body)
        tail = body["input_ids"][body.get("logprob_start_len", len(body["input_ids"])) :]
        logprobs = [[None if i == 0 else -1.0, t, None] for i, t in enumerate(tail)]
        return {
            "output_ids": [7, 8],
            "text": "a b",
            "meta_info": {"cached_tokens": 0, "input_token_logprobs": logprobs},
        }


def test_every_request_of_a_mode_measurement_carries_the_modes_key():
    from pcr_eval.trace_workload import measure_mode

    prompt = Prompt(0, "r0", "Why?", ["d1", "d2"], list(range(40)), [3, 13, 13, 30])
    server = _RecordingServer()
    measure_mode(server, prompt, {"answer_ids": [7, 8]}, 2, ModeSpec("blend", 0.7), lambda ids: "a b")
    assert len(server.bodies) == 3  # warm-up, measured, teacher-forced
    assert {b.get("extra_key") for b in server.bodies} == {"pcr-accuracy:blend:0.7"}
