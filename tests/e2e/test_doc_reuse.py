"""Document reuse in any order (``--pcr-doc-reuse``) on a real server and the tiny model.

One server serves every mode: it runs ``blend`` with a default ratio of 0 (so a request
that names no mode, or asks for ``concat``, is served by concatenation, recomputing
nothing), and requests ask for ``lego`` or ``blend`` and their K or R themselves.

The oracle is the no-cache server: what must be exact (a document right after the leading
tokens, every request that does not mark documents, running beside ones that do) is
compared token for token with it. The doc-reuse server's device pool (2600 tokens) is
small beside its host and SSD tiers, so canonical chains are demoted to host memory and
loaded back as the tests go on: every tier of a document's KV is exercised.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from pcr_client.hints import hint_envelope
from pcr_client.prompt import DEFAULT_DOC_FORMAT, build_doc_prompt
from pcr_sglang.reuse import settings as reuse_settings
from pcr_tools.data import load_wiki_articles
from pcr_tools.launcher import ServerProcess
from tests.conftest import CHUNK_SIZE
from tests.e2e.helpers import TIERED_ARGS, prometheus_counts, serving, ssd_server

pytestmark = pytest.mark.e2e

SAMPLING = {"temperature": 0.0, "max_new_tokens": 8}
# Every first sighting warmed (the default waits for a document to recur): the tests below
# count on a document being reusable from the request after the one that first marks it.
DOC_REUSE = ("--pcr-doc-reuse", "blend", "--pcr-doc-recompute-ratio", "0", "--pcr-doc-warmup-after", "1")
# Documents sent as text (the tests at the end): a chat template for the tiny model, the
# OpenAI usage's cached tokens, and /metrics.
CHAT_TEMPLATE = Path(__file__).parent / "data" / "chatml.jinja"
TEXT_DOCUMENTS = ("--chat-template", str(CHAT_TEMPLATE), "--enable-cache-report", "--enable-metrics")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("doc-reuse-store")


@pytest.fixture(scope="module")
def servers(tiny_model, store_dir, baseline_server):
    everything = {"docs": ssd_server(tiny_model, store_dir, *DOC_REUSE, *TEXT_DOCUMENTS)}
    with serving(everything, shared={"nocache": baseline_server}):
        yield everything


@pytest.fixture(scope="module")
def passages():
    """Real Wikipedia passages, ~40-120 tokens each on the tiny model's tokenizer."""
    articles = load_wiki_articles()
    return [a.text[:300] for a in articles[500:560]]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    """The tiny model in Hugging Face transformers: the independent references below."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _doc_counters(server: ServerProcess) -> dict:
    return server.pcr_state()["doc_reuse"]["counters"]


def _generate(server: ServerProcess, prompt, marked: bool, mode=None, **custom):
    """``mode`` and ``custom`` (K, R) are asked for in the request's custom_params."""
    sampling = prompt.sampling_params(mode=mode, **SAMPLING) if marked else dict(SAMPLING)
    if marked:
        sampling["custom_params"].update(custom)
    return server.generate({"input_ids": prompt.input_ids, "sampling_params": sampling})


@pytest.mark.parametrize(
    "bounds, message",
    [
        ([5, 3], "empty or reversed"),
        ([2, 9, 7, 12], "before the previous document ends"),
        ([2, 9999], "outside the prompt"),
        ([0, 4], "token 0"),
        ([2, 5, 7], "pairs"),
        ("2,5", "flat list"),
    ],
)
def test_bad_bounds_get_http_400_naming_the_problem(servers, tokenizer, bounds, message):
    ids = tokenizer.encode("A short prompt that has several tokens in it for the bounds.")
    response = requests.post(
        servers["docs"].base_url + "/generate",
        timeout=60,
        json={"input_ids": ids, "sampling_params": {**SAMPLING, "custom_params": {"pcr_doc_bounds": bounds}}},
    )
    assert response.status_code == 400, response.text
    assert message in response.text


def _bounds(count: int, length: int, start: int = 2) -> list[int]:
    return [b for i in range(count) for b in (start + i * length, start + (i + 1) * length)]


@pytest.mark.parametrize(
    "ids, custom, message",
    [
        (
            [1] + [42] * (65 * 16) + [2],
            {"pcr_doc_bounds": _bounds(65, 16, 1)},
            r"marks 65 documents; this server takes at most 64 per request \(--pcr-doc-max-documents\)",
        ),
        (
            [1] + [42] * 40,
            {"pcr_doc_bounds": [1, 20, 20, 35, 35, 40]},
            r"document 1 \[20, 35\) has 15 tokens; this server takes documents of at least 16 \(--pcr-doc-min-tokens\)",
        ),
        ([1] + [42] * 40, "xpcr_doc_boundsx", "custom_params must be an object of named parameters, got str"),
        ([1] + [42] * 40, ["pcr_doc_bounds"], "custom_params must be an object of named parameters, got list"),
    ],
    ids=["too-many-documents", "too-short", "string-custom-params", "list-custom-params"],
)
def test_requests_past_the_document_limits_or_with_non_dict_custom_params_get_http_400(servers, ids, custom, message):
    """Review findings 4 and 14: any number of documents of any length was accepted (one
    warm-up prefill each, hashing in the scheduler thread), and a string ``custom_params``
    containing the parameter's name got an AttributeError instead of a 400. The server goes
    on serving marked requests afterwards."""
    docs = servers["docs"]
    response = requests.post(
        docs.base_url + "/generate",
        timeout=60,
        json={"input_ids": ids, "sampling_params": {**SAMPLING, "custom_params": custom}},
    )
    assert response.status_code == 400, response.text
    assert re.search(message, response.text), response.text
    fine = docs.generate(
        {
            "input_ids": [1] + [42] * 40,
            "sampling_params": {**SAMPLING, "ignore_eos": True, "custom_params": {"pcr_doc_bounds": _bounds(2, 16, 1)}},
        }
    )
    assert len(fine["output_ids"]) == SAMPLING["max_new_tokens"]


def test_unknown_mode_gets_http_400(servers, tokenizer):
    ids = tokenizer.encode("Another short prompt with a few tokens.")
    response = requests.post(
        servers["docs"].base_url + "/generate",
        timeout=60,
        json={
            "input_ids": ids,
            "sampling_params": {**SAMPLING, "custom_params": {"pcr_doc_bounds": [2, 5], "pcr_doc_reuse": "magic"}},
        },
    )
    assert response.status_code == 400 and "pcr_doc_reuse" in response.text


def test_a_document_right_after_the_leading_tokens_is_exact(servers, tokenizer, passages):
    """Its canonical KV is the KV prefix caching would give: delta 0, token for token."""
    docs, ref = servers["docs"], servers["nocache"]
    for i in range(4):
        prompt = build_doc_prompt(tokenizer, f"System prompt number {i}.", [passages[i]], "What is it about?")
        before = _doc_counters(docs)
        out = _generate(docs, prompt, marked=True)
        after = _doc_counters(docs)
        assert out["output_ids"] == _generate(ref, prompt, marked=False)["output_ids"], i
        assert after["requests"] == before["requests"] + 1
        assert after["tokens_rotated"] == before["tokens_rotated"]  # nothing moved
        assert out["meta_info"]["cached_tokens"] >= prompt.doc_bounds[-1] - CHUNK_SIZE


def test_documents_are_reused_in_any_order(servers, tokenizer, passages):
    docs = servers["docs"]
    trio = passages[10:13]
    orders = [(0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0)]
    for n, order in enumerate(orders):
        prompt = build_doc_prompt(
            tokenizer, "Answer from the documents.", [trio[i] for i in order], "Which document mentions a year?"
        )
        before = _doc_counters(docs)
        out = _generate(docs, prompt, marked=True)
        after = _doc_counters(docs)
        # Every document's KV was reused: only the question (and the last token) computed.
        assert out["meta_info"]["cached_tokens"] == prompt.doc_bounds[-1], (order, out["meta_info"])
        assert after["docs_reused"] - before["docs_reused"] == 3
        assert after["tokens_rotated"] > before["tokens_rotated"]
        # Documents already warmed are not prefilled again.
        assert after["canonical_requests"] - before["canonical_requests"] == (3 if n == 0 else 0)


def test_blended_kv_never_reaches_a_request_that_did_not_ask(servers, tokenizer, passages):
    """The same prompts without bounds, after they were served with reuse: exact outputs,
    and their exact prefix ends where the reused documents' blended KV began."""
    docs, ref = servers["docs"], servers["nocache"]
    trio = passages[20:23]
    prompts = [
        build_doc_prompt(tokenizer, "Be brief.", [trio[i] for i in order], "Summarize.")
        for order in [(0, 1, 2), (1, 0, 2), (2, 1, 0)]
    ]
    for prompt in prompts:
        _generate(docs, prompt, marked=True)
    for prompt in prompts:
        out = _generate(docs, prompt, marked=False)
        assert out["output_ids"] == _generate(ref, prompt, marked=False)["output_ids"]
        first_doc_end = prompt.doc_bounds[1]
        assert out["meta_info"]["cached_tokens"] <= first_doc_end


# Per request: unmarked, concat, lego (K=8), blend (R=30%): the modes batched together.
MIXED_MODES = [
    (False, None, {}),
    (True, "concat", {}),
    (True, "lego", {"pcr_doc_recompute_tokens": 8}),
    (True, "blend", {"pcr_doc_recompute_ratio": 0.3}),
]


def test_concurrent_reuse_and_exact_requests_and_everything_balances(servers, tokenizer, passages):
    """24 requests, 8 at a time, a quarter not marking documents, the others in concat,
    lego or blend (random orders of a shared pool of documents): the unmarked ones equal
    the no-cache server token for token; when all are done every device slot is the
    tree's or free, nothing is locked, and the tree's bookkeeping checks."""
    docs, ref = servers["docs"], servers["nocache"]
    pool = passages[30:40]
    rng = random.Random(7)
    jobs = []
    for i in range(24):
        chosen = rng.sample(pool, 3)
        prompt = build_doc_prompt(tokenizer, "Use the documents.", chosen, f"Question {i}?")
        jobs.append((prompt, *MIXED_MODES[i % 4]))
    before = _doc_counters(docs)
    # Each marked request waits for its documents' warm-ups (``pcr_doc_warm``), which the
    # default (``auto``) would leave for idle time beside the others in flight.
    with ThreadPoolExecutor(8) as executor:
        outs = list(
            executor.map(lambda job: _generate(docs, job[0], job[1], job[2], **job[3], pcr_doc_warm=True), jobs)
        )
    for (prompt, marked, _, _), out in zip(jobs, outs):
        if not marked:
            assert out["output_ids"] == _generate(ref, prompt, marked=False)["output_ids"]
    assert _doc_counters(docs)["tokens_recomputed"] > before["tokens_recomputed"]
    state = docs.pcr_state(check_invariants=True)
    assert state["invariants"]["ok"] is True, state["invariants"]
    assert state["tree"]["locked_chunks"] == 0
    assert state["device_pool_free_tokens"] + state["cached_tokens"] == state["device_pool_tokens"]
    counters = state["doc_reuse"]["counters"]
    assert counters["docs_reused"] > 0
    assert state["doc_reuse"]["mode"] == "blend" and state["doc_reuse"]["fill_gaps"] is True


def test_a_request_can_opt_out_on_a_server_with_reuse(servers, tokenizer, passages):
    docs, ref = servers["docs"], servers["nocache"]
    prompt = build_doc_prompt(tokenizer, "Opt out.", passages[45:48][::-1], "Why?")
    before = _doc_counters(docs)
    out = docs.generate(
        {"input_ids": prompt.input_ids, "sampling_params": prompt.sampling_params(mode="off", **SAMPLING)}
    )
    assert out["output_ids"] == _generate(ref, prompt, marked=False)["output_ids"]
    assert _doc_counters(docs)["requests"] == before["requests"]


def _hf_concat_reference(model, prompt, max_new_tokens: int, shift: bool = True) -> list[int]:
    """What concat mode must compute, built independently with Hugging Face transformers:
    RoPE attention depends only on relative positions, so a document's canonical KV rotated
    by δ is the KV of ``S ‖ d`` run at positions shifted by δ (HF's own RoPE, no rotation of
    ours). The first document's KV is that of ``S ‖ d_1`` itself; the question then runs
    over the concatenation, and decodes greedily. ``shift=False`` leaves every document at
    its canonical positions (the negative control)."""
    import torch
    from transformers import DynamicCache

    ids, bounds = prompt.input_ids, prompt.doc_bounds
    spans = list(zip(bounds[::2], bounds[1::2]))
    leading = spans[0][0]
    pieces = []  # per piece: list over layers of (k, v), [1, heads, tokens, dim]
    with torch.no_grad():
        for n, (start, end) in enumerate(spans):
            seq = torch.tensor([ids[:leading] + ids[start:end]])
            positions = torch.arange(seq.shape[1]).unsqueeze(0) + ((start - leading) if shift else 0)
            cache = model(seq, position_ids=positions, use_cache=True).past_key_values
            keep = slice(0, None) if n == 0 else slice(leading, None)
            pieces.append([(layer.keys[:, :, keep], layer.values[:, :, keep]) for layer in cache.layers])
        cache = DynamicCache()
        for layer in range(len(pieces[0])):
            cache.update(
                torch.cat([p[layer][0] for p in pieces], dim=2), torch.cat([p[layer][1] for p in pieces], dim=2), layer
            )
        position = spans[-1][1]
        step = torch.tensor([ids[position:]])
        out: list[int] = []
        for _ in range(max_new_tokens):
            positions = torch.arange(position, position + step.shape[1]).unsqueeze(0)
            logits = model(step, position_ids=positions, past_key_values=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            position += step.shape[1]
            step = torch.tensor([[token]])
    return out


def test_concat_outputs_equal_an_independent_reference(servers, tokenizer, passages, hf_model):
    """Rotation, offsets and the question's positions, checked against an implementation
    that shares no code with PCR (and a negative control: the same reference without the
    position shift gives other tokens for most prompts, so the comparison can tell)."""
    model = hf_model
    docs = servers["docs"]
    pool = passages[50:56]
    rng = random.Random(3)
    unshifted_differs = 0
    for i in range(6):
        prompt = build_doc_prompt(tokenizer, "Reference check.", rng.sample(pool, 3), f"Point {i}?")
        _generate(docs, prompt, marked=True)  # warm (its documents may have been first seen here)
        out = _generate(docs, prompt, marked=True)
        assert out["meta_info"]["cached_tokens"] == prompt.doc_bounds[-1]
        assert out["output_ids"] == _hf_concat_reference(model, prompt, SAMPLING["max_new_tokens"]), i
        unshifted = _hf_concat_reference(model, prompt, SAMPLING["max_new_tokens"], shift=False)
        unshifted_differs += unshifted != out["output_ids"]
    assert unshifted_differs >= 3


def test_the_tuning_trains_on_what_the_server_serves(servers, tokenizer, passages, hf_model, monkeypatch):
    """``pcr_tools.tune``'s forward gives, for a marked prompt and an answer, the
    log-probabilities a concat server gives the same tokens (teacher-forced); with the
    documents attending to each other (full prefill) or left at their canonical positions
    (no re-rotation) it does not, so the comparison can tell."""
    import torch

    from pcr_tools.tune import served_pattern
    from pcr_tools.tune.served_pattern import MarkedPrompt, served_logits

    docs = servers["docs"]
    pool = passages[56:60]
    rng = random.Random(5)
    off_full = off_unrotated = 0.0
    for i in range(3):
        prompt = build_doc_prompt(tokenizer, "Tuning check.", rng.sample(pool, 3), f"Which {i}?")
        answer = tokenizer.encode(" It is the first one, then the second.", add_special_tokens=False)
        _generate(docs, prompt, marked=True, mode="concat")  # warm its documents
        reply = docs.generate(
            {
                "input_ids": prompt.input_ids + answer,
                "sampling_params": prompt.sampling_params(mode="concat", temperature=0.0, max_new_tokens=0),
                "return_logprob": True,
                "logprob_start_len": len(prompt.input_ids) - 1,
            }
        )
        meta = reply["meta_info"]
        assert meta["cached_tokens"] == prompt.doc_bounds[-1]  # every document reused
        served = torch.tensor([e[0] for e in meta["input_token_logprobs"][1:]])
        marked = MarkedPrompt(tuple(prompt.input_ids), tuple(prompt.doc_bounds))
        first = len(prompt.input_ids) - 1 - prompt.doc_bounds[-1]

        def logprobs(mode: str) -> torch.Tensor:
            with torch.no_grad():
                rows = served_logits(hf_model, marked, answer, mode=mode)[first : first + len(answer)]
            return rows.log_softmax(-1).gather(1, torch.tensor(answer)[:, None])[:, 0]

        assert torch.allclose(logprobs("concat"), served, atol=2e-3), (logprobs("concat") - served).abs().max()
        off_full = max(off_full, float((logprobs("full") - served).abs().max()))
        with monkeypatch.context() as m:
            m.setattr(served_pattern, "rotate_keys", lambda model, keys, delta: keys)
            off_unrotated = max(off_unrotated, float((logprobs("concat") - served).abs().max()))
    assert off_full > 2e-2 and off_unrotated > 2e-2, (off_full, off_unrotated)


def check_the_gate_over_http(server: ServerProcess, prompt, file_name: str, ratio: float) -> None:
    """On a server started with ``--pcr-doc-reuse-calibration`` (blend at R=``ratio``,
    ``gradual``, no anchors): requests outside it get HTTP 400 naming the file and what it
    allows (review N4); one asking for more recompute is served."""
    for custom, named in (
        ({"pcr_doc_reuse": "concat"}, "pcr_doc_reuse='concat'"),
        ({"pcr_doc_recompute_ratio": 0.0}, "pcr_doc_recompute_ratio=0"),
        ({"pcr_doc_selector": "deviation"}, "pcr_doc_selector='deviation'"),
        ({"pcr_doc_anchor_tokens": 4}, "pcr_doc_anchor_tokens=4"),
    ):
        sampling = prompt.sampling_params(**SAMPLING)
        sampling["custom_params"].update(custom)
        response = requests.post(
            server.base_url + "/generate", timeout=60, json={"input_ids": prompt.input_ids, "sampling_params": sampling}
        )
        assert response.status_code == 400, response.text
        assert f"{named}: outside this server's calibration {file_name}" in response.text, response.text
        assert f"pcr_doc_recompute_ratio >= {ratio:g}, pcr_doc_selector 'gradual'" in response.text
    served = _generate(server, prompt, True, pcr_doc_recompute_ratio=min(1.0, 2 * ratio))
    assert len(served["output_ids"]) > 0
    calibration = server.pcr_state()["doc_reuse"]["calibration"]
    assert calibration["stopped"] is None and sum(calibration["overrides"].values()) == 0


def test_calibrate_measures_the_served_model_and_writes_a_file_the_server_takes(
    servers, tiny_model, tmp_path, tokenizer, passages
):
    """``python -m pcr_tools.calibrate`` against a live blend server: every mode measured
    (concat, lego and blend at the settings asked), the weights' fingerprint recorded, and
    the file accepted at startup for those weights (and refused for others), and held to by
    every request."""
    from pcr_sglang.config import PCRConfig, PCRConfigError
    from pcr_sglang.reuse.calibration import DocReuseCalibration
    from pcr_sglang.reuse.setup import calibration_status
    from pcr_tools.calibrate import main

    docs = servers["docs"]
    out = tmp_path / "calibration.json"
    assert (
        main(
            [
                "--url",
                docs.base_url,
                "--out",
                str(out),
                "--questions",
                "2",
                "--lego-tokens",
                "4",
                "--blend-ratios",
                "0.3",
                "--max-new-tokens",
                "4",
                "--top1-min",
                "0",
                "--gold-ratio-min",
                "0",
            ]
        )
        == 0
    )
    calibration = DocReuseCalibration.load(out)
    fingerprint = docs.pcr_state()["namespace"]["model_fingerprint"]
    assert calibration.model_fingerprint == fingerprint and calibration.questions == 2
    assert set(calibration.modes) == {"concat", "lego", "blend"}
    assert calibration.modes["lego"].value == 4 and calibration.modes["blend"].value == 0.3
    for verdict in calibration.modes.values():
        assert verdict.meets and all(0 <= m.top1 <= 1 for m in verdict.measured)
    config = PCRConfig(enabled=True, doc_reuse="blend", doc_reuse_calibration=str(out))
    assert calibration_status(config, fingerprint)["meets_target"] and reuse_settings.recompute(config).ratio == 0.3
    with pytest.raises(PCRConfigError, match="other weights"):
        calibration_status(config, "0" * 32)
    assert calibration.conditions.selector == "gradual" and calibration.conditions.anchor_tokens == 0
    assert calibration.conditions.kv_dtype == "float32"
    # A server started with the file takes its R and reports the verdict; one started under
    # other conditions (here the query selector) is refused at startup, naming them.
    calibrated = ("--pcr-doc-reuse", "blend", "--pcr-doc-reuse-calibration", str(out))
    with serving({"calibrated": ServerProcess(tiny_model, (*TIERED_ARGS, *calibrated))}) as started:
        docs_state = started["calibrated"].pcr_state()["doc_reuse"]
        assert docs_state["calibration"]["meets_target"] and docs_state["calibration"]["value"] == 0.3
        assert docs_state["calibration"]["conditions"] == docs_state["conditions"]
        prompt = build_doc_prompt(tokenizer, "Gate check.", passages[50:52], "Why?")
        check_the_gate_over_http(started["calibrated"], prompt, out.name, 0.3)
    with pytest.raises(RuntimeError, match="measured under other conditions: selector 'gradual'"):
        query = ("--pcr-doc-selector", "query")
        with serving({"refused": ServerProcess(tiny_model, (*TIERED_ARGS, *calibrated, *query))}):
            pass


def _hf_recompute_reference(
    model,
    prompt,
    max_new_tokens: int,
    mode: str,
    k: int = 0,
    ratio: float = 0.0,
    positions: bool = True,
    gaps=(),
    largest: bool = True,
    anchors: int = 0,
    attention_model=None,
    gradual: bool = False,
    prophet_model=None,
) -> tuple[list[int], list[int]]:
    """What lego and blend must compute, built with Hugging Face transformers: the concat
    KV (as in :func:`_hf_concat_reference`), then the recomputed tokens, lego's first ``k``
    of each re-placed document or blend's ``ratio`` of them whose layer-1 V deviates most
    from full prefill's (whose layer-1 K/V also replace the re-placed ones, as CacheBlend
    keeps its check layer's), dropped from the cache and run again with the question at
    their true positions under a position-causal 4-D mask. Returns the greedy answer and
    the recomputed positions. ``positions=False`` runs them at the positions their row slots
    would have (the negative control: a missing position override). ``gaps``: unmarked
    token ranges between marked documents, computed in place with the recomputed tokens
    (their KV here is a placeholder the cache drops). ``largest=False``: blend picks the
    least deviating tokens instead (the negative control of its pick). ``anchors``: blend's
    first ``anchors`` tokens of each re-placed document come first (in document order,
    within the count), the rest by deviation. ``attention_model`` (the same weights with eager
    attention): blend ranks by the question's layer-1 attention under full prefill instead
    (the query selector), summed over heads and question tokens. ``gradual``: layer 1's
    deviation keeps twice the count (anchors first), full prefill's layer-2 KV replaces
    theirs, and layer 2's V deviation picks among them. ``prophet_model`` (eager attention):
    blend ranks by the question's attention over the cache as the forward sees it (layer 1
    refreshed, the re-placed KV above), summed over layers 1..min(4, layers - 1)."""
    import torch
    from transformers import DynamicCache

    ids, bounds = prompt.input_ids, prompt.doc_bounds
    spans = list(zip(bounds[::2], bounds[1::2]))
    leading, end = spans[0][0], spans[-1][1]
    gap_positions = [p for start, stop in gaps for p in range(start, stop)]
    with torch.no_grad():
        pieces = []
        for n, (start, stop) in enumerate(sorted(spans + list(gaps))):
            seq = torch.tensor([ids[:leading] + ids[start:stop]])
            cache = model(
                seq, position_ids=torch.arange(seq.shape[1]).unsqueeze(0) + (start - leading), use_cache=True
            ).past_key_values
            keep = slice(0, None) if n == 0 else slice(leading, None)
            pieces.append([(layer.keys[:, :, keep], layer.values[:, :, keep]) for layer in cache.layers])
        layers = [
            [torch.cat([p[i][0] for p in pieces], dim=2), torch.cat([p[i][1] for p in pieces], dim=2)]
            for i in range(len(pieces[0]))
        ]
        rotated = [p for start, stop in spans[1:] for p in range(start, stop)]
        if mode == "lego":
            chosen = [p for start, stop in spans[1:] for p in range(start, min(stop, start + k))]
        else:
            full_layers = model(torch.tensor([ids[:end]]), use_cache=True).past_key_values.layers
            full = full_layers[1]
            index = torch.tensor(rotated)
            deviation = (full.values[0][:, index] - layers[1][1][0][:, index]).square().sum(dim=(0, 2))
            layers[1][0][:, :, index] = full.keys[:, :, index]
            layers[1][1][:, :, index] = full.values[:, :, index]
            if attention_model is not None:
                weights = attention_model(torch.tensor([ids]), output_attentions=True).attentions[1][0]
                deviation = weights[:, end:, :].sum(dim=(0, 1))[index]  # [heads, question, keys]
            if prophet_model is not None:
                seen = DynamicCache()
                for i, (keys, values) in enumerate(layers):
                    seen.update(keys.clone(), values.clone(), i)
                attentions = prophet_model(
                    torch.tensor([ids[end:]]),
                    position_ids=torch.arange(end, len(ids))[None],
                    past_key_values=seen,
                    output_attentions=True,
                ).attentions
                depth = min(4, len(layers) - 1)
                deviation = sum(attentions[i][0][:, :, :end].sum(dim=(0, 1)) for i in range(1, depth + 1))[index]
            count = min(len(rotated), int(round(ratio * len(rotated))))
            first = [p for start, stop in spans[1:] for p in range(start, min(stop, start + anchors))][:count]
            if gradual:
                rest = torch.tensor([p not in set(first) for p in rotated])
                width = min(len(rotated), 2 * count)
                finalists = torch.tensor(
                    sorted(first + index[rest][torch.topk(deviation[rest], width - len(first)).indices].tolist())
                )
                full2 = full_layers[2]
                deviation2 = (full2.values[0][:, finalists] - layers[2][1][0][:, finalists]).square().sum(dim=(0, 2))
                layers[2][0][:, :, finalists] = full2.keys[:, :, finalists]
                layers[2][1][:, :, finalists] = full2.values[:, :, finalists]
                index, deviation = finalists, deviation2
            rest = torch.tensor([p not in set(first) for p in index.tolist()])
            picked = torch.topk(deviation[rest], count - len(first), largest=largest).indices
            chosen = sorted(first + index[rest][picked].tolist())
        chosen = sorted({*chosen, *gap_positions})
        kept = [p for p in range(end) if p not in set(chosen)]
        cache = DynamicCache()
        for i, (keys, values) in enumerate(layers):
            cache.update(keys[:, :, kept], values[:, :, kept], i)
        query_positions = chosen + list(range(end, len(ids)))
        row = kept + query_positions  # request positions, in the row's slot order
        key_positions = torch.tensor(row)
        q = torch.tensor(query_positions)
        mask = (key_positions.unsqueeze(0) <= q.unsqueeze(1))[None, None]
        run_at = q if positions else torch.arange(len(kept), len(row))
        step = torch.tensor([[ids[p] for p in query_positions]])
        logits = model(
            step, position_ids=run_at.unsqueeze(0), past_key_values=cache, attention_mask=mask, use_cache=True
        ).logits
        out: list[int] = []
        position = len(ids)
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            logits = model(
                torch.tensor([[token]]), position_ids=torch.tensor([[position]]), past_key_values=cache, use_cache=True
            ).logits
            position += 1
    return out, chosen


@pytest.mark.parametrize(
    "mode, custom, expected_kwargs",
    [
        ("lego", {"pcr_doc_recompute_tokens": 6}, {"k": 6}),
        ("blend", {"pcr_doc_recompute_ratio": 0.3}, {"ratio": 0.3}),
    ],
    ids=["lego", "blend"],
)
def test_recompute_outputs_equal_an_independent_reference(
    servers, tokenizer, passages, hf_model, mode, custom, expected_kwargs
):
    """Permuted rows, true positions, the position-causal mask and blend's probe,
    checked against transformers (no code shared with PCR or SGLang's attention). Negative
    controls: the same reference without the position override, and concat's output, differ
    from the recompute output for most prompts, so the comparison can tell. (Without the
    mask applied in the server, lego failed here.) The tiny model has two layers, so blend's
    probe makes every re-placed token exact at both and which tokens it picks cannot move
    the answer: the pick is checked in tests/unit/reuse/test_doc_reuse_setup.py, and on four
    layers by the next test."""
    model = hf_model
    docs = servers["docs"]
    pool = passages[50:56]
    rng = random.Random(11)
    before = _doc_counters(docs)
    differs_unplaced = differs_concat = recomputed = 0
    for i in range(5):
        prompt = build_doc_prompt(tokenizer, "Recompute check.", rng.sample(pool, 3), f"Point {i}?")
        _generate(docs, prompt, marked=True, mode="concat")  # warm: every document cached
        out = _generate(docs, prompt, marked=True, mode=mode, **custom)
        expected, chosen = _hf_recompute_reference(model, prompt, SAMPLING["max_new_tokens"], mode, **expected_kwargs)
        assert out["meta_info"]["cached_tokens"] == prompt.doc_bounds[-1] - len(chosen), i
        assert out["output_ids"] == expected, i
        recomputed += len(chosen)
        unplaced, _ = _hf_recompute_reference(
            model, prompt, SAMPLING["max_new_tokens"], mode, positions=False, **expected_kwargs
        )
        differs_unplaced += unplaced != expected
        differs_concat += _generate(docs, prompt, marked=True, mode="concat")["output_ids"] != expected
    assert _doc_counters(docs)["tokens_recomputed"] - before["tokens_recomputed"] == recomputed
    assert differs_unplaced >= 3 and differs_concat >= 2, (differs_unplaced, differs_concat)


@pytest.fixture(scope="module")
def deep_model():
    """The tiny model with four layers (its own folder): past blend's probe of layers 0-1."""
    from pcr_tools.models.tiny_llama import build_tiny_llama

    return str(build_tiny_llama(num_layers=4))


@pytest.fixture(scope="module")
def deep_server(deep_model):
    """A document-reuse server of the four-layer model, device and host tiers."""
    server = {"deep": ServerProcess(deep_model, (*TIERED_ARGS, *DOC_REUSE))}
    with serving(server):
        yield server["deep"]


@pytest.mark.parametrize(
    "anchors, selector",
    [(0, "deviation"), (16, "deviation"), (0, "query"), (0, "gradual"), (0, "prophet")],
    ids=["deviation", "anchors-then-deviation", "query", "gradual", "prophet"],
)
def test_blend_on_four_layers_equals_an_independent_reference(deep_server, deep_model, passages, anchors, selector):
    """On two layers blend's probe makes every kept token exact (layer 0 is, layer 1 comes
    from the probe), so neither its pick nor its copy of the kept tokens' other layers can
    move an answer. On four layers the kept tokens' layers 2-3 are their re-placed KV,
    copied under blend's keep mask after the probe: checked against transformers (as
    above). Negative control: the reference picking the least deviating tokens instead
    gives other tokens for some prompts, so the pick is what is compared. (A permuted
    keep mask, or the kept tokens' copy starting at layer 3, failed here.) With anchors, each
    re-placed document's first tokens are recomputed whatever their deviation. The query
    selector ranks by the question's layer-1 attention, taken here from transformers' own
    eager attention weights under full prefill; ``prophet`` by its attention over the
    cache the forward sees, fused over layers 1-3; ``gradual`` by layer 2's deviation among
    layer 1's finalists."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(deep_model)
    model = AutoModelForCausalLM.from_pretrained(deep_model, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 4
    eager = None
    if selector in ("query", "prophet"):
        eager = AutoModelForCausalLM.from_pretrained(
            deep_model, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    how = {
        "attention_model": eager if selector == "query" else None,
        "prophet_model": eager if selector == "prophet" else None,
        "gradual": selector == "gradual",
    }
    pool = passages[50:56]
    rng = random.Random(11)
    differs_pick = differs_from_deviation = 0
    for i in range(4):
        prompt = build_doc_prompt(tokenizer, "Deep check.", rng.sample(pool, 3), f"Point {i}?")
        _generate(deep_server, prompt, marked=True, mode="concat")  # warm: every document cached
        out = _generate(
            deep_server,
            prompt,
            marked=True,
            mode="blend",
            pcr_doc_recompute_ratio=0.3,
            pcr_doc_anchor_tokens=anchors,
            pcr_doc_selector=selector,
        )
        expected, chosen = _hf_recompute_reference(
            model, prompt, SAMPLING["max_new_tokens"], "blend", ratio=0.3, anchors=anchors, **how
        )
        assert out["meta_info"]["cached_tokens"] == prompt.doc_bounds[-1] - len(chosen), i
        assert out["output_ids"] == expected, i
        other_pick, _ = _hf_recompute_reference(
            model, prompt, SAMPLING["max_new_tokens"], "blend", ratio=0.3, largest=False, anchors=anchors, **how
        )
        differs_pick += other_pick != expected
        if anchors or selector != "deviation":  # the pick moved: the server's output is not deviation's alone
            by_deviation, _ = _hf_recompute_reference(model, prompt, SAMPLING["max_new_tokens"], "blend", ratio=0.3)
            differs_from_deviation += by_deviation != expected
    assert differs_pick >= 3, differs_pick  # 4 of 4 when written (on two layers: 0 of 4)
    assert (not anchors and selector == "deviation") or differs_from_deviation >= 1, differs_from_deviation


@pytest.mark.parametrize(
    "mode, custom, reference",
    [
        ("concat", {}, ("lego", {"k": 0})),
        ("lego", {"pcr_doc_recompute_tokens": 6}, ("lego", {"k": 6})),
    ],
    ids=["concat", "lego"],
)
def test_a_passage_with_no_cached_kv_between_reused_documents_is_computed_in_place(
    servers, tokenizer, passages, hf_model, mode, custom, reference
):
    """A prefix of cached documents would stop at the first one with no cached KV; here
    the passage between two reused documents is unmarked (nobody's canonical KV), is
    extended in place at its true positions, and the document after it is still reused.
    Checked against transformers. Negative control: reusing that passage's own canonical
    KV instead (marking it) gives other tokens for some prompts. (Not blend: its probe
    makes every re-placed token exact on the tiny model's two layers, so that control
    cannot tell.) With the passage's tokens treated as the end of the reuse (as before
    gap filling), the cached-token check fails."""
    from pcr_client.prompt import DocPrompt

    model = hf_model
    docs = servers["docs"]
    pool = passages[40:46]
    rng = random.Random(5)
    differs_control = 0
    for i in range(4):
        full = build_doc_prompt(tokenizer, "Gap check.", rng.sample(pool, 3), f"Point {i}?")
        b = full.doc_bounds
        prompt = DocPrompt(full.input_ids, b[:2] + b[4:])  # the middle passage unmarked
        _generate(docs, prompt, marked=True, mode="concat")  # warm: both marked documents cached
        before = _doc_counters(docs)["gap_tokens"]
        out = _generate(docs, prompt, marked=True, mode=mode, **custom)
        assert _doc_counters(docs)["gap_tokens"] - before == b[3] - b[2]
        expected, chosen = _hf_recompute_reference(
            model, prompt, SAMPLING["max_new_tokens"], reference[0], gaps=[(b[2], b[3])], **reference[1]
        )
        assert out["meta_info"]["cached_tokens"] == b[5] - len(chosen), i
        assert out["output_ids"] == expected, i
        control, _ = _hf_recompute_reference(model, full, SAMPLING["max_new_tokens"], reference[0], **reference[1])
        differs_control += control != expected
    assert differs_control >= 1, differs_control


@pytest.mark.parametrize(
    "mode, custom",
    [("lego", {"pcr_doc_recompute_tokens": 100000}), ("blend", {"pcr_doc_recompute_ratio": 1.0})],
    ids=["lego", "blend"],
)
def test_every_document_token_recomputed_equals_full_prefill(servers, tokenizer, passages, mode, custom):
    """The correctness gate: with every re-placed token recomputed, the outputs are the
    no-cache server's, token for token (only the exact first document stays reused)."""
    docs, ref = servers["docs"], servers["nocache"]
    for i in range(3):
        prompt = build_doc_prompt(
            tokenizer, "Gate.", [passages[i + 3], passages[i + 7], passages[i + 12]][::-1], f"Gate {i}?"
        )
        _generate(docs, prompt, marked=True, mode="concat")
        out = _generate(docs, prompt, marked=True, mode=mode, **custom)
        assert out["output_ids"] == _generate(ref, prompt, marked=False)["output_ids"], i
        assert out["meta_info"]["cached_tokens"] <= prompt.doc_bounds[1]  # at most S and the first document


@pytest.mark.parametrize(
    "custom, message",
    [
        ({"pcr_doc_recompute_tokens": -2}, "pcr_doc_recompute_tokens must be an integer >= 0"),
        ({"pcr_doc_recompute_ratio": 2}, r"pcr_doc_recompute_ratio must be a number in \[0, 1\]"),
        ({"pcr_doc_warm": "yes"}, "pcr_doc_warm must be true or false"),
    ],
)
def test_bad_recompute_parameters_get_http_400(servers, tokenizer, custom, message):
    prompt = build_doc_prompt(tokenizer, "Bad.", ["a document", "another one"], "Why?")
    sampling = prompt.sampling_params(**SAMPLING)
    sampling["custom_params"].update(custom)
    response = requests.post(
        servers["docs"].base_url + "/generate",
        timeout=60,
        json={"input_ids": prompt.input_ids, "sampling_params": sampling},
    )
    assert response.status_code == 400, response.text
    assert re.search(message, response.text), response.text


def test_precomputed_documents_are_served_from_ssd_after_a_restart(servers, tokenizer, passages, tiny_model, store_dir):
    """TurboRAG's offline phase: ``pcr_tools.precompute`` fills the store through one
    server; a server started later on the same store, which never saw these documents in
    traffic, reuses every one of them (read from SSD), and answers as the first server
    does, token for token (canonical KV is deterministic)."""
    from pcr_tools.precompute import document_requests, precompute, wait_for_ssd_writes

    corpus = passages[56:60]
    system = "Precomputed corpus."
    first = servers["docs"]
    # Documents as build_doc_prompt formats them in prompts (its default format).
    formatted = [DEFAULT_DOC_FORMAT.format(doc=text) for text in corpus]
    result = precompute(first.base_url, document_requests(tokenizer, system, formatted), concurrency=2)
    assert result.failed == 0 and result.documents == 4
    assert wait_for_ssd_writes(first.base_url)
    prompt = build_doc_prompt(tokenizer, system, [corpus[2], corpus[0], corpus[3]], "What links them?")
    # A second server on the same store (stores are shareable): it restores, never serves traffic.
    # With the default warm-up policy it warms nothing at a first sighting: what it reuses
    # was restored.
    with serving({"restarted": ssd_server(tiny_model, store_dir, *DOC_REUSE[:4])}) as started:
        restarted = started["restarted"]
        assert restarted.pcr_state()["ssd"]["counters"]["restored_chunks"] > 0
        out = _generate(restarted, prompt, marked=True)
        state = restarted.pcr_state(check_invariants=True)
        # The default policy (--pcr-doc-warmup-after 2): documents first seen are served by
        # plain prefill, and warmed when they recur, for the request that sees them again.
        pair = passages[40:42]
        first_sighting = build_doc_prompt(tokenizer, system, pair, "Which is longer?")
        seen = _generate(restarted, first_sighting, marked=True)
        assert _doc_counters(restarted)["canonical_requests"] == 0
        assert seen["meta_info"]["cached_tokens"] < first_sighting.doc_bounds[1]
        recurring = build_doc_prompt(tokenizer, system, pair[::-1], "Which is longer?")
        reused = _generate(restarted, recurring, marked=True)
        assert _doc_counters(restarted)["canonical_requests"] == 2
        assert reused["meta_info"]["cached_tokens"] == recurring.doc_bounds[-1]
        # A KV hint marking documents reads each one's canonical chain from SSD ahead of the
        # request, which then reuses it from host memory. corpus[1] (precomputed, unused
        # here) comes second, behind corpus[2] (already in memory): the prompt's own chain
        # has nothing on SSD, so every hinted read is a document's canonical chain.
        hinted = build_doc_prompt(tokenizer, system, [corpus[2], corpus[1]], "What is it?")
        hint = restarted.generate(
            {
                "input_ids": hinted.input_ids,
                "sampling_params": {"max_new_tokens": 0, "custom_params": hinted.custom_params()},
                "kv_hints": hint_envelope({"ttl_s": 30}, "m1"),
            }
        )
        assert hint["meta_info"]["finish_reason"]["pcr_hint"] == "registered"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ssd_now = restarted.pcr_state()["ssd"]
            if ssd_now["counters"]["hint_issued"] > 0 and ssd_now["reads_in_flight"] == 0:
                break
            time.sleep(0.1)
        assert ssd_now["counters"]["hint_issued"] > 0, ssd_now["counters"]
        final = _generate(restarted, hinted, marked=True)
        assert final["meta_info"]["cached_tokens"] == hinted.doc_bounds[-1]
        assert restarted.pcr_state()["ssd"]["counters"]["hint_in_time"] > 0
    assert out["meta_info"]["cached_tokens"] == prompt.doc_bounds[-1]
    assert state["doc_reuse"]["counters"]["canonical_requests"] == 0
    ssd = state["ssd"]["counters"]
    assert ssd["bytes_read_on_demand"] + ssd["bytes_read_prefetch"] > 0, ssd  # the canonical chains came from SSD
    assert state["invariants"]["ok"] is True
    # The server that precomputed them answers the same, token for token.
    assert out["output_ids"] == _generate(first, prompt, marked=True)["output_ids"]


def test_frontend_dsl_programs_mark_documents(servers, tokenizer, passages):
    """A DSL program wrapping documents in ``doc()`` reuses them (the endpoint sends token
    ids and bounds), and answers as the same request sent to /generate does."""
    import sglang as sgl

    from pcr_client.frontend import DocReuseEndpoint, doc, marked_input

    docs = servers["docs"]
    chosen = passages[40:43]

    @sgl.function
    def rag(s, documents, question):
        s += "Answer from the documents.\n\n" + "".join(doc(d + "\n\n") for d in documents)
        s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=8, temperature=0)

    backend = DocReuseEndpoint(docs.base_url, tokenizer=tokenizer)
    for order in ((0, 1, 2), (2, 0, 1)):
        before = _doc_counters(docs)
        state = rag.run(documents=[chosen[i] for i in order], question="Who?", backend=backend)
        answer = state["answer"]  # waits for the program (it runs in a thread of its own)
        assert state.error() is None
        after = _doc_counters(docs)
        text = (
            "Answer from the documents.\n\n"
            + "".join(doc(chosen[i] + "\n\n") for i in order)
            + "Question: Who?\nAnswer:"
        )
        ids, bounds = marked_input(tokenizer, text)
        assert after["requests"] == before["requests"] + 1
        # Every document reused (the first one partly by the exact prefix it shares).
        assert state.get_meta_info("answer")["cached_tokens"] == bounds[-1]
        direct = docs.generate(
            {"input_ids": ids, "sampling_params": {**SAMPLING, "custom_params": {"pcr_doc_bounds": bounds}}}
        )
        assert answer == direct["text"]


def test_a_hyde_pipeline_marking_its_documents_reuses_them_and_hints_them(servers, tokenizer, passages):
    """The HyDE DSL pipeline with ``mark_documents``: its final prompt and its KV hint go
    as token ids with the documents' bounds; the hint registers (with each predicted
    document's canonical chain beside the prompt's), the answer is what the same marked
    prompt gets sent directly, and the pipeline's second run reuses every document."""
    from pcr_client.frontend import DocReuseEndpoint, marked_input
    from pcr_client.rag.embedder import embed_texts, load_embedder
    from pcr_client.rag.ivf import IVFDatastore
    from pcr_client.rag.lookahead import LookaheadRetriever
    from pcr_client.rag.pipelines import KVHinter, PipelineConfig, Pipelines, render_rag_prompt

    docs = servers["docs"]
    texts = passages[44:56]
    datastore = IVFDatastore.build(embed_texts(texts), 2, seed=0)
    embedder = load_embedder()
    retriever = LookaheadRetriever(datastore, embedder.encode, nprobe=2, k=3)  # every cluster: exact
    backend = DocReuseEndpoint(docs.base_url, tokenizer=tokenizer)
    hinter = KVHinter(docs.base_url, tokenizer=tokenizer)
    pipelines = Pipelines(
        retriever,
        texts,
        backend,
        hinter,
        PipelineConfig(hyde_tokens=8, answer_tokens=8, lookahead=False, mark_documents=True),
    )
    question = "What does the first passage describe?"
    try:
        registered = docs.pcr_state()["hints"]["counters"]["registered"]
        before = _doc_counters(docs)
        first = pipelines.hyde(question)
        after_first = _doc_counters(docs)
        second = pipelines.hyde(question)
    finally:
        retriever.close()
        hinter.close()
    assert hinter.stats.sent == 2 and hinter.stats.registered == 2 and hinter.stats.failed == 0
    assert docs.pcr_state()["hints"]["counters"]["registered"] == registered + 2
    assert after_first["requests"] > before["requests"]  # the final request marked its documents
    assert first.doc_ids == second.doc_ids and len(first.doc_ids) == 3
    ids, bounds = marked_input(tokenizer, render_rag_prompt([texts[i] for i in first.doc_ids], question, True))
    assert len(bounds) == 6
    direct = docs.generate(
        {"input_ids": ids, "sampling_params": {**SAMPLING, "custom_params": {"pcr_doc_bounds": bounds}}}
    )
    assert second.answer == direct["text"].strip()
    assert second.cached_tokens == bounds[-1], second.cached_details  # every document reused


def test_openai_completions_with_a_token_prompt_mark_documents(servers, tokenizer, passages):
    """OpenAI-compatible clients: /v1/completions takes a token prompt and custom_params."""
    docs = servers["docs"]
    prompt = build_doc_prompt(tokenizer, "OpenAI client.", passages[43:45], "Which?")
    _generate(docs, prompt, marked=True)  # warm
    before = _doc_counters(docs)
    response = requests.post(
        docs.base_url + "/v1/completions",
        timeout=120,
        json={
            "model": "default",
            "prompt": prompt.input_ids,
            "max_tokens": 8,
            "temperature": 0,
            "custom_params": prompt.custom_params(),
        },
    )
    assert response.status_code == 200, response.text
    after = _doc_counters(docs)
    assert after["docs_reused"] - before["docs_reused"] == 2
    direct = _generate(docs, prompt, marked=True)
    assert response.json()["choices"][0]["text"] == direct["text"]


def test_a_batch_of_marked_prompts_is_warmed_and_reused(servers, tokenizer, passages):
    """A batch request (a list of token prompts) goes through SGLang's batch send: its
    documents are warmed all together first, so each prompt reuses every document."""
    docs = servers["docs"]
    fresh = passages[24:28]
    prompts = [
        build_doc_prompt(tokenizer, "Batch.", [fresh[i] for i in order], "Which one?")
        for order in ((0, 1, 2), (3, 2, 1))
    ]
    before = _doc_counters(docs)
    outs = docs.generate(
        {
            "input_ids": [p.input_ids for p in prompts],
            "sampling_params": [p.sampling_params(**SAMPLING) for p in prompts],
        }
    )
    after = _doc_counters(docs)
    assert after["canonical_requests"] - before["canonical_requests"] == 4  # each document once
    for prompt, out in zip(prompts, outs):
        assert out["meta_info"]["cached_tokens"] == prompt.doc_bounds[-1]


# ---------------------------------------------------------------- documents sent as text
# Clients with no tokenizer: the OpenAI client's chat completions with ``documents`` in
# ``extra_body``, a LangChain retriever and chat model, /generate and /v1/completions with
# text plus documents. The oracle is the marked-token-id path: the same prompt built on
# the client (``build_doc_prompt``) and sent as ``input_ids`` with ``pcr_doc_bounds``.


@pytest.fixture(scope="module")
def text_passages():
    """Passages no other test of the module marks (their warm-ups and reuse are counted)."""
    return [a.text[:300] for a in load_wiki_articles()[560:580]]


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    """The client-side oracle's tokenizer: the tiny model's, with the server's chat template."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE.read_text().replace("\\n", "\n").strip("\n")
    return tok


@pytest.fixture(scope="module")
def openai_client(servers):
    from openai import OpenAI

    return OpenAI(base_url=servers["docs"].base_url + "/v1", api_key="none", max_retries=0)


def _marked_twin(server: ServerProcess, prompt, **sampling) -> dict:
    """The same prompt through the marked-token-id path."""
    return server.generate(
        {"input_ids": prompt.input_ids, "sampling_params": prompt.sampling_params(**{**SAMPLING, **sampling})}
    )


def test_openai_chat_documents_are_reused_in_another_order_and_answer_as_marked_token_ids(
    servers, openai_client, chat_tokenizer, text_passages
):
    docs = servers["docs"]
    trio = text_passages[0:3]
    system, question = "Answer from the documents.", "Which document mentions a year?"
    for n, order in enumerate(((0, 1, 2), (2, 0, 1))):
        documents = [trio[i] for i in order]
        before = _doc_counters(docs)
        reply = openai_client.chat.completions.create(
            model="default",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=8,
            temperature=0,
            extra_body={"documents": documents},
        )
        after = _doc_counters(docs)
        prompt = build_doc_prompt(chat_tokenizer, system, documents, question, question_format="{question}")
        assert reply.usage.prompt_tokens == len(prompt.input_ids)
        assert after["requests"] == before["requests"] + 1
        if n:  # in another order: every document reused, only the question computed
            assert after["docs_reused"] - before["docs_reused"] == 3
            assert reply.usage.prompt_tokens_details.cached_tokens == prompt.doc_bounds[-1]
        twin = _marked_twin(docs, prompt)
        assert reply.choices[0].message.content == twin["text"]
        assert twin["meta_info"]["cached_tokens"] == prompt.doc_bounds[-1]
    # Streamed, the same answer and usage.
    stream = openai_client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"documents": documents},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == twin["text"]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == prompt.doc_bounds[-1]


def test_chat_documents_report_reuse_apart_and_keep_n_stop_and_logprobs(
    servers, openai_client, chat_tokenizer, text_passages
):
    """``meta_info`` and /metrics give the reused documents apart from exact prefix hits;
    ``n``, ``stop`` and ``logprobs`` work as without documents."""
    docs = servers["docs"]
    documents = [{"title": "First", "text": text_passages[3]}, text_passages[4]]
    messages = [{"role": "user", "content": "Summarize."}]
    openai_client.chat.completions.create(
        model="default", messages=messages, max_tokens=1, extra_body={"documents": documents}
    )  # warm both
    prompt = build_doc_prompt(
        chat_tokenizer, "", [text_passages[4], "First\n" + text_passages[3]], "Summarize.", question_format="{question}"
    )
    exact_before = prometheus_counts(docs, "sglang:cached_tokens_total", "cache_source")
    reused_before = _doc_counters(docs)["tokens_reused"]
    reply = openai_client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"documents": documents[::-1], "return_meta_info": True},
    )
    exact_after = prometheus_counts(docs, "sglang:cached_tokens_total", "cache_source")
    reused = _doc_counters(docs)["tokens_reused"] - reused_before
    details = reply.choices[0].meta_info["cached_tokens_details"]
    tiers = {k: v for k, v in details.items() if isinstance(v, int)}
    moved = prompt.doc_bounds[-1] - prompt.doc_bounds[2]  # the second document, past the exact prefix
    assert tiers["documents"] >= moved and sum(tiers.values()) == prompt.doc_bounds[-1], details
    assert reply.usage.prompt_tokens_details.cached_tokens == prompt.doc_bounds[-1]
    # SGLang's cached-token counter gets the exact part only, never the documents' tokens,
    # which PCR's document-reuse counter (sglang:pcr_doc_reuse_total{kind="tokens_reused"}) has.
    assert sum(exact_after.values()) - sum(exact_before.values()) == prompt.doc_bounds[-1] - tiers["documents"]
    assert reused == tiers["documents"]
    twin = _marked_twin(docs, prompt, max_new_tokens=6)
    assert reply.choices[0].message.content == twin["text"]
    several = openai_client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=6,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"documents": documents[::-1]},
    )
    assert [c.message.content for c in several.choices] == [twin["text"]] * 2
    assert all(len(c.logprobs.content) == 6 and len(c.logprobs.content[0].top_logprobs) == 2 for c in several.choices)
    # Tools go to the template as without documents (this one ignores them: the same prompt).
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look a word up.",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
            },
        }
    ]
    with_tools = openai_client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=6,
        temperature=0,
        tools=tools,
        tool_choice="auto",
        extra_body={"documents": documents[::-1]},
    )
    assert with_tools.usage.prompt_tokens == len(prompt.input_ids)
    # With tools SGLang keeps special tokens in the text (for a tool parser to see them).
    kept = _marked_twin(docs, prompt, max_new_tokens=6, skip_special_tokens=False)["text"]
    assert with_tools.choices[0].message.content == kept
    words = twin["text"].split()
    if len(words) > 1:
        stopped = openai_client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=6,
            temperature=0,
            stop=[words[1]],
            extra_body={"documents": documents[::-1]},
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == twin["text"][: twin["text"].index(words[1])]


def test_a_chat_request_without_documents_is_served_as_before(servers, openai_client, chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    reply = openai_client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
    ids = chat_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    reference = servers["nocache"].generate({"input_ids": ids, "sampling_params": SAMPLING})
    assert reply.choices[0].message.content == reference["text"]


def test_a_langchain_retriever_and_chat_model_reuse_documents_with_no_client_tokenizer(
    servers, chat_tokenizer, text_passages
):
    """LangChain's ``ChatOpenAI`` answering from an in-memory vector store's retriever (the
    project's sentence embedder): the retrieved documents go in ``extra_body``; the second
    question retrieves the same documents in another order and reuses all of them."""
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI

    from pcr_client.rag.embedder import load_embedder

    class ProjectEmbeddings(Embeddings):
        def __init__(self):
            self.encoder = load_embedder()

        def embed_documents(self, texts):
            return self.encoder.encode(texts).tolist()

        def embed_query(self, text):
            return self.encoder.encode([text])[0].tolist()

    docs = servers["docs"]
    corpus = text_passages[5:8]
    retriever = InMemoryVectorStore.from_texts(corpus, ProjectEmbeddings()).as_retriever(search_kwargs={"k": 3})
    llm = ChatOpenAI(
        base_url=docs.base_url + "/v1", api_key="none", model="default", temperature=0, max_tokens=8, max_retries=0
    )

    def answer(question: str):
        retrieved = [d.page_content for d in retriever.invoke(question)]
        reply = llm.invoke(
            [("system", "Answer from the documents."), ("human", question)], extra_body={"documents": retrieved}
        )
        return retrieved, reply

    first_docs, _ = answer(corpus[0][:80])
    before = _doc_counters(docs)
    question = corpus[2][:80]
    second_docs, reply = answer(question)
    after = _doc_counters(docs)
    assert sorted(first_docs) == sorted(second_docs) == sorted(corpus) and first_docs != second_docs
    prompt = build_doc_prompt(
        chat_tokenizer, "Answer from the documents.", second_docs, question, question_format="{question}"
    )
    assert after["docs_reused"] - before["docs_reused"] == 3
    assert reply.usage_metadata["input_token_details"]["cache_read"] == prompt.doc_bounds[-1]
    assert reply.content == _marked_twin(docs, prompt)["text"]


def test_generate_and_completions_take_text_plus_documents(servers, tokenizer, text_passages):
    docs = servers["docs"]
    pair = text_passages[8:10]
    text = "Answer from the documents.\n\n{{documents}}Question: Which?\nAnswer:"
    client = build_doc_prompt(tokenizer, "Answer from the documents.", pair, "Which?", use_chat_template=False)
    # SGLang tokenizes a text prompt with what the tokenizer adds first; the tiny one adds no BOS.
    prompt = type(client)(client.input_ids[1:], [b - 1 for b in client.doc_bounds])
    out = docs.generate({"text": text, "documents": pair, "sampling_params": SAMPLING})
    assert out["meta_info"]["prompt_tokens"] == len(prompt.input_ids)
    assert out["text"] == _marked_twin(docs, prompt)["text"]
    # The same documents in custom_params (what an Engine or batch client sends), reversed: reused.
    before = _doc_counters(docs)
    reversed_prompt = build_doc_prompt(
        tokenizer, "Answer from the documents.", pair[::-1], "Which?", use_chat_template=False
    )
    reversed_prompt = type(client)(reversed_prompt.input_ids[1:], [b - 1 for b in reversed_prompt.doc_bounds])
    out = docs.generate({"text": text, "sampling_params": {**SAMPLING, "custom_params": {"pcr_documents": pair[::-1]}}})
    assert _doc_counters(docs)["docs_reused"] - before["docs_reused"] == 2
    assert out["meta_info"]["cached_tokens"] == reversed_prompt.doc_bounds[-1]
    assert out["meta_info"]["cached_tokens_details"]["documents"] > 0
    response = requests.post(
        docs.base_url + "/v1/completions",
        timeout=120,
        json={"model": "default", "prompt": text, "documents": pair[::-1], "max_tokens": 8, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == out["text"]
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == reversed_prompt.doc_bounds[-1]


BAD_DOCUMENTS = [
    ([], "documents is empty"),
    (["A fine document about the sea and its tides, long enough.", ""], r"documents\[1\] is empty"),
    ([7], r"documents\[0\] must be a string or"),
    ("not a list", "documents must be a list"),
    (["Long enough document about the sea and its tides here."] * 65, r"holds 65 documents; .*--pcr-doc-max-documents"),
    (["too short"], r"documents\[0\] is \d+ tokens as rendered; .*--pcr-doc-min-tokens"),
    (
        ["A very long document. " * 600],
        r"documents: the prompt with its 1 documents is \d+ tokens, over the model's "
        r"context length \(2048 tokens\)",
    ),
]


@pytest.mark.parametrize(
    "documents, message",
    BAD_DOCUMENTS,
    ids=["empty", "empty-item", "not-string", "not-list", "too-many", "too-short", "over-context"],
)
def test_bad_documents_get_http_400_naming_the_field_on_every_entry_point(servers, openai_client, documents, message):
    import openai

    docs = servers["docs"]
    with pytest.raises(openai.BadRequestError, match=message):
        openai_client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Q?"}],
            max_tokens=4,
            extra_body={"documents": documents},
        )
    text = "Answer.\n\n{{documents}}Question?"
    for path, body in (
        ("/v1/completions", {"model": "default", "prompt": text, "documents": documents, "max_tokens": 4}),
        ("/generate", {"text": text, "documents": documents, "sampling_params": SAMPLING}),
    ):
        response = requests.post(docs.base_url + path, json=body, timeout=60)
        assert response.status_code == 400, (path, response.text)
        assert re.search(message, response.text), (path, response.text)


# ------------------------------------------------------------------------ reorder (exact)
def _served_order(out: dict) -> list[int]:
    return out["meta_info"]["pcr_doc_order"]


def test_reorder_serves_documents_in_a_served_order_token_for_token_as_the_unmarked_prompt(servers, tokenizer):
    """``pcr_doc_reuse: "reorder"``: documents sent in another order than a sequence served
    before (or starting with a run of one) are served in that sequence's order, the question
    last. Each answer equals the no-cache server's answer to the prompt in the served order,
    unmarked; the documents' KV is an exact prefix hit (nothing reported as document reuse).
    Another tenant (``cache_salt``) does not follow the first tenant's order."""
    docs, ref = servers["docs"], servers["nocache"]
    passages = [a.text[:300] for a in load_wiki_articles()[580:584]]
    system = "Reorder: answer from the documents."

    def ask(order, question, **extra):
        prompt = build_doc_prompt(tokenizer, system, [passages[i] for i in order], question)
        out = docs.generate(
            {
                "input_ids": prompt.input_ids,
                **extra,
                "sampling_params": prompt.sampling_params(mode="reorder", **SAMPLING),
            }
        )
        served = [order[i] for i in _served_order(out)]
        twin = build_doc_prompt(tokenizer, system, [passages[i] for i in served], question)
        expected = ref.generate({"input_ids": twin.input_ids, "sampling_params": dict(SAMPLING)})
        assert out["output_ids"] == expected["output_ids"], (order, served)
        return out, served, twin

    before = _doc_counters(docs)
    out, served, _ = ask([0, 1, 2], "What do the documents describe?")
    assert served == [0, 1, 2]  # nothing served before: as given
    out, served, twin = ask([2, 0, 1], "Which document is the oldest?")
    assert served == [0, 1, 2] and _served_order(out) == [1, 2, 0]
    end = twin.doc_bounds[-1]
    assert out["meta_info"]["cached_tokens"] >= end // CHUNK_SIZE * CHUNK_SIZE
    assert out["meta_info"].get("cached_tokens_details", {}).get("documents", 0) == 0
    out, served, _ = ask([3, 1, 0], "Name one place.")  # a run of two, then the new one
    assert served == [0, 1, 3]
    out, served, _ = ask([1, 0], "Who?", cache_salt="another-tenant")
    assert served == [1, 0]
    after = _doc_counters(docs)
    assert after["docs_reused"] == before["docs_reused"]  # exact: no document KV re-placed


def test_reorder_applies_to_documents_sent_as_text(servers):
    docs = servers["docs"]
    pair = [a.text[:300] for a in load_wiki_articles()[584:586]]
    text = "Reorder, text documents.\n\n{{documents}}Question: Which?\nAnswer:"
    sampling = {**SAMPLING, "custom_params": {"pcr_doc_reuse": "reorder"}}
    first = docs.generate({"text": text, "documents": pair, "sampling_params": sampling})
    assert _served_order(first) == [0, 1]
    second = docs.generate({"text": text, "documents": pair[::-1], "sampling_params": sampling})
    assert _served_order(second) == [1, 0]
    assert second["output_ids"] == first["output_ids"]  # the same prompt, served twice
    assert second["meta_info"]["cached_tokens"] > 0


def test_a_hint_only_request_with_text_documents_hints_each_documents_chain(servers, tokenizer, text_passages):
    """A KV hint in upstream's words (``kv.prefetch@1.0``) sent with ``text`` plus
    ``documents``, as a RAG application sends it: the server renders and marks the documents,
    and registers the prompt's hint and one per document (their canonical chains), exactly
    as the same hint sent as token ids with bounds does."""
    docs = servers["docs"]
    pair = text_passages[12:14]
    text = "Answer from the documents.\n\n{{documents}}Question: Which is older?\nAnswer:"

    def envelope(message_id: str) -> dict:
        hint = hint_envelope({"ttl_s": 60}, message_id)
        hint["actions"][0].update(action_type="kv.prefetch", action_version="1.0")
        return hint

    def live_hints() -> int:
        return docs.pcr_state()["hints"]["live"]

    before = live_hints()
    out = docs.generate(
        {"text": text, "documents": pair, "sampling_params": {"max_new_tokens": 0}, "kv_hints": envelope("text-docs")}
    )
    assert out["meta_info"]["finish_reason"]["pcr_hint"] == "registered"
    by_text = live_hints() - before
    client = build_doc_prompt(tokenizer, "Answer from the documents.", pair, "Which is older?", use_chat_template=False)
    ids, bounds = client.input_ids[1:], [b - 1 for b in client.doc_bounds]  # the tiny tokenizer adds no BOS
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    before = live_hints()
    out = docs.generate(
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "custom_params": {"pcr_doc_bounds": bounds}},
            "kv_hints": envelope("ids"),
        }
    )
    assert out["meta_info"]["finish_reason"]["pcr_hint"] == "registered"
    assert by_text == live_hints() - before == 1 + len(pair)  # the prompt's chain and each document's


@pytest.fixture(scope="module")
def mask_server(tiny_model):
    """A document-reuse server with the least position-mask budget there is (1 MiB): one
    request of ~900 tokens fits it, two side by side do not."""
    args = (*TIERED_ARGS, *DOC_REUSE, "--pcr-position-mask-mb", "1", "--max-total-tokens", "12000")
    server = {"mask": ServerProcess(tiny_model, args)}
    with serving(server):
        yield server["mask"]


def test_requests_that_could_take_their_batchs_position_mask_over_budget_wait_and_answer_exactly(
    mask_server, baseline_server, tokenizer, passages
):
    """Issue 42: the mask a forward with a permuted row builds covers every request of its
    batch. Each request's own part fits the budget (placement recomputes none), two do not:
    sent 8 at a time, some wait a pass in the queue (``mask_batch_held``), and every answer
    equals the no-cache server's token for token (``lego`` recomputing every re-placed token)."""
    rng = random.Random(11)
    prompts = []
    for i in range(8):
        chosen: list[str] = []
        for passage in rng.sample(passages, len(passages)):
            chosen.append(passage)
            prompt = build_doc_prompt(tokenizer, "Mask budget.", chosen, f"Mask question {i}?")
            if len(prompt.input_ids) >= 820:
                break
        assert 820 <= len(prompt.input_ids) < 1000, len(prompt.input_ids)  # own part < 1 MiB; two > 1 MiB
        prompts.append(prompt)
    for prompt in prompts:  # every document warmed, one request at a time
        _generate(mask_server, prompt, marked=True, mode="concat")
    before = _doc_counters(mask_server)
    lego = {"pcr_doc_recompute_tokens": 100000}
    for _ in range(3):  # until some pass had two of them waiting at once
        with ThreadPoolExecutor(len(prompts)) as executor:
            outs = list(executor.map(lambda p: _generate(mask_server, p, True, "lego", **lego), prompts))
        for prompt, out in zip(prompts, outs):
            assert out["output_ids"] == _generate(baseline_server, prompt, marked=False)["output_ids"]
        if _doc_counters(mask_server)["mask_batch_held"] > before["mask_batch_held"]:
            break
    after = _doc_counters(mask_server)
    assert after["mask_batch_held"] > before["mask_batch_held"], after
    assert after["mask_over_budget"] == before["mask_over_budget"]  # the batch's budget, not placement's
    assert after["tokens_recomputed"] > before["tokens_recomputed"]
