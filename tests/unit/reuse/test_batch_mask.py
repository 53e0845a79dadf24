"""The position mask of a batch being formed (issue 42): a request waits for a later batch
when, beside a permuted row (its own or a batch-mate's), it could take the forward's whole
mask past ``--pcr-position-mask-mb``; a batch's first request never waits for it, and a
batch with no permuted row is never held. The bound holds for any chunking of the extend."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from pcr_sglang.reuse.batch_mask import (
    BatchMask,
    MaskCandidate,
    extend_bound,
    needs_position_mask,
    own_mask_bound,
)
from pcr_sglang.reuse.plan import CopySegment, ReusePlan
from pcr_sglang.reuse.rows import position_mask_bytes, row_mask_bound

PERMUTED = ReusePlan((CopySegment(0, 4, 8, 4),), 4, 8, 4, recompute_count=2)
GAPPED = ReusePlan((CopySegment(0, 4, 8, 0), CopySegment(1, 12, 16, 0)), 4, 16, 8, gaps=((8, 12),))
IN_ORDER = ReusePlan((CopySegment(0, 4, 8, 0),), 4, 8, 8)


def _batch(budget=1000, *parts):
    batch = BatchMask(budget)
    for prefix, end, permuted in parts:
        batch.add(prefix, end, permuted)
    return batch


def test_a_batchs_first_request_is_never_held_whatever_its_bound():
    assert not _batch(10).holds(MaskCandidate(bound=10**9, may_permute=True))


def test_beside_a_permuted_row_a_request_waits_once_the_whole_mask_could_exceed_the_budget():
    batch = _batch(1000, (0, 20, True))  # 20 x 20 bytes, permuted
    assert batch.bytes == 400 and batch.permuted and batch.counted == 1
    assert not batch.holds(MaskCandidate(bound=600, may_permute=False))  # exactly the budget: fits
    assert batch.holds(MaskCandidate(bound=601, may_permute=False))  # a plain request beside it


def test_a_request_that_may_permute_its_own_row_waits_beside_plain_ones_over_the_budget():
    batch = _batch(1000, (0, 20, False), (10, 20, False))  # 400 + 200 bytes, no permuted row
    assert batch.bytes == 600 and not batch.permuted
    assert batch.holds(MaskCandidate(bound=401, may_permute=True))
    assert not batch.holds(MaskCandidate(bound=400, may_permute=True))


def test_a_batch_without_permuted_rows_builds_no_mask_and_holds_nobody():
    batch = _batch(10, (0, 100, False))
    assert not batch.holds(MaskCandidate(bound=10**6, may_permute=False))


def test_what_needs_a_mask_is_what_placement_checks():
    assert needs_position_mask(PERMUTED) and needs_position_mask(GAPPED) and not needs_position_mask(IN_ORDER)
    req = SimpleNamespace(origin_input_ids=list(range(30)), output_ids=[1, 2])
    assert own_mask_bound(req, PERMUTED) == row_mask_bound(4 + PERMUTED.prefix_tokens, 32)


@pytest.mark.parametrize("seed", range(20))
def test_the_candidates_bound_holds_for_any_extend_the_adder_can_give_it(seed):
    """The adder gives a request an extend of at most its chunk budget, past a prefix at
    least the one it was matched with (a host hit or reused documents only add to it)."""
    rng = random.Random(seed)
    total = rng.randrange(2, 500)
    prefix = rng.randrange(0, total)
    chunk = rng.choice([None, rng.randrange(1, 600)])
    bound = extend_bound(prefix, total, chunk)
    for _ in range(20):
        start = rng.randrange(prefix, total)
        most = total - start if chunk is None else min(total - start, chunk)
        extend = rng.randrange(1, most + 1)
        assert position_mask_bytes([start], [extend]) <= bound, (prefix, total, chunk, start, extend)
    assert extend_bound(prefix, total, 0) == 0  # no chunk budget left: no extend
