"""Document bounds and the reuse plan (pcr_sglang.core.doc_reuse): pure logic, no server."""

from __future__ import annotations

import pytest

from pcr_sglang.core.doc_reuse import (
    CopySegment,
    DocBoundsError,
    DocSpan,
    canonical_tokens,
    parse_doc_bounds,
    plan_reuse,
)


@pytest.mark.parametrize("raw, message", [
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
])
def test_bad_bounds_are_refused_naming_the_problem(raw, message):
    with pytest.raises(DocBoundsError, match=message):
        parse_doc_bounds(raw, 20)


def test_bounds_parse_to_spans():
    assert parse_doc_bounds([2, 5, 5, 9, 12, 20], 20) == (DocSpan(0, 2, 5), DocSpan(1, 5, 9), DocSpan(2, 12, 20))


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


def test_plan_never_reaches_the_limit_sglang_computes_from():
    assert _plan(SPANS, 0, limit=25).end == 25
    assert _plan(SPANS, 0, limit=3).end == 3  # only leading tokens (exact) before the limit
    assert _plan(SPANS, 0, limit=3).exact_end == 3
    assert _plan(SPANS, 40, limit=45) is None  # the exact prefix already covers every document
