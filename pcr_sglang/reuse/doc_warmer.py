"""Document warm-ups: the prefills of documents' canonical sequences, sent before (or, in
``idle`` mode, beside) the requests that mark them.

:class:`DocWarmer` asks :class:`~pcr_sglang.reuse.warmup.WarmupLedger` which of a marked
request's documents are due, sends one ``max_new_tokens=0`` prefill per due document (at
most once at a time per document), within the caps of :class:`WarmupCaps` (per request, per
tenant, per server) and a request's wait of :class:`WarmupWait`. Kept apart from
:mod:`pcr_sglang.reuse.tokenizer`, the tokenizer manager's hooks that call it: this module
decides what is warmed and when; the hooks decide which requests pass through it. The
behaviour and why: :mod:`pcr_sglang.reuse.tokenizer`'s docstring.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import statistics
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pcr_sglang.core.hints import hint_tenant
from pcr_sglang.reuse.bounds import (
    CANONICAL_PARAM,
    DOC_BOUNDS_PARAM,
    DocBoundsError,
    DocLimits,
    DocSpan,
    Recompute,
    doc_params,
    parse_doc_bounds,
    request_recompute,
    request_warm_now,
)
from pcr_sglang.reuse.plan import canonical_tokens
from pcr_sglang.reuse.warmup import WarmupLedger, WarmupPolicy, WarmupStats

logger = logging.getLogger(__name__)

IDLE_QUEUE_MAX = 1024  # documents waiting for idle time; the oldest are forgotten first
IDLE_POLL_S = 0.05
# The longest a request waits for its documents' warm-ups (then goes without them), and
# the idle drain for one warm-up; a request's own wait is shorter once prefills have been
# measured (:class:`WarmupWait`). A warm-up is a prefill: far less on a live server.
WARM_TIMEOUT_S = 120.0
_TOKEN_TYPECODE = "q"  # canonical sequences hashed as int64, as chunk keys hash tokens


@dataclass(frozen=True)
class WarmupCaps:
    """Warm-up prefills in flight at once: for one request, and for the whole server (all
    requests, and the ``idle`` drain). A request's further due documents wait here for a
    place, within its ``WARM_TIMEOUT_S``; the scheduler never holds more than
    ``per_server`` of them. One request's warm-ups are still one batch of prefills at the
    default (``per_request`` is above what most requests mark)."""

    per_request: int = 8
    per_tenant: int = 8  # (``cache_salt``, else ``extra_key``): half the server's places
    per_server: int = 16


@dataclass(frozen=True)
class WarmupWait:
    """How long a request waits for its warm-ups before it is sent without them:
    ``multiple`` times the median of the last ``window`` warm-up prefills (their time in
    the scheduler, from send to answer), at least ``floor_s``; ``initial_s`` before any
    has been measured; never over ``WARM_TIMEOUT_S``. A request whose warm-ups sit behind
    others' is then served at about what a cold prefill costs, not after the whole queue."""

    multiple: float = 4.0
    floor_s: float = 2.0
    initial_s: float = 30.0
    window: int = 32


class TenantPlaces:
    """At most ``per_tenant`` warm-ups of one tenant in flight. A tenant's entry lives only
    while one of its warm-ups holds or waits for a place, so memory is bounded by the
    warm-ups in flight, however many tenants a client invents."""

    def __init__(self, per_tenant: int):
        self.per_tenant = per_tenant
        self._places: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    async def acquire(self, tenant: str) -> None:
        # mutant: warm-ups-not-capped-per-tenant
        semaphore, users = self._places.setdefault(tenant, (asyncio.Semaphore(self.per_tenant), [0]))
        users[0] += 1
        try:
            await semaphore.acquire()
        except BaseException:
            self._leave(tenant)
            raise

    def release(self, tenant: str) -> None:
        self._places[tenant][0].release()
        self._leave(tenant)

    def _leave(self, tenant: str) -> None:
        users = self._places[tenant][1]
        users[0] -= 1
        if users[0] == 0:
            del self._places[tenant]

    def __len__(self) -> int:
        return len(self._places)


def custom_params(obj: Any) -> Any:
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, dict):
        return params.get("custom_params")
    return getattr(params, "custom_params", None)


class DocWarmer:
    """Sends the warm-up prefills :class:`WarmupLedger` asks for, at most once at a time per
    document (a request that needs one being warmed waits for it)."""

    def __init__(
        self,
        chunk_size: int,
        pad_token_id: int,
        server: Recompute = Recompute(),
        policy: WarmupPolicy = WarmupPolicy(),
        clock: Callable[[], float] = time.monotonic,
        limits: Optional[DocLimits] = None,
        caps: WarmupCaps = WarmupCaps(),
        wait: WarmupWait = WarmupWait(),
    ):
        self.server = server
        self.chunk = chunk_size
        self.pad_token_id = pad_token_id
        self.policy = policy
        self.limits = limits
        self.caps = caps
        self.wait = wait
        self.ledger = WarmupLedger(policy, clock)
        self._tenants = TenantPlaces(caps.per_tenant)
        self._prefill_s: deque[float] = deque(maxlen=wait.window)  # the last warm-ups' prefill times
        self._in_flight: dict[bytes, asyncio.Future[None]] = {}
        self._server_slots: Optional[asyncio.Semaphore] = None  # made in the event loop, on first use
        # ``idle``: documents waiting for a moment with no request in flight, oldest first.
        self._idle_queue: OrderedDict[bytes, tuple[list[int], Optional[str], Optional[str]]] = OrderedDict()
        self._idle_task: Optional[asyncio.Task[None]] = None

    @property
    def stats(self) -> WarmupStats:
        return self.ledger.stats

    def wait_s(self) -> float:
        """How long the next request waits for its warm-ups (:class:`WarmupWait`)."""
        if not self._prefill_s:
            return min(self.wait.initial_s, WARM_TIMEOUT_S)
        one = statistics.median(self._prefill_s)
        return min(max(self.wait.floor_s, self.wait.multiple * one), WARM_TIMEOUT_S)

    def _keys(
        self, tokens: Any, spans: tuple[DocSpan, ...], extra_key: Optional[str], cache_salt: Optional[str]
    ) -> list[bytes]:
        """Each document's ledger key: a digest of its canonical sequence ``S ‖ d ‖ pad``
        under the tenant, with ``S`` hashed once for all documents (the digest of ``S`` is
        copied and continued with each document)."""
        prefix = hashlib.blake2b(digest_size=16)
        prefix.update(repr((extra_key, cache_salt)).encode())
        prefix.update(b"|")
        leading = spans[0].start
        prefix.update(array(_TOKEN_TYPECODE, tokens[:leading]).tobytes())
        keys = []
        for span in spans:
            digest = prefix.copy()
            digest.update(array(_TOKEN_TYPECODE, tokens[span.start : span.end]).tobytes())
            digest.update(
                array(_TOKEN_TYPECODE, [self.pad_token_id] * (-(leading + span.length) % self.chunk)).tobytes()
            )
            keys.append(digest.digest())
        return keys

    async def warm(self, manager: Any, tokenized: Any, send: Callable[..., Any]) -> None:
        """Warm the documents ``tokenized`` marks that are due (``request``, or asked for with
        ``pcr_doc_warm``: and wait for them; ``idle``: queue them and return at once; ``auto``:
        as ``request`` while no other request is at the scheduler, else as ``idle``), at
        most ``caps.per_request`` of its warm-ups in flight at once."""
        tokens = tokenized.input_ids
        try:
            custom = doc_params(custom_params(tokenized)) or {}
            if request_recompute(custom, self.server) is None or getattr(tokenized, "lora_id", None):
                return
            spans = parse_doc_bounds(custom[DOC_BOUNDS_PARAM], len(tokens), self.limits)
            now = request_warm_now(custom)
        except DocBoundsError:
            return  # checked at validation; the scheduler serves it without reuse
        extra_key, salt = getattr(tokenized, "extra_key", None), getattr(tokenized, "cache_salt", None)
        waits_here = now or self._waits(manager)
        request_slots = asyncio.Semaphore(self.caps.per_request)
        # mutant: a-request-waits-for-its-warm-ups-up-to-two-minutes
        wait_s = self.wait_s()
        waits = []
        for span, key in zip(spans, self._keys(tokens, spans, extra_key, salt)):
            if key in self._in_flight:
                waits.append(self._in_flight[key])
                continue
            queued = key in self._idle_queue  # ordered by the ledger already: not asked twice
            if queued and not waits_here:
                continue
            # mutant: a-queued-warm-up-is-ordered-again-when-started
            if not queued and not self.ledger.should_warm(key, now):
                continue
            canonical = canonical_tokens(tokens, span, spans[0].start, self.chunk, self.pad_token_id)
            if not waits_here:
                self._queue_for_idle(manager, send, key, (canonical, extra_key, salt))
                continue
            self._idle_queue.pop(key, None)
            waits.append(
                self._start(
                    manager, send, key, canonical, extra_key, salt, getattr(tokenized, "priority", None), request_slots
                )
            )
        if waits and waits_here:
            # Shielded: a waiter cancelled (its client gone) must not cancel another's warm-up.
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(asyncio.shield(w) for w in waits), return_exceptions=True), wait_s
                )
            except asyncio.TimeoutError:
                self.stats.wait_timeouts += 1
                logger.info("PCR document reuse: warm-ups not done after %.1f s; the request goes without them", wait_s)

    def _waits(self, manager: Any) -> bool:
        """Whether a request being sent waits for its warm-ups under the policy: always with
        ``request``, never with ``idle``; with ``auto`` only while no other request is at
        the scheduler (dispatched, in the tokenizer manager's ``rid_to_state``; warm-ups
        included), where its wait delays no one. The request itself is not dispatched yet,
        nor the rest of a batch of token prompts (sent together); SGLang sends a batch of
        text prompts one by one, so there only the first waits."""
        if self.policy.when != "auto":
            return self.policy.when == "request"
        states = getattr(manager, "rid_to_state", None) or {}
        # mutant: auto-warm-up-waits-beside-other-requests
        return not any(getattr(state, "dispatched", True) for state in states.values())

    def _start(
        self,
        manager: Any,
        send: Callable[..., Any],
        key: bytes,
        canonical: list[int],
        extra_key: Optional[str],
        salt: Optional[str],
        priority: Optional[int],
        request_slots: Optional[asyncio.Semaphore] = None,
    ) -> asyncio.Future[None]:
        """Order one warm-up: registered at once (a request needing the same document
        waits for this one), sent once it has a place under both caps."""
        future = asyncio.ensure_future(
            self._capped(
                request_slots,
                hint_tenant(salt, extra_key),
                self._prefill(manager, send, canonical, extra_key, salt, priority),
            )
        )
        self._in_flight[key] = future
        future.add_done_callback(functools.partial(self._done, key))
        return future

    async def _capped(self, request_slots: Optional[asyncio.Semaphore], tenant: str, prefill: Any) -> None:
        """Run ``prefill`` (a coroutine) holding a place of the request's, the tenant's and
        the server's caps; its time, once it has them, is what :meth:`wait_s` measures."""
        if self._server_slots is None:
            self._server_slots = asyncio.Semaphore(self.caps.per_server)
        held = tenant_held = False
        try:
            if request_slots is not None:
                await request_slots.acquire()
                held = True
            await self._tenants.acquire(tenant)
            tenant_held = True
            async with self._server_slots:
                started = time.monotonic()
                await prefill
                self._prefill_s.append(time.monotonic() - started)
        finally:
            if tenant_held:
                self._tenants.release(tenant)
            if held and request_slots is not None:
                request_slots.release()
            prefill.close()  # never awaited when cancelled while waiting for a place

    def _done(self, key: bytes, future: asyncio.Future[None]) -> None:
        """Remember a warm-up that completed; a failed or aborted one is tried again next time."""
        self._in_flight.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            self.ledger.failed(key)
            if not future.cancelled():
                logger.warning("PCR document reuse: warming a document failed: %s", future.exception())
            return
        self.ledger.completed(key)

    # ------------------------------------------------------------------ idle
    def _queue_for_idle(
        self, manager: Any, send: Callable[..., Any], key: bytes, job: tuple[list[int], Optional[str], Optional[str]]
    ) -> None:
        self._idle_queue[key] = job
        while len(self._idle_queue) > IDLE_QUEUE_MAX:
            self._idle_queue.popitem(last=False)
            self.ledger.stats.dropped += 1
        if self._idle_task is None or self._idle_task.done():
            self._idle_task = asyncio.ensure_future(self._drain_when_idle(manager, send))

    async def _drain_when_idle(self, manager: Any, send: Callable[..., Any]) -> None:
        """One queued warm-up at a time, each only while no request is in flight (the
        tokenizer manager's ``rid_to_state`` is empty): low priority without preemption,
        so a request arriving meanwhile waits at most for one document's prefill."""
        while self._idle_queue:
            # mutant: warmup-idle-drain-ignores-requests-in-flight
            if getattr(manager, "rid_to_state", None):
                await asyncio.sleep(IDLE_POLL_S)
                continue
            key, (canonical, extra_key, salt) = self._idle_queue.popitem(last=False)
            try:
                await asyncio.wait_for(
                    asyncio.shield(self._start(manager, send, key, canonical, extra_key, salt, None)), WARM_TIMEOUT_S
                )
            except Exception:  # failures are counted and logged by _done; a hung one is left behind
                pass

    async def _prefill(
        self,
        manager: Any,
        send: Callable[..., Any],
        canonical: list[int],
        extra_key: Optional[str],
        salt: Optional[str],
        priority: Optional[int],
    ) -> None:
        """One canonical prefill, through the steps of ``generate_request`` without its
        locks (the marked request holds them)."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=canonical,
            sampling_params={"max_new_tokens": 0, "temperature": 0.0, "custom_params": {CANONICAL_PARAM: 1}},
            extra_key=extra_key,
            cache_salt=salt,
            priority=priority,
        )
        obj.normalize_batch_and_arguments()
        manager._init_req_state(obj, None)
        states = {obj.rid: manager.rid_to_state[obj.rid]}
        final: Any = None
        try:
            tokenized = await manager._tokenize_one_request(obj)
            await send(manager, tokenized)
            async for out in manager._wait_one_response(obj, None):
                final = out
        except BaseException:
            manager._release_req_states_on_failure(states)
            raise
        finish = ((final or {}).get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            raise RuntimeError(f"the warm-up request was aborted: {finish.get('message')}")
