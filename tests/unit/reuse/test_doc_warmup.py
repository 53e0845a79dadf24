"""When documents are warmed: the core ledger and the tokenizer-side warmer's two policies."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.reuse import settings as reuse_settings
from pcr_sglang.reuse.bounds import DocBoundsError, Recompute, request_warm_now
from pcr_sglang.reuse.doc_warmer import DocWarmer
from pcr_sglang.reuse.warmup import WarmupLedger, WarmupPolicy

CHUNK = 4
PAD = 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_document_is_due_from_its_after_th_sighting():
    clock = Clock()
    ledger = WarmupLedger(WarmupPolicy(after=2, ttl_s=10.0), clock)
    assert not ledger.should_warm("a")  # first sighting: served by plain prefill
    assert not ledger.should_warm("b")
    assert ledger.should_warm("a")  # it recurred
    ledger.completed("a")
    clock.now = 5.0
    assert not ledger.should_warm("a")  # warmed within the TTL
    clock.now = 20.0
    assert ledger.should_warm("a")  # the TTL passed: its chain may have been evicted
    assert ledger.stats.not_yet == 2 and ledger.stats.fresh == 1 and ledger.stats.ordered == 2


def test_after_one_warms_every_first_sighting_and_a_failure_is_retried():
    ledger = WarmupLedger(WarmupPolicy(after=1), Clock())
    assert ledger.should_warm("a")
    ledger.failed("a")
    assert ledger.should_warm("a")
    assert ledger.stats.failed == 1


def test_the_ledger_forgets_the_oldest_sightings_first():
    ledger = WarmupLedger(WarmupPolicy(after=2), Clock(), capacity=2)
    for key in ("a", "b", "c"):
        ledger.should_warm(key)
    assert not ledger.should_warm("a")  # forgotten: a first sighting again
    assert ledger.should_warm("c")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"doc_warmup": "later"}, "--pcr-doc-warmup must be one of auto, request, idle"),
        ({"doc_warmup_after": 0}, "--pcr-doc-warmup-after must be an integer >= 1"),
        ({"doc_warmup_after": True}, "--pcr-doc-warmup-after must be an integer >= 1"),
        ({"doc_max_documents": 0}, "--pcr-doc-max-documents must be an integer >= 1"),
        ({"doc_min_tokens": 0}, "--pcr-doc-min-tokens must be an integer >= 1"),
    ],
)
def test_bad_warmup_flags_name_the_flag(fields, message):
    with pytest.raises(PCRConfigError, match=message):
        PCRConfig(enabled=True, **fields).validate(page_size=1)


def test_the_flags_reach_the_policy():
    args = SimpleNamespace(enable_pcr=True, pcr_doc_warmup="idle", pcr_doc_warmup_after=3)
    assert reuse_settings.warmup_policy(PCRConfig.from_server_args(args)) == WarmupPolicy("idle", 3)


def test_the_document_limit_flags_reach_the_limits():
    from pcr_sglang.reuse.bounds import DocLimits

    args = SimpleNamespace(enable_pcr=True, pcr_doc_max_documents=5, pcr_doc_min_tokens=3)
    assert reuse_settings.limits(PCRConfig.from_server_args(args)) == DocLimits(5, 3)
    assert reuse_settings.limits(PCRConfig()) == DocLimits(64, 16)


# ---------------------------------------------------------------- the warmer
def _marked(tokens: list[int], bounds: list[int], salt=None) -> SimpleNamespace:
    return SimpleNamespace(
        input_ids=tokens,
        sampling_params={"custom_params": {"pcr_doc_bounds": bounds}},
        extra_key=None,
        cache_salt=salt,
        priority=None,
        lora_id=None,
    )


# S = [1, 2]; documents [10, 11, 12] and [20, 21]; question [30].
PROMPT = [1, 2, 10, 11, 12, 20, 21, 30]
BOUNDS = [2, 5, 5, 7]
CANONICAL = [[1, 2, 10, 11, 12, PAD, PAD, PAD], [1, 2, 20, 21]]


class Recorder:
    """Stands in for the warm-up prefill (which needs a tokenizer manager): records what
    was sent, under which tenant, and lets a test hold prefills in flight."""

    def __init__(self, manager: SimpleNamespace):
        self.manager = manager
        self.sent: list[tuple[list[int], object]] = []
        self.release = asyncio.Event()
        self.hold = False
        self.concurrent = 0
        self.most_concurrent = 0

    async def __call__(self, manager, send, canonical, extra_key, salt, priority):
        self.sent.append((canonical, salt))
        rid = f"warm-{len(self.sent)}"
        manager.rid_to_state[rid] = object()  # a warm-up is a request in flight too
        self.concurrent += 1
        self.most_concurrent = max(self.most_concurrent, self.concurrent)
        try:
            if self.hold:
                await self.release.wait()
        finally:
            del manager.rid_to_state[rid]
            self.concurrent -= 1


def _warmer(policy: WarmupPolicy, **options) -> tuple[DocWarmer, Recorder, SimpleNamespace]:
    """A warmer whose prefills the recorder stands in for (``options``: caps, wait)."""
    manager = SimpleNamespace(rid_to_state={})
    warmer = DocWarmer(CHUNK, PAD, Recompute("concat"), policy, **options)
    recorder = Recorder(manager)
    warmer._prefill = recorder  # type: ignore[method-assign]
    return warmer, recorder, manager


def test_request_mode_after_two_warms_only_recurring_documents_and_waits_for_them():
    async def run():
        warmer, recorder, manager = _warmer(WarmupPolicy("request", after=2))
        await warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None)
        assert recorder.sent == []  # first sightings: nothing prefilled, the request goes at once
        await warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None)
        assert [c for c, _ in recorder.sent] == CANONICAL  # and the request waited for both
        await warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None)
        assert len(recorder.sent) == 2  # warmed: not again within the TTL
        # Another tenant's sightings are its own.
        await warmer.warm(manager, _marked(PROMPT, BOUNDS, salt="other"), send=None)
        assert len(recorder.sent) == 2

    asyncio.run(run())


def test_request_mode_after_one_warms_first_sightings():
    async def run():
        warmer, recorder, manager = _warmer(WarmupPolicy("request", after=1))
        await warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None)
        assert [c for c, _ in recorder.sent] == CANONICAL

    asyncio.run(run())


def test_idle_mode_sends_the_request_at_once_and_warms_one_at_a_time_when_nothing_is_in_flight():
    async def run():
        warmer, recorder, manager = _warmer(WarmupPolicy("idle", after=1))
        manager.rid_to_state["the-marked-request"] = object()
        await asyncio.wait_for(warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None), timeout=1)
        await asyncio.sleep(0.2)
        assert recorder.sent == []  # the marked request is still in flight
        del manager.rid_to_state["the-marked-request"]
        for _ in range(100):
            if len(recorder.sent) == 2:
                break
            await asyncio.sleep(0.02)
        assert [c for c, _ in recorder.sent] == CANONICAL
        assert recorder.most_concurrent == 1
        assert warmer.stats.completed == 2

    asyncio.run(run())


def test_auto_mode_waits_for_warm_ups_only_while_no_other_request_is_at_the_scheduler():
    from sglang.srt.managers.tokenizer_manager import ReqState

    # What the warmer reads of SGLang's request states: sent to the scheduler or not yet.
    assert ReqState.__dataclass_fields__["dispatched"].default is False

    async def run():
        warmer, recorder, manager = _warmer(WarmupPolicy("auto", after=1))
        undispatched = SimpleNamespace(dispatched=False)
        manager.rid_to_state["the-marked-request"] = undispatched  # its own state, not sent yet
        manager.rid_to_state["another-request"] = SimpleNamespace(dispatched=True)
        await asyncio.wait_for(warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None), timeout=1)
        await asyncio.sleep(0.1)
        assert recorder.sent == []  # beside another request: queued for idle time, not waited for
        assert len(warmer._idle_queue) == 2

        # Alone (a batch-mate not sent yet is not another request), it waits for its
        # warm-ups, the queued ones included, as with ``request``.
        manager.rid_to_state["another-request"] = SimpleNamespace(dispatched=False)
        recorder.hold = True
        alone = asyncio.ensure_future(warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None))
        for _ in range(100):
            if len(recorder.sent) == 2:
                break
            await asyncio.sleep(0.01)
        assert [c for c, _ in recorder.sent] == CANONICAL
        assert not alone.done()  # it waits for them
        recorder.release.set()
        await asyncio.wait_for(alone, timeout=1)
        assert warmer._idle_queue == {}
        # Queued, then started for the request alone: each warm-up ordered once.
        assert warmer.stats.ordered == warmer.stats.completed == 2

    asyncio.run(run())


def test_a_request_waits_for_a_document_already_being_warmed_instead_of_sending_it_twice():
    async def run():
        warmer, recorder, manager = _warmer(WarmupPolicy("request", after=1))
        recorder.hold = True
        first = asyncio.ensure_future(warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(warmer.warm(manager, _marked(PROMPT, BOUNDS), send=None))
        await asyncio.sleep(0.05)
        assert not second.done()  # waiting on the first's warm-ups
        recorder.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), timeout=1)
        assert len(recorder.sent) == 2

    asyncio.run(run())


def test_a_request_asking_for_a_warm_up_gets_it_at_once_whatever_the_policy():
    """What the precompute command sends: every document is seen once there."""

    async def run():
        for policy in (WarmupPolicy("request", after=2), WarmupPolicy("idle", after=2)):
            warmer, recorder, manager = _warmer(policy)
            manager.rid_to_state["the-marked-request"] = object()  # idle would wait for it
            asked = _marked(PROMPT, BOUNDS)
            asked.sampling_params["custom_params"]["pcr_doc_warm"] = True
            await asyncio.wait_for(warmer.warm(manager, asked, send=None), timeout=1)
            assert [c for c, _ in recorder.sent] == CANONICAL, policy  # done before it returned

    asyncio.run(run())


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_warm_request_is_refused(value):
    with pytest.raises(DocBoundsError, match="pcr_doc_warm must be true or false"):
        request_warm_now({"pcr_doc_warm": value})


def test_a_hint_only_request_marking_documents_warms_nothing():
    """Review finding: a KV hint that finishes without compute went through the warmer too
    (and, once its documents recurred, waited for their warm-ups before being registered)."""
    from pcr_sglang.reuse.tokenizer import _marked as needs_warming

    def action(hint_only):
        return SimpleNamespace(
            action_type="pcr.lookahead_prefetch", action_version="1", payload={"hint_only": hint_only}
        )

    request = _marked(PROMPT, BOUNDS)
    assert needs_warming(request)
    request.kv_hints = SimpleNamespace(actions=[action(True)])
    assert not needs_warming(request)
    request.kv_hints = SimpleNamespace(actions=[action(False)])  # rides on a real request: warmed as usual
    assert needs_warming(request)


def _many(first_token: int, count: int, warm_now: bool = False) -> SimpleNamespace:
    """A request marking ``count`` two-token documents behind S = [1, 2]."""
    tokens, bounds = [1, 2], []
    for i in range(count):
        bounds += [len(tokens), len(tokens) + 2]
        tokens += [first_token + 2 * i, first_token + 2 * i + 1]
    request = _marked(tokens + [30], bounds)
    if warm_now:
        request.sampling_params["custom_params"]["pcr_doc_warm"] = True
    return request


@pytest.mark.parametrize(
    "policy, warm_now",
    [
        (WarmupPolicy("request", after=1), False),
        (WarmupPolicy("request", after=2), True),
        (WarmupPolicy("idle", after=2), True),
    ],
    ids=["due", "pcr_doc_warm", "pcr_doc_warm-idle"],
)
def test_warm_ups_in_flight_are_capped_per_request_and_per_server(policy, warm_now):
    """Review finding 4: one request started one warm-up prefill per due document, all at
    once, and ``pcr_doc_warm: true`` made every document due. Now at most
    ``per_request`` of one request's are in flight, ``per_server`` of everyone's; the rest
    wait for a place and all run in the end."""
    from pcr_sglang.reuse.doc_warmer import WarmupCaps

    async def run():
        manager = SimpleNamespace(rid_to_state={})
        warmer = DocWarmer(CHUNK, PAD, Recompute("concat"), policy, caps=WarmupCaps(per_request=3, per_server=4))
        recorder = Recorder(manager)
        warmer._prefill = recorder  # type: ignore[method-assign]
        recorder.hold = True
        first = asyncio.ensure_future(warmer.warm(manager, _many(100, 12, warm_now), send=None))
        await asyncio.sleep(0.05)
        assert recorder.concurrent == 3 and len(warmer._in_flight) == 12  # the rest wait for a place
        second = asyncio.ensure_future(warmer.warm(manager, _many(500, 12, warm_now), send=None))
        await asyncio.sleep(0.05)
        assert recorder.concurrent == 4  # the server's cap: the second request got one place
        recorder.release.set()
        await asyncio.wait_for(asyncio.gather(first, second), timeout=5)
        assert len(recorder.sent) == 24 and recorder.most_concurrent == 4
        assert warmer.stats.completed == 24 and not warmer._in_flight

    asyncio.run(run())


def test_the_warmers_keys_hash_the_leading_tokens_once_and_tell_documents_and_tenants_apart():
    """The ledger key of each document is its canonical sequence's digest (``S`` hashed
    once per request): equal for the same document in another request, different for
    another document or tenant."""
    from pcr_sglang.reuse.bounds import parse_doc_bounds

    warmer = DocWarmer(CHUNK, PAD)
    spans = parse_doc_bounds(BOUNDS, len(PROMPT))
    keys = warmer._keys(PROMPT, spans, None, None)
    moved = [1, 2, 20, 21, 10, 11, 12, 30]  # the same documents, the other way round
    assert warmer._keys(moved, parse_doc_bounds([2, 4, 4, 7], 8), None, None) == keys[::-1]
    assert len(set(keys)) == 2
    assert warmer._keys(PROMPT, spans, None, "other") != keys


def test_one_tenants_flood_of_warm_ups_leaves_places_for_another_tenant():
    """Review N9: the server's warm-up places were one FIFO for everyone, so a tenant
    sending many requests of new documents (``pcr_doc_warm: true`` needs no privilege)
    queued every other tenant's warm-ups behind its own. A tenant now holds at most
    ``per_tenant`` places (red before: the second tenant got none of the 4)."""
    from pcr_sglang.reuse.doc_warmer import WarmupCaps

    async def run():
        warmer, recorder, manager = _warmer(
            WarmupPolicy("request", after=1), caps=WarmupCaps(per_request=8, per_tenant=2, per_server=4)
        )
        recorder.hold = True
        floods = [
            asyncio.ensure_future(warmer.warm(manager, _salted(_many(100 + 50 * i, 8, True), "flood"), send=None))
            for i in range(3)
        ]
        await asyncio.sleep(0.05)
        assert recorder.concurrent == 2  # the flooding tenant's share of the server's 4
        victim = asyncio.ensure_future(warmer.warm(manager, _salted(_many(900, 2, True), "victim"), send=None))
        await asyncio.sleep(0.05)
        assert [salt for _, salt in recorder.sent].count("victim") == 2 and recorder.concurrent == 4
        recorder.release.set()
        await asyncio.wait_for(asyncio.gather(*floods, victim), timeout=5)
        assert len(warmer._tenants) == 0  # nothing kept for tenants with nothing in flight

    asyncio.run(run())


def test_a_request_waits_for_its_warm_ups_a_few_prefills_then_goes_without_them():
    """Review N9: a request waited up to 120 s for its warm-ups. It now waits ``multiple``
    times the median measured warm-up prefill (at least ``floor_s``), then is sent; the
    warm-ups go on and serve later requests (red before: the request waited for the hold)."""
    from pcr_sglang.reuse.doc_warmer import WarmupWait

    async def run():
        warmer, recorder, manager = _warmer(
            WarmupPolicy("request", after=1), wait=WarmupWait(multiple=3.0, floor_s=0.05, initial_s=5.0)
        )
        assert warmer.wait_s() == 5.0  # nothing measured yet
        await warmer.warm(manager, _many(100, 2, True), send=None)  # quick prefills: measured
        assert 0.05 <= warmer.wait_s() < 1.0
        recorder.hold = True
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(warmer.warm(manager, _many(500, 2, True), send=None), timeout=2)
        assert asyncio.get_running_loop().time() - started < 1.0
        assert warmer.stats.wait_timeouts == 1 and len(warmer._in_flight) == 2  # still warming
        recorder.release.set()
        for _ in range(100):
            if not warmer._in_flight:
                break
            await asyncio.sleep(0.01)
        assert warmer.stats.completed == 4

    asyncio.run(run())


def _salted(request: SimpleNamespace, salt: str) -> SimpleNamespace:
    request.cache_salt = salt
    return request
