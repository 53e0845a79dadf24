"""The tokenizer manager's side of document reuse: bounds checked at the door, documents
warmed before the request that needs them.

* ``_validate_one_request`` (AFTER): ``custom_params`` must be a dict, and
  ``custom_params["pcr_doc_bounds"]`` must describe the prompt's tokens within the
  server's ``--pcr-doc-max-documents`` and ``--pcr-doc-min-tokens``; anything else raises
  ``ValueError``, which SGLang's HTTP server returns as 400 naming the problem. Checked
  whether or not the server has document reuse on.
* ``_send_one_request`` and ``_send_batch_request`` (AROUND): with ``--pcr-doc-reuse`` on,
  the canonical sequence ``S ‖ d ‖ pad`` of a marked request's documents is prefilled
  (one ``max_new_tokens=0`` request each, under the request's ``extra_key`` and
  ``cache_salt``) when :class:`pcr_sglang.reuse.warmup.WarmupLedger` says it is due:
  from a document's ``--pcr-doc-warmup-after``-th sighting, not within ``WARM_TTL_S`` of
  its last warm-up. ``--pcr-doc-warmup request``: concurrently, at the request's priority,
  before it is sent, so it reuses them itself; ``idle``: queued, one at a time while no
  request is in flight, and the request is sent at once. One being warmed is waited for
  (``request``), not sent twice. A failed warm-up only costs reuse: the request is served
  either way. Warm-ups in flight are capped per request, per tenant and per server
  (:class:`WarmupCaps`; ``pcr_doc_warm: true`` obeys the same caps): the rest wait in this
  process for a free place, so one request marking many documents cannot flood the
  scheduler with prefills, and one tenant (a ``cache_salt``, which the client chooses)
  sending many such requests holds at most ``per_tenant`` of the server's places. A
  request waits for its warm-ups at most a small multiple of one warm-up prefill as
  recently measured (:class:`WarmupWait`), then is sent without the ones not done.

In the same two hooks, first: a marked request in mode ``reorder`` gets its documents in an
order this server served them in before (:mod:`pcr_sglang.reuse.reorder`). Here and not at
validation: SGLang hands validation the prompt's list, which a batch's samples (``n`` > 1)
share, while each tokenized request owns its tokens.

The warm-up requests are sent below ``generate_request``: the marked request already holds
the tokenizer manager's pause condition and model-update reader lock, and taking them
again would deadlock against a waiting writer (a weight update) or an abort-mode pause.
An abort of the marked request that arrives while it is warming reaches a scheduler that
does not have it yet, so it is sent again right after the request.

``request`` is the "as part of the request" choice of computing a document's canonical KV
the first time it is due (the request pays about the prefill it would have paid anyway,
its documents computed one by one instead of in sequence); ``idle`` is the background,
low-priority one. ``bench/README.md`` ("When documents are warmed") measures both.
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
from pcr_sglang.flags import flag_value
from pcr_sglang.reuse import settings as reuse_settings
from pcr_sglang.reuse.bounds import (
    CANONICAL_PARAM,
    DOC_BOUNDS_PARAM,
    EXACT_MODES,
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
from pcr_sglang.reuse.reorder import reorder_request
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


def _custom_params(obj: Any) -> Any:
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, dict):
        return params.get("custom_params")
    return getattr(params, "custom_params", None)


def validate_doc_bounds(result: Any, manager: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager._validate_one_request``."""
    try:
        custom = doc_params(_custom_params(obj))
    except DocBoundsError as e:
        raise ValueError(str(e)) from None
    if not custom or DOC_BOUNDS_PARAM not in custom:
        return None
    if input_ids is None:
        raise ValueError(f"{DOC_BOUNDS_PARAM} needs a token prompt (input_ids or text)")
    server_args = getattr(manager, "server_args", None)
    try:
        request_recompute(custom, server_recompute(server_args))
        request_warm_now(custom)
        parse_doc_bounds(custom[DOC_BOUNDS_PARAM], len(input_ids), server_limits(server_args))
    except DocBoundsError as e:
        raise ValueError(str(e)) from None
    return None


def server_limits(args: Any) -> DocLimits:
    """What one request may mark on this server (the flags' defaults without server args)."""
    from pcr_sglang.config import PCRConfig

    return reuse_settings.limits(PCRConfig.from_server_args(args))


def server_recompute(args: Any) -> Recompute:
    """The server's document-reuse mode and K/R (mode ``off`` without PCR or the flag)."""
    if not flag_value(args, "enable_pcr"):
        return Recompute("off")
    from pcr_sglang.config import PCRConfig

    return reuse_settings.recompute(PCRConfig.from_server_args(args))


class DocWarmer:
    """Sends the warm-up prefills :class:`WarmupLedger` asks for, at most once at a time per
    document (a request that needs one being warmed waits for it)."""

    def __init__(self, chunk_size: int, pad_token_id: int, server: Recompute = Recompute(),
                 policy: WarmupPolicy = WarmupPolicy(), clock: Callable[[], float] = time.monotonic,
                 limits: Optional[DocLimits] = None, caps: WarmupCaps = WarmupCaps(),
                 wait: WarmupWait = WarmupWait()):
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

    def _keys(self, tokens: Any, spans: tuple[DocSpan, ...], extra_key: Optional[str],
              cache_salt: Optional[str]) -> list[bytes]:
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
            digest.update(array(_TOKEN_TYPECODE, tokens[span.start:span.end]).tobytes())
            digest.update(array(_TOKEN_TYPECODE,
                                [self.pad_token_id] * (-(leading + span.length) % self.chunk)).tobytes())
            keys.append(digest.digest())
        return keys

    async def warm(self, manager: Any, tokenized: Any, send: Callable[..., Any]) -> None:
        """Warm the documents ``tokenized`` marks that are due (``request``, or asked for with
        ``pcr_doc_warm``: and wait for them; ``idle``: queue them and return at once), at
        most ``caps.per_request`` of its warm-ups in flight at once."""
        tokens = tokenized.input_ids
        try:
            custom = doc_params(_custom_params(tokenized)) or {}
            if request_recompute(custom, self.server) is None or getattr(tokenized, "lora_id", None):
                return
            spans = parse_doc_bounds(custom[DOC_BOUNDS_PARAM], len(tokens), self.limits)
            now = request_warm_now(custom)
        except DocBoundsError:
            return  # checked at validation; the scheduler serves it without reuse
        extra_key, salt = getattr(tokenized, "extra_key", None), getattr(tokenized, "cache_salt", None)
        request_slots = asyncio.Semaphore(self.caps.per_request)
        wait_s = self.wait_s()
        waits = []
        for span, key in zip(spans, self._keys(tokens, spans, extra_key, salt)):
            if key in self._in_flight:
                waits.append(self._in_flight[key])
                continue
            if key in self._idle_queue and not now:
                continue  # queued already
            if not self.ledger.should_warm(key, now):
                continue
            canonical = canonical_tokens(tokens, span, spans[0].start, self.chunk, self.pad_token_id)
            if self.policy.when == "idle" and not now:
                self._queue_for_idle(manager, send, key, (canonical, extra_key, salt))
                continue
            self._idle_queue.pop(key, None)
            waits.append(self._start(manager, send, key, canonical, extra_key, salt,
                                     getattr(tokenized, "priority", None), request_slots))
        if waits and (self.policy.when == "request" or now):
            # Shielded: a waiter cancelled (its client gone) must not cancel another's warm-up.
            try:
                await asyncio.wait_for(asyncio.gather(*(asyncio.shield(w) for w in waits), return_exceptions=True),
                                       wait_s)
            except asyncio.TimeoutError:
                self.stats.wait_timeouts += 1
                logger.info("PCR document reuse: warm-ups not done after %.1f s; the request goes without them",
                            wait_s)

    def _start(self, manager: Any, send: Callable[..., Any], key: bytes, canonical: list[int],
               extra_key: Optional[str], salt: Optional[str], priority: Optional[int],
               request_slots: Optional[asyncio.Semaphore] = None) -> asyncio.Future[None]:
        """Order one warm-up: registered at once (a request needing the same document
        waits for this one), sent once it has a place under both caps."""
        future = asyncio.ensure_future(self._capped(request_slots, hint_tenant(salt, extra_key),
                                                    self._prefill(manager, send, canonical, extra_key, salt,
                                                                  priority)))
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
    def _queue_for_idle(self, manager: Any, send: Callable[..., Any], key: bytes,
                        job: tuple[list[int], Optional[str], Optional[str]]) -> None:
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
            if getattr(manager, "rid_to_state", None):
                await asyncio.sleep(IDLE_POLL_S)
                continue
            key, (canonical, extra_key, salt) = self._idle_queue.popitem(last=False)
            try:
                await asyncio.wait_for(asyncio.shield(self._start(manager, send, key, canonical, extra_key, salt,
                                                                  None)), WARM_TIMEOUT_S)
            except Exception:  # failures are counted and logged by _done; a hung one is left behind
                pass

    async def _prefill(self, manager: Any, send: Callable[..., Any], canonical: list[int],
                       extra_key: Optional[str], salt: Optional[str], priority: Optional[int]) -> None:
        """One canonical prefill, through the steps of ``generate_request`` without its
        locks (the marked request holds them)."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=canonical,
            sampling_params={"max_new_tokens": 0, "temperature": 0.0,
                             "custom_params": {CANONICAL_PARAM: 1}},
            extra_key=extra_key, cache_salt=salt, priority=priority,
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


def _warmer_for(manager: Any) -> Optional[DocWarmer]:
    warmer = getattr(manager, "_pcr_doc_warmer", None)
    if warmer is not None:
        return warmer if warmer is not False else None
    args = getattr(manager, "server_args", None)
    if not flag_value(args, "enable_pcr") or flag_value(args, "pcr_doc_reuse") in EXACT_MODES:
        manager._pcr_doc_warmer = False
        return None
    from pcr_sglang.config import PCRConfig
    from pcr_sglang.reuse.setup import doc_pad_token_id

    hf_config = getattr(getattr(manager, "model_config", None), "hf_config", None)
    config = PCRConfig.from_server_args(args)
    warmer = DocWarmer(int(config.chunk_size), doc_pad_token_id(hf_config), reuse_settings.recompute(config),
                       reuse_settings.warmup_policy(config), limits=reuse_settings.limits(config))
    manager._pcr_doc_warmer = warmer
    return warmer


def _marked(tokenized: Any) -> bool:
    """A request whose documents may need warming: it marks them, and it will be computed
    (a hint-only KV hint is not: its documents' chains are read by the hint itself)."""
    custom = _custom_params(tokenized)
    if not (isinstance(custom, dict) and DOC_BOUNDS_PARAM in custom
            and getattr(tokenized, "input_ids", None) is not None):
        return False
    return not _hint_only(tokenized)


def _hint_only(tokenized: Any) -> bool:
    from pcr_sglang.core.hints import HintError, hint_payload

    try:
        payload = hint_payload(getattr(tokenized, "kv_hints", None))
    except HintError:
        return False
    return payload is not None and payload.hint_only


async def _warm_all(manager: Any, marked: list[Any], send: Callable[..., Any]) -> None:
    warmer = _warmer_for(manager)
    if warmer is None or not marked:
        return
    results = await asyncio.gather(*(warmer.warm(manager, t, send) for t in marked), return_exceptions=True)
    for result in results:  # never lose a request over its warm-up
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            logger.warning("PCR document reuse: warming failed (%s); the request is served without it", result)


def _resend_aborts(manager: Any, marked: list[Any]) -> None:
    """An abort that came while a request was warming found no request in the scheduler."""
    from sglang.srt.managers.io_struct import AbortReq

    for tokenized in marked:
        state = manager.rid_to_state.get(tokenized.rid)
        if state is not None and getattr(state, "abort_sent", False):
            manager._dispatch_to_scheduler(AbortReq(rid=tokenized.rid))


def _reorder(manager: Any, tokenized: Any) -> None:
    """``reorder`` (:mod:`pcr_sglang.reuse.reorder`): a marked request's documents put in an
    order served before, here, where every marked request passes (text documents included)."""
    args = getattr(manager, "server_args", None)
    if flag_value(args, "enable_pcr") and _marked(tokenized):
        reorder_request(manager, tokenized, flag_value(args, "pcr_doc_reuse"))


async def send_after_warming(original: Callable[..., Any], manager: Any, tokenized: Any, *args: Any,
                             **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager._send_one_request``."""
    _reorder(manager, tokenized)
    if not _marked(tokenized):
        return await original(manager, tokenized, *args, **kwargs)
    await _warm_all(manager, [tokenized], original)
    result = await original(manager, tokenized, *args, **kwargs)
    _resend_aborts(manager, [tokenized])
    return result


async def send_batch_after_warming(original: Callable[..., Any], manager: Any, tokenized_objs: Any, *args: Any,
                                   **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager._send_batch_request`` (batches of token prompts)."""
    for tokenized in tokenized_objs:
        _reorder(manager, tokenized)
    marked = [t for t in tokenized_objs if _marked(t)]
    if not marked:
        return await original(manager, tokenized_objs, *args, **kwargs)
    await _warm_all(manager, marked, type(manager)._send_one_request)
    result = await original(manager, tokenized_objs, *args, **kwargs)
    _resend_aborts(manager, marked)
    return result
