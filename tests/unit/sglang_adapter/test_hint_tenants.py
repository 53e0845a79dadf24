"""KV hints per tenant (rate bucket, live-hint share, group names) and hint chains kept
matched across scheduler steps, updated by the tree's events instead of matched again."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from pcr_sglang.core import Effects, IoOutcome
from pcr_sglang.core.hints import DEFAULT_TENANT, Hint, HintBook, HintLimits, HintPayload, hint_tenant
from pcr_sglang.core.orders import ReadChunk, Reorder, WriteChunk
from tests.unit.core.test_cache_state import Driver
from tests.unit.core.test_chunk_tree import CHUNK, keys


# ------------------------------------------------------------------ the book, per tenant
def test_the_tenant_is_the_salt_else_the_extra_key_else_the_default():
    assert hint_tenant("s", "e") == "salt:s" and hint_tenant(None, "e") == "extra:e"
    assert hint_tenant(None, None) == DEFAULT_TENANT
    assert hint_tenant("x", None) != hint_tenant(None, "x")  # a salt never passes for an extra_key


def test_a_tenants_group_consumed_leaves_another_tenants_group_of_the_same_name_alive():
    """Review finding: ``consume`` dropped every hint sharing a group string with a matched
    one, whoever registered it."""
    book = HintBook()
    book.register("a0", ["a-sys", "a-d1"], HintPayload(group="g"), now=0.0, tenant="salt:A")
    book.register("a1", ["a-sys", "a-d2"], HintPayload(group="g"), now=0.0, tenant="salt:A")
    book.register("b0", ["b-sys", "b-d1"], HintPayload(group="g"), now=0.0, tenant="salt:B")
    gone = book.consume(["a-sys", "a-d1", "a-q"])  # tenant A's final request
    assert sorted(h.hint_id for h in gone) == ["a0", "a1"]
    assert [h.hint_id for h in book.live()] == ["b0"]


def test_one_tenant_at_the_live_limit_does_not_push_out_another_tenants_hints():
    """Review finding: over ``max_live`` the oldest hint went, whoever owned it, so one
    tenant registering hints pushed out every other tenant's."""
    book = HintBook(HintLimits(max_live=4, burst=100))
    book.register("b", ["kb"], HintPayload(), now=0.0, tenant="salt:B")
    for i in range(10):  # A registers on and on at the limit
        assert book.register(f"a{i}", [f"ka{i}"], HintPayload(), now=0.0, tenant="salt:A")
    assert len(book) == 4 and book.live_of("salt:B") == 1
    assert {h.hint_id for h in book.live()} == {"b", "a7", "a8", "a9"}  # A lost only its own oldest
    assert book.stats.expired == 7


def test_one_tenant_out_of_rate_tokens_does_not_rate_limit_another():
    book = HintBook(HintLimits(rate_per_s=1, burst=2))
    assert [book.register(f"a{i}", ["k"], HintPayload(), now=0.0, tenant="salt:A") for i in range(3)] == [
        True,
        True,
        False,
    ]
    assert book.register("b", ["k"], HintPayload(), now=0.0, tenant="salt:B")  # B's own bucket
    assert book.stats.rate_limited == 1


def test_uncharged_hints_count_against_their_own_tenant_only():
    """A hint-only request's per-document hints cost no rate token, but they are live
    hints of its tenant: a request marking many documents pushes out its tenant's older
    hints, never another tenant's."""
    book = HintBook(HintLimits(max_live=6))
    book.register("b", ["kb"], HintPayload(), now=0.0, tenant="salt:B")
    book.register("a", ["ka"], HintPayload(), now=0.0, tenant="salt:A")
    assert book.register_documents("a", [[f"kd{n}"] for n in range(8)], HintPayload(), 0.0, "salt:A") == 8
    assert book.live_of("salt:B") == 1 and book.live_of("salt:A") == 5
    assert book.stats.registered == 2  # hints asked for


def test_a_hint_only_request_pays_a_token_for_every_16_documents_past_its_first_16():
    """Review finding: a hint-only request's per-document hints were free, so one token
    bought as many hints as the request marked documents."""
    from pcr_sglang.core.hints import DOC_HINTS_PER_TOKEN

    book = HintBook(HintLimits(rate_per_s=1, burst=2))
    docs = [[f"kd{n}"] for n in range(3 * DOC_HINTS_PER_TOKEN + 5)]
    assert book.register("a", ["ka"], HintPayload(), now=0.0)  # one token
    assert book.register_documents("a", docs, HintPayload(), 0.0) == 2 * DOC_HINTS_PER_TOKEN  # one more
    assert book.stats.documents_unhinted == DOC_HINTS_PER_TOKEN + 5  # the bucket ran dry
    assert len(book) == 1 + 2 * DOC_HINTS_PER_TOKEN
    assert not book.register("later", ["k"], HintPayload(), now=0.0)  # they were the tenant's tokens


def test_refilled_buckets_of_departed_tenants_are_forgotten():
    from pcr_sglang.core import hints

    book = HintBook(HintLimits(rate_per_s=10, burst=2))
    for i in range(hints._BUCKETS_KEPT + 10):  # a client naming a new salt each time
        book.register(f"h{i}", ["k"], HintPayload(), now=float(i), tenant=f"salt:{i}")
    assert len(book._buckets) <= hints._BUCKETS_KEPT


# ------------------------------------------------------------------ chains kept across steps
def _ssd_only(d: Driver, tokens: list[int]) -> list:
    d.serve(tokens)
    effects = Effects()
    d.state.evict_device(1000, effects)
    d.run(effects)
    d.answer()
    return d.state.match(iter(keys(tokens)), touch=False).nodes


def _pushed_out(d: Driver, chunks: int) -> None:
    for start in range(0, chunks, 8):
        _ssd_only(d, list(range(10_000 + start * CHUNK, 10_000 + (start + 8) * CHUNK)))


def _planned(d: Driver, hint: Hint) -> tuple[Effects, int]:
    """One step's prefetch plan with ``hint`` live: its effects, and how many times it
    matched a chain from the tree's root (``tree.match``, or the kept chains' own walk)."""
    calls, walks = [], d.state.hint_chains.full_matches
    real = d.state.tree.match
    d.state.tree.match = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        effects = Effects()
        d.state.plan_prefetch([], [], effects, queue_depth=0, hinted=[hint])
    finally:
        del d.state.tree.match
    d.run(effects)
    return effects, len(calls) + d.state.hint_chains.full_matches - walks


def test_a_hinted_chain_follows_inserts_evictions_and_deletes_without_being_matched_again():
    d = Driver(host_slots=16, ssd_capacity_chunks=80, prefetch_budget_chunks=8, hint_budget_chunks=4)
    tokens = list(range(300, 300 + 6 * CHUNK))
    chain = _ssd_only(d, tokens[: 3 * CHUNK])  # the first half of the hinted prompt is cached
    _pushed_out(d, 24)
    hint = Hint("h", keys(tokens), None, 0, float("inf"), seq=1)
    plan, matches = _planned(d, hint)  # registration: the one match from the root
    (tracked,) = d.state.hint_chains.tracked()
    assert tracked.nodes == chain and matches == 1
    assert [o.key for o in plan.orders if isinstance(o, ReadChunk)] == [n.key for n in chain]
    d.answer(only=ReadChunk)  # the three land in host memory
    # Inserted: the whole prompt is served, the tree gains the chain's next chunks.
    d.serve(tokens)
    assert _planned(d, hint)[1] == 0
    assert [n.key for n in tracked.nodes] == keys(tokens)
    # Evicted (demoted): off the device and out of host memory, to SSD only: read again.
    effects = Effects()
    d.state.evict_device(1000, effects)
    d.run(effects)
    d.answer()
    effects = Effects()
    d.state.host.evict(1000, effects)
    d.run(effects)
    assert all(n.on_ssd and not n.on_host and not n.on_device for n in tracked.nodes)
    plan, matches = _planned(d, hint)
    assert matches == 0 and len([o for o in plan.orders if isinstance(o, ReadChunk)]) == 4  # the hint budget
    d.answer(only=ReadChunk)
    # Deleted: the chain's last record is found bad and dropped, so that chunk leaves the tree.
    last = tracked.nodes[-1]
    assert not last.on_host
    d.state.ssd.bad.append(last)
    effects = Effects()
    d.state.ssd.drop_bad_records(effects)
    d.run(effects)
    assert _planned(d, hint)[1] == 0
    assert tracked.nodes == d.state.match(iter(keys(tokens)), touch=False).nodes and len(tracked.nodes) == 5
    for _ in range(5):  # quiet steps
        assert _planned(d, hint)[1] == 0
    assert d.state.hint_chains.full_matches == 1  # never matched from the root again
    d.check()


def test_a_chunk_that_leaves_host_memory_is_read_again_for_its_hint():
    """The read frontier moves back when a hinted chunk loses its host copy (an event),
    so the plan orders it again as it did when it matched the chain every step."""
    d = Driver(host_slots=16, ssd_capacity_chunks=80, prefetch_budget_chunks=8, hint_budget_chunks=8)
    chain = _ssd_only(d, list(range(300, 300 + 3 * CHUNK)))
    _pushed_out(d, 24)
    hint = Hint("h", [n.key for n in chain], None, 0, float("inf"), seq=1)
    plan = Effects()
    d.state.plan_prefetch([], [], plan, queue_depth=0, hinted=[hint])
    d.run(plan)
    d.answer(only=ReadChunk)
    d.state.count_hinted(chain)  # a request used them: they are ordinary host chunks now
    assert all(n.on_host for n in chain)
    quiet = Effects()
    d.state.plan_prefetch([], [], quiet, queue_depth=0, hinted=[hint])
    assert not [o for o in quiet.orders if isinstance(o, ReadChunk)]
    effects = Effects()
    d.state.host.evict(1, effects)  # the chain's last chunk (its host leaf) goes to SSD only
    assert not chain[-1].on_host and chain[-1].on_ssd
    plan = Effects()
    d.state.plan_prefetch([], [], plan, queue_depth=0, hinted=[hint])
    assert [o.key for o in plan.orders if isinstance(o, ReadChunk)] == [chain[-1].key]


def test_a_hinted_read_cancelled_by_a_dying_io_process_is_ordered_again():
    d = Driver(host_slots=16, ssd_capacity_chunks=80, prefetch_budget_chunks=8, hint_budget_chunks=8)
    chain = _ssd_only(d, list(range(300, 300 + 3 * CHUNK)))
    _pushed_out(d, 24)
    hint = Hint("h", [n.key for n in chain], None, 0, float("inf"), seq=1)
    plan, _ = _planned(d, hint)
    assert len([o for o in plan.orders if isinstance(o, ReadChunk)]) == 3
    plan, _ = _planned(d, hint)  # a step while they are in flight: nothing more to read
    assert not [o for o in plan.orders if isinstance(o, ReadChunk)]
    d.answer(IoOutcome.CANCELLED, only=ReadChunk)  # the I/O process died with them in flight
    again = []
    for _ in range(3):  # (the hint budget still counts the cancelled reads for one step)
        plan, _ = _planned(d, hint)
        again += [o.key for o in plan.orders if isinstance(o, ReadChunk)]
    assert again == [n.key for n in chain]


def test_a_hinted_chunk_dropped_off_the_device_with_no_host_slot_is_read_again():
    d = Driver(host_slots=4, ssd_capacity_chunks=80, prefetch_budget_chunks=4, hint_budget_chunks=1)
    tokens = list(range(300, 300 + 2 * CHUNK))
    chain = _ssd_only(d, tokens)
    _pushed_out(d, 8)  # the chain is on SSD only
    _ssd_only(d, list(range(900, 900 + 4 * CHUNK)))  # its four chunks fill host memory
    held = [n for n in d.state.tree.iter_nodes() if n.on_host]
    assert len(held) == 4
    d.serve(tokens)  # computed again: on the device (and SSD), not in host memory
    assert all(n.on_device and not n.on_host for n in chain)
    hint = Hint("h", [n.key for n in chain], None, 0, float("inf"), seq=1)
    plan, _ = _planned(d, hint)
    assert not [o for o in plan.orders if isinstance(o, ReadChunk)]  # nothing to read
    for node in held:
        d.state.lock(node)  # host memory has no slot to give
    effects = Effects()
    d.state.evict_device(1000, effects)
    d.run(effects)
    assert all(n.on_ssd and not n.on_host and not n.on_device for n in chain)
    for node in held:
        d.state.unlock(node)
    plan, _ = _planned(d, hint)
    assert [o.key for o in plan.orders if isinstance(o, ReadChunk)] == [chain[0].key]  # the budget's one


@pytest.fixture
def make():
    """Harnesses over SGLang's real CPU pool (closed after the test)."""
    pytest.importorskip("sglang")
    from tests.unit.adapter_harness import Harness

    made = []
    yield lambda **kwargs: made.append(Harness(**kwargs)) or made[-1]
    for harness in made:
        harness.close()


def test_hint_steps_do_not_match_the_live_hints_again(make, tmp_path):
    """Review finding: every scheduler step matched every live hint's whole chain (twice
    with --pcr-hint-to-device). Now a step matches only the waiting queue's requests."""
    from tests.unit.sglang_adapter.test_prefix_cache_adapter import _hint, persisted, prompt

    prompts = [prompt(100 * (i + 1)) for i in range(4)]
    persisted(make(host_slots=3, ssd_path=tmp_path / "ssd"), prompts)
    h = make(host_slots=12, ssd_path=tmp_path / "ssd", hint_to_device="on")
    for i, tokens in enumerate(prompts):
        _hint(h, tokens + [0], rid=f"hint{i}")
    calls = []
    real = h.state.match
    h.state.match = lambda *a, **k: calls.append(1) or real(*a, **k)
    h.step()
    h.drain_io()
    calls.clear()
    for _ in range(5):
        h.step()
    assert calls == [], f"{len(calls)} matches in 5 steps with {len(h.scheduler.hints)} live hints"
    assert h.state.ssd_stats.hint_issued > 0 and h.state.ssd_stats.hint_promoted > 0
    h.check()


# ------------------------------------------------------------------ the same plans as before
def _orders(effects: Effects) -> list:
    return [repr(o) for o in effects.orders]


def _answer(d: Driver, picks: list[int], bad: set[int]) -> None:
    """Complete the outstanding orders at positions ``picks`` (cancelled reads as
    cancelled, ``bad`` ones failed)."""
    pending = d.state.outstanding()
    done = [pending[i] for i in picks if i < len(pending)]
    outcomes = []
    for seq in done:
        if d.state.ledger.cancelling(seq):
            outcomes.append((seq, IoOutcome.CANCELLED, 0.001))
        else:
            outcomes.append((seq, IoOutcome.BAD if seq in bad else IoOutcome.OK, 0.001))
    effects = Effects()
    d.state.apply_outcomes(outcomes, effects)
    d.run(effects)


def test_kept_chains_plan_exactly_what_matching_every_step_planned():
    """The same random run (requests, evictions, I/O completions and failures, hints
    registered and ended, promotions, a reset) on two caches: one whose hint chains are
    matched again from the root every step (its index reset before each plan, as the
    scheduler matched them before the chains were kept), one with the kept chains. Every
    order, counter and tier of every chunk is the same."""
    rng = random.Random(11)
    config = dict(host_slots=20, ssd_capacity_chunks=70, prefetch_budget_chunks=6, hint_budget_chunks=5)
    old, new = Driver(device_slots=30, **config), Driver(device_slots=30, **config)
    docs = [[rng.randrange(5000) for _ in range(CHUNK * rng.randint(1, 4))] for _ in range(25)]
    prompts = [sum((rng.choice(docs) for _ in range(rng.randint(1, 4))), [])[: 14 * CHUNK] for _ in range(40)]
    hints: list[Hint] = []
    seq = 0
    for step in range(400):
        roll = rng.random()
        for d in (old, new):  # the same inputs to both
            rs = random.Random(step)
            if roll < 0.35:
                d.serve(rs.choice(prompts))
            elif roll < 0.5:
                effects = Effects()
                d.state.evict_device(rs.randint(1, 12), effects)
                d.run(effects)
            elif roll < 0.8:
                picks = rs.sample(range(12), rs.randint(1, 6))
                _answer(d, picks, bad={s for s in d.state.outstanding() if rs.random() < 0.05})
            elif roll < 0.81:
                d.state.reset()
                d.device_free = list(range(d.device_slots))
        if rng.random() < 0.15:
            seq += 1
            hints.append(Hint(f"h{seq}", keys(rng.choice(prompts)), None, 0, float("inf"), seq=seq))
        if hints and rng.random() < 0.08:
            hints.pop(rng.randrange(len(hints)))
        queue = [keys(rng.choice(prompts))] if rng.random() < 0.3 else []
        plans = []
        for d in (old, new):
            effects = Effects()
            chains = [d.state.match(iter(k), touch=False).nodes for k in queue]
            if d is old:
                d.state.hint_chains.reset()  # every chain matched afresh from the root
                d.state.plan_prefetch(chains, [], effects, len(queue), hints)
                runs = [list(d.state.promotable(d.state.match(iter(h.keys), touch=False).host_nodes)) for h in hints]
            else:
                d.state.plan_prefetch(chains, [], effects, len(queue), hints)
                runs = [d.state.hint_promotable(c, 1 << 30) for c in d.state.hint_chains.tracked()]
            d.run(effects)
            plans.append((_orders(effects), [[n.key for n in r] for r in runs]))
        assert plans[0] == plans[1], f"step {step}"
        first = next((i for i, r in enumerate(plans[0][1]) if r and len(r) <= len(old.device_free)), None)
        if first is not None and rng.random() < 0.3:
            for d in (old, new):
                run = d.state.match(iter(hints[first].keys), touch=False).nodes
                nodes = [n for n in run if n.key in set(plans[0][1][first])]
                d.state.promote(nodes, [d.device_free.pop() for _ in nodes])
        assert asdict(old.state.ssd_stats) == asdict(new.state.ssd_stats), f"step {step}"
        assert asdict(old.state.stats) == asdict(new.state.stats), f"step {step}"
        if step % 40 == 0:
            new.check()
    tiers = [sorted((n.key, n.on_device, n.host_slot, n.on_ssd) for n in d.state.tree.iter_nodes()) for d in (old, new)]
    assert tiers[0] == tiers[1]
    ssd = new.state.ssd_stats
    assert ssd.hint_issued > 0 and ssd.hint_wasted > 0 and ssd.cancelled_reads > 0  # the run reached them
    assert any(isinstance(o, WriteChunk) for o in new.orders) or ssd.written_chunks > 0
    assert not [o for o in new.orders if isinstance(o, Reorder)]  # Driver.run keeps none
    new.check()
