"""``reorder``: which order a request's documents are served in (the store's matching of
permutations and runs, tenants kept apart, bounded memory), how the tokenizer-side call
rewrites SGLang's real tokenized request, and that the mode is exact everywhere it is read
(the scheduler's request contract, the calibration gate, the server's startup checks)."""

from __future__ import annotations

import asyncio
from array import array
from types import SimpleNamespace

import pytest

from pcr_sglang.reuse.bounds import (
    DOC_BOUNDS_PARAM,
    DOC_MODE_PARAM,
    EXACT_MODES,
    REQUEST_MODES,
    DocSpan,
    Recompute,
    parse_doc_bounds,
    request_recompute,
)
from pcr_sglang.reuse.reorder import (
    ORDER_META_KEY,
    OrderLimits,
    OrderStore,
    Tenant,
    reorder_request,
    report_doc_order,
)

LEAD = [1, 2, 3]
QUESTION = [90, 91, 92]
DOCS = {name: [ord(name) * 10 + i for i in range(3 + k)] for k, name in enumerate("ABCDEFG")}  # all lengths apart


def prompt(
    names: str, gaps: list[list[int]] | None = None, lead: list[int] = LEAD, question: list[int] = QUESTION
) -> tuple[list[int], list[DocSpan]]:
    """``lead ‖ D0 ‖ gap1 ‖ D1 ‖ ... ‖ question`` and its documents' spans."""
    tokens, bounds = list(lead), []
    for k, name in enumerate(names):
        if k and gaps is not None:
            tokens += gaps[k - 1]
        bounds += [len(tokens), len(tokens) + len(DOCS[name])]
        tokens += DOCS[name]
    tokens += question
    return tokens, list(parse_doc_bounds(bounds, len(tokens)))


def served_names(names: str, order: tuple[int, ...]) -> str:
    return "".join(names[i] for i in order)


def test_a_permutation_of_a_served_sequence_is_served_in_its_order_and_is_its_exact_prefix():
    store = OrderStore()
    first_tokens, first_spans = prompt("ABCD")
    first = store.plan(first_tokens, first_spans, Tenant())
    assert first.order == (0, 1, 2, 3) and not first.moved and first.matched == 0
    assert first.input_ids == first_tokens

    tokens, spans = prompt("CADB", question=[77, 78])
    again = store.plan(tokens, spans, Tenant())
    assert served_names("CADB", again.order) == "ABCD" and again.moved and again.matched == 4
    assert again.input_ids == prompt("ABCD", question=[77, 78])[0]  # the question stays last
    assert again.input_ids[: first_spans[-1].end] == first_tokens[: first_spans[-1].end]
    assert again.doc_bounds == [s for span in first_spans for s in (span.start, span.end)]
    assert store.stats.requests == 2 and store.stats.hits == 1 and store.stats.moved == 1


def test_a_run_of_a_served_sequence_comes_first_and_the_rest_keep_the_clients_order():
    store = OrderStore()
    store.plan(*prompt("ABCD"), Tenant())
    partial = store.plan(*prompt("EBGA"), Tenant())
    assert served_names("EBGA", partial.order) == "ABEG" and partial.matched == 2
    nothing = store.plan(*prompt("BCDE"), Tenant())  # no served sequence starts with any of them
    assert nothing.order == (0, 1, 2, 3) and nothing.matched == 0 and not nothing.moved


def test_the_longest_run_wins_and_the_most_recent_breaks_ties():
    store = OrderStore()
    store.plan(*prompt("ABEF"), Tenant())
    store.plan(*prompt("CDEF"), Tenant())  # no run of ABEF: served as given, remembered
    assert served_names("FDCA", store.plan(*prompt("FDCA"), Tenant()).order) == "CDFA"
    for first, second, served in (("AB", "CD", "CDBA"), ("CD", "AB", "ABDC")):
        tied = OrderStore()
        tied.plan(*prompt(first), Tenant())
        tied.plan(*prompt(second), Tenant())
        assert served_names("DBCA", tied.plan(*prompt("DBCA"), Tenant()).order) == served  # the most recent


def test_a_shorter_request_follows_a_longer_sequence_and_a_longer_one_extends_it():
    store = OrderStore()
    store.plan(*prompt("ABCD"), Tenant())
    assert served_names("CA", store.plan(*prompt("CA"), Tenant()).order) == "AC"  # run A, then C
    assert served_names("BA", store.plan(*prompt("BA"), Tenant()).order) == "AB"
    extended = store.plan(*prompt("EDCBA"), Tenant())
    assert served_names("EDCBA", extended.order) == "ABCDE" and extended.matched == 4
    assert len(store) == 2  # ABCDE replaced ABCD, which it covers; AC is its own


def test_separators_stay_at_their_slots_and_must_match():
    store = OrderStore()
    gaps = [[5], [6]]
    store.plan(*prompt("ABC", gaps), Tenant())
    tokens, spans = prompt("CAB", gaps)
    again = store.plan(tokens, spans, Tenant())
    assert served_names("CAB", again.order) == "ABC"
    assert again.input_ids == prompt("ABC", gaps)[0]
    other = store.plan(*prompt("CAB", [[7], [6]]), Tenant())  # slot 1's separator differs
    assert served_names("CAB", other.order) == "ACB" and other.matched == 1


def test_repeated_documents_are_each_placed_once():
    store = OrderStore()
    store.plan(*prompt("ABA"), Tenant())
    again = store.plan(*prompt("AAB"), Tenant())
    assert sorted(again.order) == [0, 1, 2] and served_names("AAB", again.order) == "ABA"
    assert again.input_ids == prompt("ABA")[0]


@pytest.mark.parametrize(
    "other",
    [
        Tenant(extra_key="t2"),
        Tenant(cache_salt="s"),
        Tenant(lora_id="7"),
        Tenant(lora_name="adapter"),
    ],
)
def test_tenants_and_leading_tokens_keep_their_orders_apart(other):
    store = OrderStore()
    store.plan(*prompt("ABCD"), Tenant())
    assert store.plan(*prompt("DCBA"), other).order == (0, 1, 2, 3)
    assert store.plan(*prompt("DCBA", lead=[1, 2, 4]), Tenant()).order == (0, 1, 2, 3)
    assert served_names("BADC", store.plan(*prompt("BADC"), Tenant()).order) == "ABCD"


def test_tenant_fields_do_not_run_into_each_other():
    store = OrderStore()
    store.plan(*prompt("ABCD"), Tenant(extra_key="ab", cache_salt="c"))
    assert store.plan(*prompt("DCBA"), Tenant(extra_key="a", cache_salt="bc")).order == (0, 1, 2, 3)


def test_memory_is_bounded_and_the_least_recently_used_is_forgotten():
    store = OrderStore(OrderLimits(max_sequences=3, per_root=2))
    store.plan(*prompt("AB"), Tenant())
    store.plan(*prompt("CD"), Tenant())
    store.plan(*prompt("EF"), Tenant())  # per root: AB forgotten
    assert len(store) == 2
    assert store.plan(*prompt("BA"), Tenant(extra_key="x")).order == (0, 1)  # another root: kept apart
    assert len(store) == 3
    assert served_names("DC", store.plan(*prompt("DC"), Tenant()).order) == "CD"  # CD used: recent
    store.plan(*prompt("AG"), Tenant(extra_key="y"))  # a fourth: the least recent root's oldest goes
    assert len(store) == 3
    assert store.plan(*prompt("BA"), Tenant(extra_key="x")).order == (0, 1)  # forgotten, remembered again
    for i in range(50):
        store.plan(*prompt("AB", lead=[100 + i]), Tenant())
        assert len(store) <= 3
    with pytest.raises(ValueError):
        OrderLimits(max_sequences=0)


# ---------------------------------------------------------------- the tokenizer-side call
def tokenized(tokens: list[int], bounds: list[int], custom: dict | None = None, rid: str = "r1"):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = {DOC_BOUNDS_PARAM: bounds, DOC_MODE_PARAM: "reorder"} if custom is None else custom
    return TokenizedGenerateReqInput(
        input_text=None,
        input_ids=array("q", tokens),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(max_new_tokens=4, custom_params=params),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        rid=rid,
    )


def flat(spans: list[DocSpan]) -> list[int]:
    return [x for span in spans for x in (span.start, span.end)]


def test_the_tokenized_request_is_rewritten_and_its_state_notes_the_order():
    manager = SimpleNamespace(rid_to_state={"r1": SimpleNamespace(), "r2": SimpleNamespace()})
    tokens, spans = prompt("ABC")
    assert reorder_request(manager, tokenized(tokens, flat(spans)), "concat").order == (0, 1, 2)
    assert manager.rid_to_state["r1"].pcr_doc_order == [0, 1, 2]
    tokens2, spans2 = prompt("CBA")
    shared = {DOC_BOUNDS_PARAM: flat(spans2), DOC_MODE_PARAM: "reorder"}
    request = tokenized(tokens2, flat(spans2), shared, rid="r2")
    result = reorder_request(manager, request, "concat")
    assert list(request.input_ids) == tokens and isinstance(request.input_ids, array)
    assert request.sampling_params.custom_params[DOC_BOUNDS_PARAM] == flat(spans) == result.doc_bounds
    assert manager.rid_to_state["r2"].pcr_doc_order == [2, 1, 0]
    # The client's dict (shared by a batch's samples) is not edited; a second sample reads it as sent.
    assert shared[DOC_BOUNDS_PARAM] == flat(spans2)
    sample = tokenized(tokens2, flat(spans2), shared, rid="r3")
    reorder_request(manager, sample, "concat")
    assert list(sample.input_ids) == tokens


def test_every_sample_of_a_request_is_served_in_the_same_order():
    """``n`` > 1: SGLang's tokenizer manager sends shallow copies of one tokenized request
    (``copy.copy``), sharing its ``SamplingParams``. Red before (review R2): the first sample's
    reordered bounds were written into the shared object, so the others carried them over
    the client's tokens, unreordered and framing no document."""
    import copy

    manager = SimpleNamespace(rid_to_state={})
    tokens, spans = prompt("ABC")
    reorder_request(manager, tokenized(tokens, flat(spans), rid="earlier"), "concat")
    tokens2, spans2 = prompt("CBA")
    base = tokenized(tokens2, flat(spans2), rid="base")
    samples = [copy.copy(base) for _ in range(3)]
    for k, sample in enumerate(samples):
        sample.rid = f"s{k}"
        assert reorder_request(manager, sample, "concat").order == (2, 1, 0)
    for sample in samples:
        assert list(sample.input_ids) == tokens
        assert sample.sampling_params.custom_params[DOC_BOUNDS_PARAM] == flat(spans)
    assert base.sampling_params.custom_params[DOC_BOUNDS_PARAM] == flat(spans2)  # the shared one, as sent


@pytest.mark.parametrize(
    "custom, server_mode",
    [
        ({DOC_MODE_PARAM: "concat"}, "concat"),  # another mode: as given
        ({}, "concat"),  # the server's mode, not reorder
        ({DOC_MODE_PARAM: "bogus"}, "concat"),  # refused at validation; never reaches here rewritten
        ({DOC_MODE_PARAM: "reorder", DOC_BOUNDS_PARAM: [0, 3]}, "concat"),  # bad bounds: as given
    ],
)
def test_other_requests_are_left_as_they_are(custom, server_mode):
    manager = SimpleNamespace(rid_to_state={})
    tokens, spans = prompt("AB")
    reorder_request(manager, tokenized(tokens, flat(spans)), server_mode)  # AB remembered
    swapped, swapped_spans = prompt("BA")
    request = tokenized(swapped, flat(swapped_spans), {DOC_BOUNDS_PARAM: flat(swapped_spans), **custom})
    assert reorder_request(manager, request, server_mode) is None
    assert list(request.input_ids) == swapped


def test_a_reorder_server_reorders_requests_that_name_no_mode():
    manager = SimpleNamespace(rid_to_state={})
    tokens, spans = prompt("AB")
    reorder_request(manager, tokenized(tokens, flat(spans), {DOC_BOUNDS_PARAM: flat(spans)}), "reorder")
    swapped, swapped_spans = prompt("BA")
    request = tokenized(swapped, flat(swapped_spans), {DOC_BOUNDS_PARAM: flat(swapped_spans)})
    assert reorder_request(manager, request, "reorder").moved
    assert list(request.input_ids) == tokens


def test_the_response_says_the_order_served():
    async def outputs(manager, obj=None, state=None, request=None):
        yield {"text": "a", "meta_info": {"id": "r1"}}
        yield {"text": "b", "meta_info": {"id": "r1"}}

    async def collect(state):
        return [out async for out in report_doc_order(outputs, None, obj=None, state=state, request=None)]

    served = asyncio.run(collect(SimpleNamespace(pcr_doc_order=[2, 0, 1])))
    assert [out["meta_info"][ORDER_META_KEY] for out in served] == [[2, 0, 1], [2, 0, 1]]
    assert all(ORDER_META_KEY not in out["meta_info"] for out in asyncio.run(collect(SimpleNamespace())))


# ------------------------------------------------------------------- exact everywhere
def test_reorder_is_an_exact_mode_of_the_request_contract():
    assert "reorder" in EXACT_MODES and "reorder" in REQUEST_MODES
    for server in ("off", "reorder", "concat", "blend"):
        assert request_recompute({DOC_MODE_PARAM: "reorder"}, Recompute(server)) is None  # the scheduler: exact
    from pcr_sglang.reuse.bounds import DocBoundsError

    with pytest.raises(DocBoundsError, match="this server runs --pcr-doc-reuse reorder"):
        request_recompute({DOC_MODE_PARAM: "blend"}, Recompute("reorder"))  # nothing re-placed on it: a 400


def test_a_calibration_never_refuses_reorder():
    from pcr_sglang.reuse.bounds import DocBoundsError
    from pcr_sglang.reuse.gate import CalibrationGate

    gate = CalibrationGate("cal.json", "fp", "blend", 0, 0.1, "gradual", 0)
    server = Recompute("blend", ratio=0.1, gate=gate)
    assert request_recompute({DOC_MODE_PARAM: "reorder"}, server) is None
    with pytest.raises(DocBoundsError, match="calibration"):
        request_recompute({DOC_MODE_PARAM: "concat"}, server)


def test_a_reorder_server_needs_no_page_size_one_and_no_calibration_of_its_mode():
    from pcr_sglang.config import PCRConfig
    from pcr_sglang.reuse import settings as reuse_settings

    config = PCRConfig(enabled=True, doc_reuse="reorder")
    config.validate(page_size=16)  # nothing re-placed: no token-by-token row
    assert reuse_settings.calibration_verdict(config) is None
    assert reuse_settings.recompute(config).mode == "reorder"


def test_the_send_hooks_reorder_before_the_scheduler_sees_the_request_and_warm_nothing():
    """What reaches SGLang's ``_send_one_request`` / ``_send_batch_request``: the request in
    the order served before, on a reorder server (no warm-ups: nothing to re-place)."""
    from pcr_sglang.reuse.tokenizer import send_after_warming, send_batch_after_warming

    sent = []

    async def original(manager, tokenized, *args, **kwargs):
        sent.append(tokenized if isinstance(tokenized, list) else [tokenized])

    class Manager(SimpleNamespace):
        _send_one_request = original  # what a batch's warm-ups would be sent with

    manager = Manager(server_args=SimpleNamespace(enable_pcr=True, pcr_doc_reuse="reorder"), rid_to_state={})
    tokens, spans = prompt("ABC")
    swapped, swapped_spans = prompt("BCA")
    asyncio.run(send_after_warming(original, manager, tokenized(tokens, flat(spans), {DOC_BOUNDS_PARAM: flat(spans)})))
    asyncio.run(
        send_batch_after_warming(
            original,
            manager,
            [tokenized(swapped, flat(swapped_spans), {DOC_BOUNDS_PARAM: flat(swapped_spans)}, rid="b1")],
        )
    )
    assert [list(t.input_ids) for batch in sent for t in batch] == [tokens, tokens]
    assert manager._pcr_doc_warmer is False  # an exact server warms nothing
    off = SimpleNamespace(server_args=SimpleNamespace(enable_pcr=False, pcr_doc_reuse="off"), rid_to_state={})
    request = tokenized(swapped, flat(swapped_spans))
    asyncio.run(send_after_warming(original, off, request))  # no PCR: served as sent
    assert list(request.input_ids) == swapped
