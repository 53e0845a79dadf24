"""SGLang's own scheduling policies and prefill adder over PCR's cache, with real ``Req``s.

Cache-aware policies match every waiting request in every pass (up to 128): those
matches must not move KV. The adder then admits requests one by one, each matched again
just before, and loads host hits through ``init_load_back``."""

from __future__ import annotations

from array import array

import pytest

pytest.importorskip("sglang")

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from tests.unit.adapter_harness import CHUNK, Harness  # noqa: E402

POLICIES = ["fcfs", "lpm", "dfs-weight", "hrrn", "shortest-prefill-first", "lof", "random", "routing-key"]


@pytest.fixture
def runtime():
    """SGLang's runtime context, as a scheduler process has it (restored afterwards)."""
    override = get_context().override_server_args()
    override.install()
    yield
    override.restore()


@pytest.fixture
def harness(runtime):
    h = Harness(host_slots=32, pool=128)
    yield h
    h.close()


def real_req(rid: str, tokens: list[int]) -> Req:
    params = SamplingParams(max_new_tokens=4, temperature=0)
    params.normalize(None)
    return Req(rid, "", array("q", tokens), params)


def docs_in_host_memory(h: Harness) -> tuple[list[int], list[int]]:
    """Two cached chains, then pushed off the device into host memory."""
    a, b = list(range(100, 100 + 3 * CHUNK)), list(range(500, 500 + 2 * CHUNK))
    h.serve(a, "a")
    h.serve(b, "b")
    h.cache.evict(EvictParams(num_tokens=10**6))
    assert h.cache.total_size() == 0 and h.state.tree.host_chunks == 5
    return a, b


@pytest.mark.parametrize("priority", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_without_moving_kv_and_admits_with_one_load_per_chain(harness, policy, priority):
    """Three scheduling passes (the cache-aware policies match every waiting request in
    each), then the adder's loop as SGLang runs it: each request matched again, then
    admitted; a host-only chain is loaded once, by the first request that needs it."""
    h = harness
    a, b = docs_in_host_memory(h)
    waiting = [real_req(f"r{i}", (a if i % 2 else b) + [1000 + i]) for i in range(6)]
    for i, req in enumerate(waiting):
        req.priority = i % 3
    free, counters = h.allocator.available_size(), dict(vars(h.state.stats))
    schedule = SchedulePolicy(
        policy,
        h.cache,
        enable_hierarchical_cache=False,
        enable_priority_scheduling=priority,
        schedule_low_priority_values_first=False,
    )
    for _ in range(3):
        schedule.calc_priority(waiting, None)
    assert sorted(r.rid for r in waiting) == [f"r{i}" for i in range(6)]
    assert h.allocator.available_size() == free and vars(h.state.stats) == counters
    assert h.scheduler.engine.pending_loads == 0
    if policy in ("lpm", "dfs-weight", "hrrn", "shortest-prefill-first"):
        assert {r.host_hit_length for r in waiting} == {len(a), len(b)}  # they see the host hits
    if policy == "lpm":
        assert [r.num_matched_prefix_tokens for r in waiting] == [12, 12, 12, 8, 8, 8]
    adder = PrefillAdder(1, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 10_000, None)
    for req in waiting:
        req.init_next_round_input(h.cache)
        assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
    assert len(adder.can_run_list) == 6
    assert free - h.allocator.available_size() == len(a) + len(b)  # each chain loaded once
    for req in waiting:
        doc = a if len(req.origin_input_ids) == len(a) + 1 else b
        assert req.prefix_len == len(doc)
        h.assert_kv(doc, h.cache.prefix_device_indices(req))
        h.cache.unlock(req.lock)
    h.check()


def test_dfs_weight_orders_the_queue_by_pcrs_tree(harness):
    """dfs-weight walks the tree from ``root_node`` through ``children`` to the requests'
    matched nodes: PCR's chunk tree has that shape, so requests sharing a chain come out
    next to each other, the heavier chain first."""
    h = harness
    a, b = list(range(100, 100 + 3 * CHUNK)), list(range(500, 500 + 2 * CHUNK))
    h.serve(a, "a")
    h.serve(b, "b")
    waiting = [real_req(f"r{i}", (a if i % 3 else b) + [1000 + i]) for i in range(6)]
    schedule = SchedulePolicy("dfs-weight", h.cache, False, False, False)
    schedule.calc_priority(waiting, None)
    assert [len(r.origin_input_ids) for r in waiting] == [13] * 4 + [9] * 2
    h.check()


def test_the_adder_loads_each_host_hit_once_and_leaks_nothing(harness):
    """Three requests matched in one pass (before any was admitted) share a chain that
    only host memory holds: the first admission loads it, the next find it on the device."""
    h = harness
    a, _ = docs_in_host_memory(h)
    waiting = [real_req(f"r{i}", a + [1000 + i]) for i in range(3)]
    for req in waiting:
        req.init_next_round_input(h.cache)  # all matched with the chain in host memory
    free = h.allocator.available_size()
    adder = PrefillAdder(1, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 10_000, None)
    for req in waiting:
        assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
        assert req.prefix_len == 12 and req.host_loaded_length == 12
    assert len(adder.can_run_list) == 3
    assert free - h.allocator.available_size() == 12  # one copy of the chain, not three
    assert h.state.stats.bytes_host_to_device == 3 * h.state.config.chunk_bytes
    for req in waiting:
        h.assert_kv(a, h.cache.prefix_device_indices(req))
        h.cache.unlock(req.lock)
    h.check()


def test_a_rejected_candidate_moves_no_kv_and_holds_no_slot(harness):
    """The adder's budget turns the request away before init_load_back: nothing moved."""
    h = harness
    a, _ = docs_in_host_memory(h)
    req = real_req("big", a + [7])
    req.init_next_round_input(h.cache)
    hog = h.allocator.alloc(h.allocator.available_size() - 4)  # the pool is nearly full
    free = h.allocator.available_size()
    adder = PrefillAdder(1, h.cache, h.allocator, ScheduleBatch(reqs=[]), 0.5, 10_000, None)
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == AddReqResult.NO_TOKEN
    assert h.allocator.available_size() == free and h.cache.total_size() == 0
    assert h.state.stats.bytes_host_to_device == 0 and h.state.tree.locked_chunks == 0
    h.allocator.free(hog)
    h.check()


def test_a_request_waiting_for_its_reads_preempts_nobody():
    """With priority preemption SGLang retracts running requests before it tries to add
    the candidate: not for a candidate PCR will hold back for its SSD reads."""
    from types import SimpleNamespace

    from pcr_sglang import plugin
    from pcr_sglang.sglang_adapter.mask_admission import MaskAdmission
    from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

    calls = []
    cache = PCRPrefixCache.__new__(PCRPrefixCache)
    cache.scheduler = SimpleNamespace(
        admission=SimpleNamespace(admit_now=lambda req: req.rid != "held"), batch_masks=MaskAdmission()
    )
    adder = SimpleNamespace(tree_cache=cache)
    original = lambda adder, req: calls.append(req.rid) or True  # noqa: E731
    assert plugin._preempt_to_schedule(original, adder, SimpleNamespace(rid="held")) is False
    assert plugin._preempt_to_schedule(original, adder, SimpleNamespace(rid="ready")) is True
    assert calls == ["ready"]
