"""Document bounds and the reuse plan (pcr_sglang.reuse.plan): pure logic, no server."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pcr_sglang.reuse.bounds import (
    DocBoundsError,
    DocLimits,
    DocSpan,
    Recompute,
    parse_doc_bounds,
    request_recompute,
    request_warm_now,
)
from pcr_sglang.reuse.plan import (
    CopySegment,
    canonical_chain_keys,
    canonical_tokens,
    plan_reuse,
    row_order,
    with_recompute,
)


@pytest.mark.parametrize(
    "raw, message",
    [
        ("0,5", "flat list"),
        ([], "pairs"),
        ([3, 5, 7], "pairs"),
        ([3, 5.0], "integers"),
        ([3, True], "integers"),
        ([0, 5], "token 0"),
        ([5, 3], "empty or reversed"),
        ([5, 5], "empty or reversed"),
        ([3, 8, 6, 9], "before the previous"),
        ([6, 9, 3, 5], "before the previous"),
        ([3, 50], "outside the prompt"),
        ([-1, 4], "outside the prompt"),
    ],
)
def test_bad_bounds_are_refused_naming_the_problem(raw, message):
    with pytest.raises(DocBoundsError, match=message):
        parse_doc_bounds(raw, 20)


def test_bounds_parse_to_spans():
    assert parse_doc_bounds([2, 5, 5, 9, 12, 20], 20) == (DocSpan(0, 2, 5), DocSpan(1, 5, 9), DocSpan(2, 12, 20))


LIMITS = DocLimits(max_documents=3, min_tokens=2)


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            [2, 4, 4, 6, 6, 8, 8, 10],
            r"marks 4 documents; this server takes at most 3 per request "
            r"\(--pcr-doc-max-documents\)",
        ),
        (
            [2, 4, 4, 5],
            r"document 1 \[4, 5\) has 1 tokens; this server takes documents of at least 2 "
            r"\(--pcr-doc-min-tokens\)",
        ),
    ],
)
def test_bounds_past_the_servers_limits_are_refused_naming_the_flag(raw, message):
    """Review finding 4: any number of documents, of any length, was accepted (2,000
    two-token documents cost 1.44 s of hashing in the scheduler thread)."""
    with pytest.raises(DocBoundsError, match=message):
        parse_doc_bounds(raw, 20, LIMITS)
    assert len(parse_doc_bounds(raw, 20)) == len(raw) // 2  # the format alone is fine


def test_malformed_bounds_are_named_as_such_before_any_limit():
    with pytest.raises(DocBoundsError, match="before the previous document ends"):
        parse_doc_bounds([2, 9, 7, 12], 20, DocLimits(max_documents=3, min_tokens=16))


def test_bounds_within_the_limits_parse():
    assert parse_doc_bounds([2, 4, 4, 6, 8, 20], 20, LIMITS) == (DocSpan(0, 2, 4), DocSpan(1, 4, 6), DocSpan(2, 8, 20))


@pytest.mark.parametrize("custom", ["xpcr_doc_boundsx", ["pcr_doc_bounds"], 3])
def test_custom_params_that_are_not_a_dict_are_refused_naming_the_field(custom):
    """Review finding 14: ``"pcr_doc_bounds" in "xpcr_doc_boundsx"`` is true, and ``.get``
    then raised AttributeError (an error response, and in the scheduler an uncaught one)."""
    with pytest.raises(DocBoundsError, match="sampling_params.custom_params must be an object"):
        request_recompute(custom, Recompute("concat"))
    with pytest.raises(DocBoundsError, match="sampling_params.custom_params must be an object"):
        request_warm_now(custom)


@pytest.mark.parametrize("leading", [1, 3, 4, 5, 9])
def test_canonical_chain_keys_hash_the_leading_tokens_once_and_equal_each_chains_own(leading):
    """The keys of ``S ‖ d ‖ pad`` with ``S``'s whole chunks shared are those of hashing
    each canonical sequence on its own, wherever ``S`` ends on the chunk grid."""
    from pcr_sglang.core.keys import chunk_keys

    tokens = list(range(100, 140))
    spans = parse_doc_bounds([leading, leading + 3, leading + 3, leading + 9, leading + 12, leading + 13], 40)
    chains = canonical_chain_keys(b"root", tokens, spans, 4, 0)
    assert chains == [chunk_keys(b"root", canonical_tokens(tokens, span, leading, 4, 0), 4) for span in spans]


def test_canonical_sequence_is_leading_tokens_document_and_padding_to_the_grid():
    tokens = list(range(100, 130))
    seq = canonical_tokens(tokens, DocSpan(1, 10, 17), leading_len=3, chunk_size=8, pad_token_id=0)
    assert seq == [100, 101, 102] + list(range(110, 117)) + [0] * 6
    assert len(seq) % 8 == 0
    exact = canonical_tokens(tokens, DocSpan(0, 3, 8), leading_len=3, chunk_size=8, pad_token_id=0)
    assert exact == tokens[:8]  # already on the grid: no padding


def _plan(spans, exact_len, limit, cached=lambda s: True):
    return plan_reuse(spans, exact_len, limit, cached)


SPANS = (DocSpan(0, 5, 20), DocSpan(1, 20, 31), DocSpan(2, 31, 40))


def test_plan_copies_every_document_behind_the_exact_prefix_with_its_delta():
    plan = _plan(SPANS, exact_len=0, limit=45)
    assert plan.segments == (
        CopySegment(0, 0, 5, 0),  # the leading tokens, from document 0's chain
        CopySegment(0, 5, 20, 5),  # document 0 right after S: delta 0
        CopySegment(1, 20, 31, 5),  # delta 15
        CopySegment(2, 31, 40, 5),  # delta 26
    )
    assert (plan.start, plan.end, plan.exact_end, plan.tokens) == (0, 40, 20, 40)
    assert plan.rotated_tokens == 20 and plan.docs == 3


def test_plan_starts_inside_a_document_the_exact_prefix_covers_in_part():
    plan = _plan(SPANS, exact_len=16, limit=45)
    assert plan.segments[0] == CopySegment(0, 16, 20, 16)
    assert plan.start == 16 and plan.exact_end == 20
    inside_second = _plan(SPANS, exact_len=24, limit=45)
    assert inside_second.segments[0] == CopySegment(1, 24, 31, 9)  # delta 15 still
    assert inside_second.exact_end == 24  # nothing past the exact prefix is exact


def test_plan_stops_at_the_first_document_not_cached_and_at_a_gap():
    plan = _plan(SPANS, 0, 45, cached=lambda s: s.index != 1)
    assert plan.end == 20 and plan.docs == 1
    assert _plan(SPANS, 0, 45, cached=lambda s: s.index != 0) is None
    gapped = (DocSpan(0, 5, 20), DocSpan(1, 22, 30))
    assert _plan(gapped, 0, 45).end == 20


def test_with_gap_filling_an_uncached_document_is_computed_in_place_and_the_next_reused():
    plan = plan_reuse(SPANS, 0, 45, lambda s: s.index != 1, fill_gaps=True)
    assert plan.segments == (CopySegment(0, 0, 5, 0), CopySegment(0, 5, 20, 5), CopySegment(2, 31, 40, 5))
    assert plan.gaps == ((20, 31),) and plan.gap_tokens == 11
    assert (plan.start, plan.end, plan.exact_end) == (0, 40, 20)
    assert plan.reused_tokens == 29 and plan.prefix_tokens == 29 and plan.docs == 2
    assert plan.rotated_positions() == list(range(31, 40))  # what recompute may pick: never a gap
    # A gap right after the exact prefix is no gap to fill: the request is prefilled in
    # order (exact, and its whole prefix enters the tree for the next request like it).
    assert plan_reuse(SPANS, 0, 45, lambda s: s.index != 0, fill_gaps=True) is None
    assert plan_reuse(SPANS, 20, 45, lambda s: s.index != 1, fill_gaps=True) is None
    # Tokens between documents are a gap too; trailing documents not cached are no gap.
    gapped = (DocSpan(0, 5, 20), DocSpan(1, 22, 30))
    assert plan_reuse(gapped, 0, 45, lambda s: True, fill_gaps=True).gaps == ((20, 22),)
    tail_new = plan_reuse(SPANS, 0, 45, lambda s: s.index == 0, fill_gaps=True)
    assert tail_new.end == 20 and tail_new.gaps == ()
    # A gap reaching the limit ends the plan before it; nothing cached: no plan.
    assert plan_reuse(SPANS, 0, 30, lambda s: s.index != 1, fill_gaps=True).end == 20
    assert plan_reuse(SPANS, 0, 45, lambda s: False, fill_gaps=True) is None


def test_gap_tokens_are_extended_in_the_permuted_row_with_the_recomputed_ones():
    plan = plan_reuse(SPANS, 0, 45, lambda s: s.index != 1, fill_gaps=True)
    row = row_order(plan)  # concat: only the gap is extended
    assert row.positions == tuple(range(0, 20)) + tuple(range(31, 40)) + tuple(range(20, 31))
    lego = with_recompute(plan, SPANS, Recompute("lego", tokens=2))
    assert lego.recompute == (31, 32) and lego.prefix_tokens == 29 - 2
    assert lego.extended_positions() == list(range(20, 33))
    assert row_order(lego).positions == tuple(range(0, 20)) + tuple(range(33, 40)) + tuple(range(20, 33))
    blend = with_recompute(plan, SPANS, Recompute("blend", ratio=0.5))
    assert blend.recompute_count == 4 and blend.prefix_tokens == 25  # half of the 9 re-placed (rounded)
    # Recomputing every re-placed token leaves the exact part to reuse; with no exact part, no plan.
    assert with_recompute(plan, SPANS, Recompute("blend", ratio=1.0)).prefix_tokens == 20
    four = (*SPANS, DocSpan(3, 40, 44))  # exact prefix through document 0; 1 reused, 2 new, 3 reused
    behind = plan_reuse(four, 20, 45, lambda s: s.index != 2, fill_gaps=True)
    assert behind.gaps == ((31, 40),) and behind.rotated_positions() == [*range(20, 31), *range(40, 44)]
    assert with_recompute(behind, four, Recompute("blend", ratio=1.0)) is None


def test_plan_never_reaches_the_limit_sglang_computes_from():
    assert _plan(SPANS, 0, limit=25).end == 25
    assert _plan(SPANS, 0, limit=3).end == 3  # only leading tokens (exact) before the limit
    assert _plan(SPANS, 0, limit=3).exact_end == 3
    assert _plan(SPANS, 40, limit=45) is None  # the exact prefix already covers every document


# ---------------------------------------------------------------------------- recompute
SERVER = Recompute("blend", tokens=4, ratio=0.25)


def test_request_recompute_defaults_to_the_server_and_takes_overrides():
    assert request_recompute({}, SERVER) == SERVER
    assert request_recompute({"pcr_doc_reuse": "off"}, SERVER) is None
    assert request_recompute({"pcr_doc_reuse": "lego", "pcr_doc_recompute_tokens": 9}, SERVER) == Recompute(
        "lego", 9, 0.25
    )
    assert request_recompute({"pcr_doc_recompute_ratio": 1}, SERVER) == Recompute("blend", 4, 1.0)
    assert request_recompute({}, Recompute("concat")) == Recompute("concat")


@pytest.mark.parametrize(
    "params, message",
    [
        ({"pcr_doc_recompute_tokens": -1}, "integer >= 0"),
        ({"pcr_doc_recompute_tokens": 2.5}, "integer >= 0"),
        ({"pcr_doc_recompute_tokens": True}, "integer >= 0"),
        ({"pcr_doc_recompute_ratio": 1.5}, r"in \[0, 1\]"),
        ({"pcr_doc_recompute_ratio": "0.1"}, r"in \[0, 1\]"),
        ({"pcr_doc_reuse": "mosaic"}, "must be one of"),
    ],
)
def test_bad_recompute_parameters_are_refused(params, message):
    with pytest.raises(DocBoundsError, match=message):
        request_recompute(params, SERVER)


def test_recompute_modes_need_a_recompute_server():
    for server in (Recompute("concat"), Recompute("off")):
        with pytest.raises(DocBoundsError, match="start it with --pcr-doc-reuse lego or blend"):
            request_recompute({"pcr_doc_reuse": "lego"}, server)
    assert request_recompute({"pcr_doc_reuse": "concat"}, SERVER).mode == "concat"


def test_lego_recomputes_the_first_tokens_of_each_re_placed_document():
    plan = _plan(SPANS, exact_len=0, limit=45)  # document 0 at delta 0, 1 at [20, 31), 2 at [31, 40)
    lego = with_recompute(plan, SPANS, Recompute("lego", tokens=4))
    assert lego.recompute == (20, 21, 22, 23, 31, 32, 33, 34)  # never document 0 (exact)
    assert lego.recompute_count == 8 and lego.prefix_tokens == 40 - 8
    short = with_recompute(plan, SPANS, Recompute("lego", tokens=100))
    assert short.recompute == tuple(range(20, 40))  # a whole document at most
    assert with_recompute(plan, SPANS, Recompute("lego", tokens=0)) == plan
    assert with_recompute(plan, SPANS, Recompute("concat", tokens=4)) == plan
    # The exact prefix covers document 1's first 4 tokens: the rest of its first 6 are recomputed.
    inside = with_recompute(_plan(SPANS, exact_len=24, limit=45), SPANS, Recompute("lego", tokens=6))
    assert inside.recompute == (24, 25, 31, 32, 33, 34, 35, 36)


def test_blend_anchors_fill_its_budget_in_document_order_and_never_grow_it():
    plan = _plan(SPANS, exact_len=0, limit=45)  # re-placed: document 1 at [20, 31), 2 at [31, 40)
    hybrid = with_recompute(plan, SPANS, Recompute("blend", ratio=0.5, anchor_tokens=3))
    assert hybrid.recompute_count == 10 and hybrid.recompute == ()  # the rest is picked at admission
    assert hybrid.anchors == (20, 21, 22, 31, 32, 33)
    tight = with_recompute(plan, SPANS, Recompute("blend", ratio=0.25, anchor_tokens=4))
    assert tight.recompute_count == 5 and tight.anchors == (20, 21, 22, 23, 31)
    assert with_recompute(plan, SPANS, Recompute("blend", ratio=0.25)).anchors == ()
    assert request_recompute({"pcr_doc_anchor_tokens": 7}, SERVER) == Recompute("blend", 4, 0.25, 7)
    with pytest.raises(DocBoundsError, match="pcr_doc_anchor_tokens must be an integer >= 0"):
        request_recompute({"pcr_doc_anchor_tokens": -2}, SERVER)
    asked = request_recompute({"pcr_doc_selector": "query"}, SERVER)
    assert asked.selector == "query" and with_recompute(plan, SPANS, asked).selector == "query"
    assert request_recompute({}, SERVER).selector == "gradual"
    with pytest.raises(
        DocBoundsError, match="pcr_doc_selector must be one of 'deviation', 'gradual', 'query', 'prophet'"
    ):
        request_recompute({"pcr_doc_selector": "oracle"}, SERVER)
    ended = request_recompute({"pcr_doc_selector": "query", "pcr_doc_question_end": 42}, SERVER)
    assert with_recompute(plan, SPANS, ended).question_end == 42
    with pytest.raises(DocBoundsError, match="pcr_doc_question_end must be a positive token offset"):
        request_recompute({"pcr_doc_question_end": "42"}, SERVER)


def test_blend_counts_its_share_of_re_placed_tokens_and_chooses_at_admission():
    plan = _plan(SPANS, exact_len=0, limit=45)
    blend = with_recompute(plan, SPANS, Recompute("blend", ratio=0.25))
    assert blend.recompute_count == 5 and blend.recompute == ()  # 25% of the 20 re-placed tokens
    assert blend.prefix_tokens == 35
    assert plan.rotated_positions() == list(range(20, 40))
    # Recomputing everything re-placed leaves the exact part to reuse.
    everything = with_recompute(plan, SPANS, Recompute("blend", ratio=1.0))
    assert everything.prefix_tokens == 20
    # Nothing left to reuse at all: no plan (a plain prefill).
    only_rotated = _plan(SPANS, exact_len=20, limit=45)
    assert with_recompute(only_rotated, SPANS, Recompute("blend", ratio=1.0)) is None


def test_row_order_moves_the_recomputed_tokens_behind_the_kept_ones():
    plan = with_recompute(_plan(SPANS, 0, 45), SPANS, Recompute("lego", tokens=2))
    row = row_order(plan)
    assert plan.recompute == (20, 21, 31, 32)
    assert row.start == 0 and row.end == 40
    assert row.positions == tuple(range(0, 20)) + tuple(range(22, 31)) + tuple(range(33, 40)) + (20, 21, 31, 32)
    # Slots past the permuted part hold their own positions; a later extend chunk is plain.
    assert row.positions_of_slots(34, 44) == [38, 39, 20, 21, 31, 32, 40, 41, 42, 43]
    assert row.permutes(36, 44) and not row.permutes(40, 44)
    assert sorted(row.positions_of_slots(0, 40)) == list(range(40))
    assert row_order(replace(plan, recompute_count=0, recompute=())) is None
