"""KV hints through SGLang's ``kv_hints`` request field: the ``pcr.lookahead_prefetch`` action
(version ``1``), also accepted as ``kv.prefetch`` version ``1.0``, the name SGLang's envelope
is converging on, with the same payload; ``/server_info`` advertises ``kv_hint.prefetch.v1``.

A RAG pipeline sends the prompt it expects to send next (rendered from the documents the
look-ahead retrieval predicted) as an ordinary ``/generate`` request carrying::

    "kv_hints": {"protocol_version": "1", "message_id": "...",
                 "actions": [{"action_id": "a0", "action_type": "pcr.lookahead_prefetch",
                              "action_version": "1",
                              "payload": {"hint_only": true, "ttl_s": 15, "group": "run-7"}}]}

* ``_validate_one_request`` (AFTER, tokenizer manager): a malformed action is an HTTP 400
  naming the field; other actions are left to whoever implements them.
* ``_init_req_state`` (AFTER, tokenizer manager): the action's payload gets the request's
  *caller*, the peer address of the HTTP connection (``pcr_caller``, overwritten on every
  request: a client never chooses it; the Engine's requests, which have no connection, are
  one local caller). The hint book rate-limits and shares ``max_live`` per caller as well
  as per tenant, so a client rotating ``cache_salt`` stays one caller. The peer's host is
  used, not host and port: a client opening a connection per request would be a new caller
  each time. SGLang knows one API key per server, which all clients present, so a key
  says nothing of who sent a request; behind a proxy every client is the proxy's caller.
* ``Scheduler._add_request_to_queue`` (AROUND): the prompt's chunk keys (under the request's
  namespace, ``extra_key`` and ``cache_salt``, exactly as the final request will hash them)
  are registered with the scheduler side's :class:`~pcr_sglang.core.hints.HintBook`; a
  ``hint_only`` request then finishes at once, with no forward: its ``finish_reason`` is
  ``{"type": "length", "length": 0, "pcr_hint": "registered"}`` (``"ignored"`` without an
  SSD tier, with ``--pcr-hint-budget-mb 0``, or over ``--pcr-hint-rate``, which each tenant
  has to itself: the request's ``cache_salt``, else its ``extra_key``; or over its caller's
  rate, ``CALLER_RATE_FACTOR`` times that). Under TP every rank
  registers it at the clock the ranks agree on. Retracted re-queues and
  requests already finishing pass through untouched.

SGLang 0.5.23 carries the field to ``Req.kv_hints`` and implements no action itself.

The scheduler loop's collaborator for them (registration, the agreed clock, promotion to
the device) is :class:`~pcr_sglang.sglang_adapter.hints.KvHints`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import msgspec

from pcr_sglang.core.hints import CALLER_FIELD, DEFAULT_CALLER, HintError, hint_payload, is_hint_action

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


def request_caller(request: Any) -> str:
    """Who sent an HTTP request, as far as the server can tell: its connection's peer host
    (``request``: the route's ``fastapi.Request``; None for the Engine's own requests)."""
    client = getattr(request, "client", None) if request is not None else None
    host = getattr(client, "host", None)
    return f"peer:{host}" if host else DEFAULT_CALLER


def _with_caller(envelope: Any, caller: str) -> Any:
    if envelope is None or not any(is_hint_action(a) for a in envelope.actions):
        return envelope
    actions = [
        msgspec.structs.replace(a, payload={**a.payload, CALLER_FIELD: caller})
        if is_hint_action(a) and isinstance(a.payload, dict)
        else a
        for a in envelope.actions
    ]
    return msgspec.structs.replace(envelope, actions=actions)


def stamp_caller(result: Any, manager: Any, obj: Any, request: Any = None, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager._init_req_state(obj, request)``: every hint action of the
    request (one envelope, or one per prompt of a batch) names the request's caller,
    whatever the client wrote there."""
    hints = getattr(obj, "kv_hints", None)
    if hints is None:
        return None
    # mutant: hint-caller-taken-from-the-client
    caller = request_caller(request)
    if isinstance(hints, list):
        obj.kv_hints = [_with_caller(e, caller) for e in hints]
    else:
        obj.kv_hints = _with_caller(hints, caller)
    return None


class HintRegistered:
    """The finish reason of a hint-only request (SGLang sends only ``to_json()`` on)."""

    def __init__(self, registered: bool):
        self.registered = registered
        self.message = "pcr: KV hint " + ("registered" if registered else "ignored")

    def to_json(self) -> dict[str, Any]:
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
