"""The position mask's budget at admission (issue 42), through the plugin's hook around
SGLang's ``PrefillAdder.add_one_req``: per batch being formed, a request that could take
the forward's mask past ``--pcr-position-mask-mb`` beside a permuted row waits in the queue
and ends the pass (nothing behind it goes first), counted in ``mask_batch_held``; the continuing chunked
request counts; a batch's first request, and any request without the budget (no permuted
rows), goes through. On stand-in adders, then once on SGLang's own adder."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest

from pcr_sglang import plugin
from pcr_sglang.reuse.doc_stats import DocReuseStats
from pcr_sglang.reuse.plan import CopySegment, ReusePlan, RowOrder
from pcr_sglang.sglang_adapter.admission import AddAttempt
from pcr_sglang.sglang_adapter.mask_admission import MaskAdmission

# Tokens 4..7 re-placed, two of them recomputed: a permuted row once placed.
PLAN = ReusePlan((CopySegment(0, 4, 8, 4),), 4, 8, 4, recompute_count=2)
ROW = RowOrder(4, (6, 7, 4, 5))
CONTINUE = "continue"
OTHER = plugin._batch_full()


class Docs:
    """Document reuse through its seam, as the accounting asks it."""

    def __init__(self, mask_bytes, plans=None, rows=None, marked=()):
        self.mask_bytes = mask_bytes
        self.plans = plans or {}
        self.rows = rows or {}
        self.marked = set(marked)  # requests that mark documents

    def canonical_chain_keys(self, req):
        return [[b"doc"]] if req.rid in self.marked else []

    def planned(self, rid):
        return self.plans.get(rid)

    def row(self, rid):
        return self.rows.get(rid)


class Adder:
    """SGLang's ``PrefillAdder`` as the hook reads it (weakly referenceable, like it)."""

    def __init__(self, cache, committed=(), chunk=None):
        self.tree_cache = cache
        self.can_run_list = list(committed)
        self.rem_chunk_tokens = chunk

    def budget_state(self):
        return CONTINUE


def add_one_req(adder, req, *args, **kwargs):
    """SGLang's ``add_one_req``, admitting the request's extend (a chunk of it, at most the
    chunk budget left, under chunked prefill)."""
    total = len(req.full_untruncated_fill_ids)
    chunk = adder.rem_chunk_tokens
    req.extend_end = total if chunk is None else min(total, req.prefix_len + chunk)
    adder.can_run_list.append(req)
    return CONTINUE


def _req(rid, tokens, prefix=0, extend_end=None):
    ids = list(range(tokens))
    return SimpleNamespace(
        rid=rid,
        prefix_len=prefix,
        extend_end=extend_end,
        full_untruncated_fill_ids=ids,
        origin_input_ids=ids,
        output_ids=[],
    )


def _cache(docs):
    from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

    masks = MaskAdmission()
    masks.docs, masks.stats = docs, DocReuseStats()
    cache = PCRPrefixCache.__new__(PCRPrefixCache)
    admission = SimpleNamespace(
        admit_now=lambda req: True, adding=lambda others_in_flight: nullcontext(AddAttempt(others_in_flight))
    )
    cache.scheduler = SimpleNamespace(admission=admission, batch_masks=masks)
    return cache, masks.stats


def _pass(cache, reqs, committed=(), chunk=None):
    """One scheduling pass: the adder's loop over the waiting requests; the rids admitted."""
    adder = Adder(cache, committed, chunk)
    for req in reqs:
        if plugin._add_one_req(add_one_req, adder, req) != CONTINUE:
            break  # SGLang's loop over the waiting queue ends there
    return [r.rid for r in adder.can_run_list]


def test_beside_a_permuted_row_a_request_that_could_exceed_the_budget_waits_for_a_later_batch():
    docs = Docs(2000, plans={"perm": PLAN, "perm2": PLAN}, rows={"perm": ROW})
    cache, stats = _cache(docs)
    perm, big, small = _req("perm", 40), _req("big", 30), _req("small", 10)
    # perm's part: 40 x 40 = 1600; big could add 900 (over 2000): the pass ends at big, and
    # small, behind it in the queue, does not go first (big cannot starve).
    assert _pass(cache, [perm, big, small]) == ["perm"]
    assert stats.mask_batch_held == 1
    # Next pass: big is the batch's first; perm2 may get a permuted row and could add 1600.
    assert _pass(cache, [big, _req("perm2", 40), _req("tiny", 5)]) == ["big"]
    assert stats.mask_batch_held == 2
    assert _pass(cache, [_req("perm2", 40), _req("tiny", 5)]) == ["perm2", "tiny"]


def test_plain_requests_are_never_held_for_a_mask_no_forward_builds():
    cache, stats = _cache(Docs(100, plans={}, rows={}))
    assert _pass(cache, [_req(f"r{i}", 50) for i in range(4)]) == ["r0", "r1", "r2", "r3"]
    assert stats.mask_batch_held == 0


def test_a_batchs_first_request_goes_through_whatever_its_bound():
    cache, stats = _cache(Docs(100, plans={"perm": PLAN}, rows={"perm": ROW}))
    assert _pass(cache, [_req("perm", 40)]) == ["perm"] and stats.mask_batch_held == 0


def test_the_continuing_chunked_request_counts_toward_its_batchs_mask():
    """``add_chunked_req`` put it in the batch before any ``add_one_req``: a candidate is
    not the batch's first, and the chunk's permuted row makes the batch's mask."""
    chunked = _req("chunked", 60, prefix=20, extend_end=40)  # 20 x 40 = 800
    cache, stats = _cache(Docs(1000, rows={"chunked": RowOrder(30, (35, 30))}))
    assert _pass(cache, [_req("next", 20)], committed=[chunked]) == ["chunked"]  # 800 + 400 > 1000
    assert stats.mask_batch_held == 1
    cache, stats = _cache(Docs(1000, rows={"chunked": RowOrder(45, (50, 45))}))  # not permuted in [20, 40)
    assert _pass(cache, [_req("next", 20)], committed=[chunked]) == ["chunked", "next"]


def test_the_chunk_budget_left_bounds_a_candidates_part():
    """Beside perm's 1600 bytes, big's whole extend could add 30 x 30 (over 2000); with 10
    chunk tokens left, at most 10 queries over its 30 keys."""
    cache, _ = _cache(Docs(2000, rows={"perm": ROW}))
    assert _pass(cache, [_req("big", 30)], committed=[_req("perm", 40, extend_end=40)]) == ["perm"]
    assert _pass(cache, [_req("big", 30)], committed=[_req("perm", 40, extend_end=40)], chunk=10) == ["perm", "big"]


def test_without_a_budget_nobody_is_held():
    cache, stats = _cache(Docs(None, plans={"perm": PLAN}, rows={"perm": ROW}))
    assert _pass(cache, [_req("perm", 400), _req("big", 400)]) == ["perm", "big"]
    assert stats.mask_batch_held == 0


def test_a_plan_whose_own_mask_placement_refuses_does_not_count_as_permuting():
    """Placement recomputes such a request (``mask_over_budget``): its row stays in order,
    so beside plain requests it is not held for a mask no forward builds."""
    cache, stats = _cache(Docs(1000, plans={"huge": PLAN}))
    assert _pass(cache, [_req("plain", 20), _req("huge", 40)]) == ["plain", "huge"]  # own bound 34 x 40 > 1000
    assert stats.mask_batch_held == 0


def _unmatched(rid, tokens):
    """A waiting request as SGLang's priority preemption sees it: not matched this pass yet
    (no fill ids, no prefix, no plan)."""
    req = _req(rid, tokens)
    req.full_untruncated_fill_ids = []
    return req


def test_a_request_held_for_its_batchs_mask_preempts_nobody():
    """Priority preemption asks before SGLang matches the request: its whole input bounds
    its part, and marking documents counts as a permuted row to come."""
    cache, stats = _cache(Docs(2000, plans={"perm": PLAN}, rows={"perm": ROW}, marked={"docs"}))
    adder = Adder(cache)
    plugin._add_one_req(add_one_req, adder, _req("perm", 40))
    preempted = []
    original = lambda adder, req: preempted.append(req.rid) or True  # noqa: E731
    assert plugin._preempt_to_schedule(original, adder, _unmatched("big", 30)) is False  # 1600 + 900
    assert plugin._preempt_to_schedule(original, adder, _unmatched("small", 10)) is True
    assert preempted == ["small"] and stats.mask_batch_held == 0  # counted where it waits, not here
    # In a batch with no permuted row yet, a request marking documents may bring one.
    cache, _ = _cache(Docs(1000, marked={"docs"}))
    adder = Adder(cache)
    plugin._add_one_req(add_one_req, adder, _req("plain", 20))
    assert plugin._preempt_to_schedule(original, adder, _unmatched("docs", 30)) is False  # 400 + 900
    assert plugin._preempt_to_schedule(original, adder, _unmatched("other", 30)) is True


def test_sglangs_own_adder_keeps_the_held_request_out_and_admits_the_next():
    """The same through SGLang's ``PrefillAdder.add_one_req`` over PCR's cache, with real
    ``Req``s: the held request returns OTHER (the scheduler's loop over the queue ends) and
    holds no slot or lock; the next pass admits it first."""
    pytest.importorskip("sglang")
    from array import array

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_params import SamplingParams

    from tests.unit.adapter_harness import Harness

    def real_req(rid, tokens):
        params = SamplingParams(max_new_tokens=4, temperature=0)
        params.normalize(None)
        return Req(rid, "", array("q", tokens), params)

    override = get_context().override_server_args()
    override.install()
    h = Harness(host_slots=32, pool=128)
    try:
        stats = h.scheduler.batch_masks.stats = DocReuseStats()
        # Only the accounting sees the stand-in: admission serves the requests plainly.
        h.scheduler.batch_masks.docs = Docs(800, plans={"b": PLAN}, rows={"a": ROW})
        original = getattr(PrefillAdder.add_one_req, "__wrapped__", PrefillAdder.add_one_req)
        adder = PrefillAdder(1, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 10_000, None)
        waiting = [real_req("a", list(range(100, 121))), real_req("b", list(range(200, 221))), real_req("c", [1] * 5)]
        results = {}
        for req in waiting:  # SGLang's loop over the waiting queue
            req.init_next_round_input(h.cache)
            free = h.allocator.available_size()
            results[req.rid] = plugin._add_one_req(
                original, adder, req, has_chunked_req=False, truncation_align_size=None
            )
            if results[req.rid] != AddReqResult.CONTINUE:
                break
        # b: 21 x 21 beside a's 441 bytes, over 800: the pass ends there, b holding nothing.
        assert results == {"a": AddReqResult.CONTINUE, "b": AddReqResult.OTHER}
        assert h.allocator.available_size() == free and waiting[1].extend_end is None
        assert [r.rid for r in adder.can_run_list] == ["a"] and stats.mask_batch_held == 1
        for req in adder.can_run_list:
            h.cache.unlock(req.lock)
        h.check()
    finally:
        h.close()
        override.restore()


def _record_attempts(cache) -> list[AddAttempt]:
    """Admission's ``adding`` on the stand-in cache, keeping each call's attempt."""
    attempts: list[AddAttempt] = []

    @contextmanager
    def adding(others_in_flight):
        attempts.append(AddAttempt(others_in_flight))
        yield attempts[-1]

    cache.scheduler.admission.adding = adding
    return attempts


def test_admission_is_told_whether_others_are_in_the_batch_or_running():
    """A request's documents may wait for device room only beside others that will free
    some (``Admission.adding``): the batch's committed requests or the running batch."""
    cache, _ = _cache(Docs(None))
    attempts = _record_attempts(cache)
    _pass(cache, [_req("first", 8), _req("second", 8)])
    running = Adder(cache)
    running.running_batch = SimpleNamespace(is_empty=lambda: False)
    plugin._add_one_req(add_one_req, running, _req("beside-running", 8))
    assert [a.others_in_flight for a in attempts] == [False, True, True]


def test_a_request_waiting_for_device_room_lets_the_adder_go_on_to_the_next():
    """SGLang ends its pass on the OTHER a load's retry gives; the hook turns it into the
    adder's own verdict, so the requests behind one waiting for room are still considered."""
    cache, _ = _cache(Docs(None))
    attempts = _record_attempts(cache)

    def add_or_retry(adder, req, *args, **kwargs):
        """``add_one_req``, whose load (``init_load_back``) asks to retry one request."""
        if req.rid == "waits-for-room":
            attempts[-1].deferred = True
            return OTHER
        return add_one_req(adder, req)

    adder = Adder(cache, committed=[_req("running", 8)])
    admitted = []
    for req in [_req("waits-for-room", 8), _req("next", 8)]:
        admitted.append(plugin._add_one_req(add_or_retry, adder, req))
    assert admitted == [CONTINUE, CONTINUE]
    assert [r.rid for r in adder.can_run_list] == ["running", "next"]
