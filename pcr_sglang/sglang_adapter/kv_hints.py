"""KV hints through SGLang's ``kv_hints`` request field: the ``pcr.lookahead_prefetch`` action.

A RAG pipeline sends the prompt it expects to send next (rendered from the documents the
look-ahead retrieval predicted) as an ordinary ``/generate`` request carrying::

    "kv_hints": {"protocol_version": "1", "message_id": "...",
                 "actions": [{"action_id": "a0", "action_type": "pcr.lookahead_prefetch",
                              "action_version": "1",
                              "payload": {"hint_only": true, "ttl_s": 15, "group": "run-7"}}]}

* ``_validate_one_request`` (AFTER, tokenizer manager): a malformed action is an HTTP 400
  naming the field; other actions are left to whoever implements them.
* ``Scheduler._add_request_to_queue`` (AROUND): the prompt's chunk keys (under the request's
  namespace, ``extra_key`` and ``cache_salt``, exactly as the final request will hash them)
  are registered with the scheduler side's :class:`~pcr_sglang.core.hints.HintBook`; a
  ``hint_only`` request then finishes at once, with no forward: its ``finish_reason`` is
  ``{"type": "length", "length": 0, "pcr_hint": "registered"}`` (``"ignored"`` without an
  SSD tier, with ``--pcr-hint-budget-mb 0``, or over ``--pcr-hint-rate``, which each tenant
  has to itself: the request's ``cache_salt``, else its ``extra_key``). Under TP every rank
  registers it at the clock the ranks agree on. Retracted re-queues and
  requests already finishing pass through untouched.

SGLang 0.5.23 carries the field to ``Req.kv_hints`` and implements no action itself.

:class:`KvHints` is the scheduler loop's collaborator for them: registration with the keys
it is handed, the clock the TP ranks agree on, and (``--pcr-hint-to-device``) promotion of
hinted chunks into free device slots.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Optional

from pcr_sglang.core.hints import Hint, HintBook, HintError, HintPayload, hint_payload, hint_tenant
from pcr_sglang.core.residency import CacheState
from pcr_sglang.sglang_adapter.executor import EffectsExecutor
from pcr_sglang.sglang_adapter.req import PcrReq
from pcr_sglang.sglang_adapter.request_keys import RequestKeys
from pcr_sglang.sglang_adapter.tp_group import TpGroup

logger = logging.getLogger(__name__)


def validate_kv_hints(result: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager._validate_one_request``."""
    envelope = getattr(obj, "kv_hints", None)
    if envelope is None:
        return None
    try:
        hint_payload(envelope)
    except HintError as e:
        raise ValueError(str(e)) from None
    return None


class HintRegistered:
    """The finish reason of a hint-only request (SGLang sends only ``to_json()`` on)."""

    def __init__(self, registered: bool):
        self.registered = registered
        self.message = "pcr: KV hint " + ("registered" if registered else "ignored")

    def to_json(self) -> dict:
        return {"type": "length", "length": 0, "pcr_hint": "registered" if self.registered else "ignored"}


def add_request_to_queue(original: Callable[..., Any], scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler._add_request_to_queue(req, is_retracted=False)``."""
    envelope = getattr(req, "kv_hints", None)
    retracted = bool(kwargs.get("is_retracted", args[0] if args else False))
    if envelope is None or retracted or req.finished() or getattr(req, "to_finish", None) is not None:
        return original(scheduler, req, *args, **kwargs)
    try:
        payload = hint_payload(envelope)
    except HintError as e:  # validated at the tokenizer; a request from elsewhere is served without it
        logger.warning("PCR: ignoring a malformed KV hint on %s: %s", req.rid, e)
        payload = None
    if payload is None:
        return original(scheduler, req, *args, **kwargs)
    from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

    cache = getattr(scheduler, "tree_cache", None)
    registered = isinstance(cache, PCRPrefixCache) and cache.scheduler.kv_hints.add(req, payload)
    if not payload.hint_only:
        return original(scheduler, req, *args, **kwargs)
    # Finished without computing anything, the way SGLang retires a request its queues
    # reject at their door (session, beam group, cache handle, trace, output).
    req.finished_reason = HintRegistered(registered)
    scheduler.retire_unadmitted_request(req)
    return None


class KvHints:
    """The live KV hints of one scheduler (a :class:`~pcr_sglang.core.hints.HintBook`), the
    clock they live by, and their promotion to the device.

    Hints live by the clock the TP ranks agree on (the earliest rank's), so that they
    register, hit the rate limit and expire in the same step on every rank: each step's
    agreement hands it in (:meth:`agreed`), and a registration agrees on one of its own.
    """

    def __init__(self, state: CacheState, book: HintBook, keys: RequestKeys, executor: EffectsExecutor,
                 tp: Optional[TpGroup], *, promote: bool, free_floor_tokens: int):
        self.state = state
        self.book = book
        self.keys = keys
        self.executor = executor
        self.tp = tp
        self.docs: Optional[Any] = None  # DocReuse, with --pcr-doc-reuse
        self.clock: Callable[[], float] = time.monotonic  # this rank's (a test may replace it)
        self.now = 0.0  # the last agreed clock, in seconds
        self.promote = promote  # --pcr-hint-to-device
        self.free_floor_tokens = free_floor_tokens  # promotion leaves this much of the pool free

    def clock_ms(self) -> int:
        return int(self.clock() * 1000)

    def agreed(self, clock_ms: int) -> None:
        """The step's agreement set the clock: hints past their TTL end now (here, not
        only when reads are planned: hints end while the I/O is down too)."""
        self.now = max(self.now, clock_ms / 1000)
        if len(self.book):
            self.book.expire(self.now)

    def expire_unagreed(self) -> None:
        """The ranks stopped agreeing (nothing is read for hints any more): they still end,
        by this rank's clock."""
        if len(self.book):
            self.book.expire(self.clock())

    def add(self, req: PcrReq, payload: HintPayload) -> bool:
        """Register ``req``'s prompt as a hint: its chains are read ahead while the hint
        lives (see :mod:`pcr_sglang.core.hints`). False when it was not registered (no SSD
        tier, hints off, or over the rate). Under TP every rank registers the same request
        here (SGLang hands each rank the same requests in the same order), so the clock it
        is registered at is agreed by a collective of its own."""
        if not self.state.ssd_enabled or self.state.config.hint_budget_chunks <= 0:
            return False
        tokens = req.origin_input_ids
        # What the final request will match: all but its last token (always computed).
        keys = self.keys.of_tokens(tokens[: max(len(tokens) - 1, 0)], req.extra_key, req.cache_salt)
        clock_ms = self.clock_ms()
        if self.tp is not None:
            clock_ms = self.tp.reduce_min([clock_ms])[0]
        now = self.now = max(self.now, clock_ms / 1000)
        tenant = hint_tenant(req.cache_salt, req.extra_key)
        if not self.book.register(req.rid, keys, payload, now, tenant=tenant):
            return False
        if self.docs is not None and payload.hint_only:
            # A hint marking documents also reads each one's canonical chain: the final
            # request reuses them in whatever order it puts them. One group with the
            # prompt's own hint, so they end together. They count against the tenant's live
            # hints (never another tenant's), and past the first 16 they take rate tokens.
            doc_payload = replace(payload, group=payload.group or f"pcr-hint:{req.rid}")
            self.book.register_documents(req.rid, self.docs.canonical_chain_keys(req), doc_payload, now, tenant)
            self.docs.release(req.rid)  # the hint-only request never reaches admission
        return True

    def live(self) -> tuple[Hint, ...]:
        """The live hints, in reading order (this step's agreement expired the old ones):
        the cache state keeps their chains matched from step to step."""
        return self.book.live()

    def promote_hinted(self) -> None:
        """``--pcr-hint-to-device``: the host-resident run that continues each live hint's
        device prefix is loaded into free device slots now, while at least half the pool
        stays free, newest hint first; never by evicting anything. The final request then
        finds it on the device (on a GPU its PCIe copy is meant to have left the request's
        path: not measured yet)."""
        engine, allocator, chunk = self.executor.engine, self.executor.allocator, self.executor.chunk
        chains = self.state.hint_chains.tracked()  # the live hints', synced by this step's plan
        if engine is None or not any(chain.nodes for chain in chains):
            return
        for chain in chains:
            fits = (allocator.available_size() - self.free_floor_tokens) // chunk
            nodes = self.state.hint_promotable(chain, fits)
            if not nodes:
                continue
            slots = self.executor.load_into_free_slots(nodes)
            if slots is not None:
                self.state.promote(nodes, slots)
        if engine.pending_loads:
            # CPU: copies wait for the next forward's layer hooks; there may be none for a
            # while, and an I/O order for these host slots waits for them: copy now.
            engine.fence_before_reuse()

    def clear(self) -> None:
        self.book.clear()
