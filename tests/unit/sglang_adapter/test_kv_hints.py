"""KV hints: the book (TTL, rate, groups, consumption), the payload's checks, and the
prefetch plan reading hinted chains after the waiting queue's, within the hint budget."""

from __future__ import annotations

import pytest

from pcr_sglang.core import Effects
from pcr_sglang.core.hints import Hint, HintBook, HintError, HintLimits, HintPayload, hint_payload
from pcr_sglang.core.orders import ReadChunk, Reorder
from tests.unit.core.test_cache_state import Driver
from tests.unit.core.test_chunk_tree import CHUNK, keys


def test_a_hint_lives_until_its_ttl_capped_by_the_server():
    book = HintBook(HintLimits(max_ttl_s=10))
    assert book.register("a", ["k1", "k2"], HintPayload(ttl_s=60), now=0.0)
    assert book.register("b", ["k3"], HintPayload(ttl_s=5), now=0.0)
    assert [h.hint_id for h in book.expire(6.0)] == ["b"]
    assert len(book) == 1
    assert [h.hint_id for h in book.expire(10.0)] == ["a"]  # 60 s asked, 10 s allowed
    assert book.stats.expired == 2


def test_registrations_over_the_rate_are_dropped_and_the_bucket_refills():
    book = HintBook(HintLimits(rate_per_s=2, burst=3))
    assert [book.register(str(i), ["k"], HintPayload(), now=0.0) for i in range(5)] == [True] * 3 + [False] * 2
    assert book.stats.rate_limited == 2
    assert book.register("later", ["k"], HintPayload(), now=1.0)  # two tokens back after a second


def test_the_newest_group_comes_first_and_its_candidates_by_rank():
    book = HintBook()
    book.register("old", ["o"], HintPayload(group="g1"), now=0.0)
    book.register("c1", ["x1"], HintPayload(group="g2", rank=1), now=1.0)
    book.register("c0", ["x0"], HintPayload(group="g2", rank=0), now=1.0)
    assert [h.hint_id for h in book.live()] == ["c0", "c1", "old"]


def test_a_request_covering_a_hint_consumes_it_and_its_group_but_a_shared_prefix_does_not():
    book = HintBook()
    book.register("c0", ["sys", "d1", "q"], HintPayload(group="g"), now=0.0)
    book.register("c1", ["sys", "d2", "q2"], HintPayload(group="g"), now=0.0)
    book.register("other", ["sys", "d9"], HintPayload(), now=0.0)
    assert book.consume(["sys", "zz"]) == []  # the system prompt alone covers no hint
    gone = book.consume(["sys", "d1", "q", "more"])
    assert {h.hint_id for h in gone} == {"c0", "c1"} and book.stats.consumed == 1
    assert [h.hint_id for h in book.live()] == ["other"]


def test_the_book_holds_at_most_max_live_hints():
    book = HintBook(HintLimits(max_live=2, burst=10))
    for i in range(3):
        book.register(str(i), [f"k{i}"], HintPayload(), now=0.0)
    assert [h.hint_id for h in book.live()] == ["2", "1"]


class _Action:
    def __init__(self, payload, action_type="pcr.lookahead_prefetch", version="1"):
        self.action_type, self.action_version, self.payload = action_type, version, payload


class _Envelope:
    def __init__(self, *actions):
        self.actions = list(actions)


@pytest.mark.parametrize(
    "payload, message",
    [
        ([1, 2], "payload must be an object"),
        ({"ttl_s": -1}, r"ttl_s must be a number of seconds in \(0, 3600\]"),
        ({"ttl_s": "10"}, "ttl_s must be a number"),
        ({"hint_only": "yes"}, "hint_only must be true or false"),
        ({"rank": 1.5}, "rank must be an integer"),
        ({"group": 7}, "group must be a string"),
        ({"promote": True}, "unknown fields"),
    ],
)
def test_a_malformed_hint_names_the_field(payload, message):
    with pytest.raises(HintError, match=message):
        hint_payload(_Envelope(_Action(payload)))


def test_other_actions_are_left_alone_and_versions_are_checked():
    assert hint_payload(_Envelope(_Action({}, action_type="someone.else"))) is None
    assert hint_payload(_Envelope(_Action({"ttl_s": 5, "group": "g"}))) == HintPayload(True, 5.0, "g", 0)
    with pytest.raises(HintError, match="action_version '2' is not supported"):
        hint_payload(_Envelope(_Action({}, version="2")))
    with pytest.raises(HintError, match="send one per request"):
        hint_payload(_Envelope(_Action({}), _Action({})))


# ------------------------------------------------------------------ the prefetch plan
def _ssd_only(d: Driver, tokens: list[int]) -> list:
    """Serve ``tokens``, write them to SSD, push them out of host memory: their chain."""
    d.serve(tokens)
    effects = Effects()
    d.state.evict_device(40, effects)
    d.run(effects)
    d.answer()
    return d.state.match(iter(keys(tokens)), touch=False).nodes


def _as_hint(nodes: list) -> Hint:
    """A live hint whose chain is ``nodes`` (the same hint at every step it is passed)."""
    return Hint(nodes[-1].key.hex(), [n.key for n in nodes], None, 0, float("inf"), seq=1)


def _pushed_out(d: Driver, chunks: int = 8) -> None:
    for start in range(0, chunks, 8):  # 8 chunks per sequence
        d.serve(list(range(10_000 + start * CHUNK, 10_000 + (start + 8) * CHUNK)))
        effects = Effects()
        d.state.evict_device(40, effects)
        d.run(effects)
        d.answer()


def test_hinted_chains_are_read_after_the_queue_and_within_the_hint_budget():
    # Room for 8 reads in host memory and in the prefetch budget: the hint budget binds.
    d = Driver(host_slots=16, ssd_capacity_chunks=60, prefetch_budget_chunks=8, hint_budget_chunks=2)
    queued = _ssd_only(d, list(range(2 * CHUNK)))
    hinted = _ssd_only(d, list(range(300, 300 + 3 * CHUNK)))
    _pushed_out(d, 24)
    assert not any(n.on_host or n.on_device for n in queued + hinted)
    plan = Effects()
    d.state.plan_prefetch([queued], [], plan, queue_depth=1, hinted=[_as_hint(hinted)])
    reads = [o for o in plan.orders if isinstance(o, ReadChunk)]
    assert [o.key for o in reads] == [n.key for n in queued] + [n.key for n in hinted[:2]]  # queue first
    assert d.state.ssd_stats.hint_issued == 2
    d.run(plan)
    d.answer()
    # Landed hinted chunks count in time when a request needs them.
    d.state.count_hinted(hinted)
    assert d.state.ssd_stats.hint_in_time == 2 and d.state.ssd_stats.hint_late == 0
    # In host memory before the request existed: host hits, not reads made for it.
    assert not any(d.state.landed(n) for n in hinted) and all(n.on_host for n in hinted[:2])


def test_a_hinted_chunk_landed_and_left_unused_counts_wasted_and_its_reads_are_cancelled():
    d = Driver(host_slots=16, ssd_capacity_chunks=60, prefetch_budget_chunks=6, hint_budget_chunks=4)
    hinted = _ssd_only(d, list(range(300, 300 + 3 * CHUNK)))
    _pushed_out(d, 24)
    plan = Effects()
    d.state.plan_prefetch([], [], plan, queue_depth=0, hinted=[_as_hint(hinted)])
    d.run(plan)
    d.answer(only=ReadChunk)
    # The hint ends (no hinted chain any more): its landed chunks were never used.
    plan = Effects()
    d.state.plan_prefetch([], [], plan, queue_depth=0, hinted=[])
    assert d.state.ssd_stats.hint_wasted == 3
    assert not [o for o in plan.orders if isinstance(o, Reorder)]  # nothing was still reading


def test_landed_hinted_chunks_count_against_the_hint_budget_and_never_take_the_queues():
    """Review finding: only hinted reads in flight were counted, so landed ones piled up
    over steps until they filled the host room the queue's prefetch needs."""
    d = Driver(host_slots=16, ssd_capacity_chunks=80, prefetch_budget_chunks=8, hint_budget_chunks=2)
    hinted = _ssd_only(d, list(range(300, 300 + 6 * CHUNK)))
    queued = _ssd_only(d, list(range(600, 600 + 3 * CHUNK)))
    _pushed_out(d, 24)
    for _ in range(4):  # several steps; each lands what it ordered
        plan = Effects()
        d.state.plan_prefetch([], [], plan, queue_depth=0, hinted=[_as_hint(hinted)])
        d.run(plan)
        d.answer(only=ReadChunk)
    assert d.state.ssd_stats.hint_issued == 2  # the budget holds landed chunks too
    plan = Effects()
    d.state.plan_prefetch([queued], [], plan, queue_depth=1, hinted=[_as_hint(hinted)])
    assert [o.key for o in plan.orders if isinstance(o, ReadChunk)] == [n.key for n in queued]
    assert d.state.ssd_stats.prefetch_issued == 3  # the queue's own, hints not counted there


def test_hinted_reads_in_flight_count_late_and_are_cancelled_when_the_hint_ends():
    d = Driver(host_slots=16, ssd_capacity_chunks=60, prefetch_budget_chunks=6, hint_budget_chunks=4)
    hinted = _ssd_only(d, list(range(300, 300 + 3 * CHUNK)))
    _pushed_out(d, 24)
    plan = Effects()
    d.state.plan_prefetch([], [], plan, queue_depth=0, hinted=[_as_hint(hinted)])
    d.run(plan)  # ordered, not answered: in flight
    d.state.count_hinted(hinted[:1])
    assert d.state.ssd_stats.hint_late == 1
    plan = Effects()
    d.state.plan_prefetch([], [], plan, queue_depth=0, hinted=[])
    assert len([o for o in plan.orders if isinstance(o, Reorder) and o.cancel]) == 3


def test_a_hint_promotes_nothing_the_queue_prefetch_read_for_a_waiting_request():
    """Review finding: loading a chunk the queue's prefetch read for a waiting request
    took it out of the prefetch's accounting (neither in time nor unused): a hint's
    promotion stops at the first such chunk and leaves it to the request's admission."""
    d = Driver(host_slots=16, ssd_capacity_chunks=60, prefetch_budget_chunks=8, hint_budget_chunks=8)
    chain = _ssd_only(d, list(range(3 * CHUNK)))
    _pushed_out(d, 24)
    plan = Effects()
    d.state.plan_prefetch([chain[:2]], [], plan, queue_depth=1, hinted=[_as_hint(chain)])  # the queue reads 0-1
    d.run(plan)
    d.answer()
    assert all(n.on_host for n in chain)
    assert list(d.state.promotable(chain)) == []  # the first chunk is the waiting request's
    assert list(d.state.promotable(chain[2:])) == [chain[2]]  # the hint's own read
    d.state.count_hinted(chain[2:])
    assert d.state.ssd_stats.hint_in_time == 1


def test_the_upstream_action_name_is_a_synonym_with_its_own_version():
    """SGLang's kv_hints envelope is converging on ``kv.prefetch`` version ``1.0``: the same
    hint, the same payload; each name is held to its own version, and one request carries
    one prefetch action whatever its name."""
    from pcr_sglang.core.hints import HINT_CAPABILITIES, UPSTREAM_HINT_ACTION

    upstream = _Action({"ttl_s": 5, "group": "g"}, action_type=UPSTREAM_HINT_ACTION, version="1.0")
    assert hint_payload(_Envelope(upstream)) == HintPayload(True, 5.0, "g", 0)
    with pytest.raises(HintError, match=r"kv.prefetch action_version '1' is not supported \(this server implements"):
        hint_payload(_Envelope(_Action({}, action_type=UPSTREAM_HINT_ACTION, version="1")))
    with pytest.raises(HintError, match=r"2 prefetch actions \(kv.prefetch and pcr.lookahead_prefetch\)"):
        hint_payload(_Envelope(upstream, _Action({})))
    assert HINT_CAPABILITIES[0] == "kv_hint.prefetch.v1"


def test_a_hint_over_the_servers_ttl_is_accepted_clipped_and_counted():
    book = HintBook(HintLimits(max_ttl_s=10.0))
    book.register("long", ["k"], HintPayload(ttl_s=60.0), now=0.0)
    book.register("short", ["j"], HintPayload(ttl_s=5.0), now=0.0)
    assert book.stats.registered == 2 and book.stats.clipped == 1
    assert {h.hint_id: h.deadline for h in book.live()} == {"long": 10.0, "short": 5.0}
