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
  request is in flight, and the request is sent at once; ``auto`` (the default): as
  ``request`` while no other request is at the scheduler, else as ``idle``. One being warmed is waited for
  (``request``), not sent twice. A failed warm-up only costs reuse: the request is served
  either way. Warm-ups in flight are capped per request, per tenant and per server
  (:class:`~pcr_sglang.reuse.doc_warmer.WarmupCaps`; ``pcr_doc_warm: true`` obeys the same caps): the rest wait in this
  process for a free place, so one request marking many documents cannot flood the
  scheduler with prefills, and one tenant (a ``cache_salt``, which the client chooses)
  sending many such requests holds at most ``per_tenant`` of the server's places. A
  request waits for its warm-ups at most a small multiple of one warm-up prefill as
  recently measured (:class:`~pcr_sglang.reuse.doc_warmer.WarmupWait`), then is sent without the ones not done.

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
low-priority one; ``auto`` takes the first only where its wait delays no other request.
``bench/README.md`` ("The headline") measures them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

from pcr_sglang.flags import flag_value
from pcr_sglang.reuse import settings as reuse_settings
from pcr_sglang.reuse.bounds import (
    DOC_BOUNDS_PARAM,
    EXACT_MODES,
    DocBoundsError,
    DocLimits,
    Recompute,
    doc_params,
    parse_doc_bounds,
    request_recompute,
    request_warm_now,
)
from pcr_sglang.reuse.doc_warmer import DocWarmer, custom_params
from pcr_sglang.reuse.reorder import reorder_request

logger = logging.getLogger(__name__)


def validate_doc_bounds(result: Any, manager: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager._validate_one_request``."""
    try:
        custom = doc_params(custom_params(obj))
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
    warmer = DocWarmer(
        int(config.chunk_size),
        doc_pad_token_id(hf_config),
        reuse_settings.recompute(config),
        reuse_settings.warmup_policy(config),
        limits=reuse_settings.limits(config),
    )
    manager._pcr_doc_warmer = warmer
    return warmer


def _marked(tokenized: Any) -> bool:
    """A request whose documents may need warming: it marks them, and it will be computed
    (a hint-only KV hint is not: its documents' chains are read by the hint itself)."""
    custom = custom_params(tokenized)
    if not (
        isinstance(custom, dict) and DOC_BOUNDS_PARAM in custom and getattr(tokenized, "input_ids", None) is not None
    ):
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


async def send_after_warming(
    original: Callable[..., Any], manager: Any, tokenized: Any, *args: Any, **kwargs: Any
) -> Any:
    # mutant: reorder-not-applied-at-send
    """AROUND ``TokenizerManager._send_one_request``."""
    _reorder(manager, tokenized)
    if not _marked(tokenized):
        return await original(manager, tokenized, *args, **kwargs)
    await _warm_all(manager, [tokenized], original)
    result = await original(manager, tokenized, *args, **kwargs)
    _resend_aborts(manager, [tokenized])
    return result


async def send_batch_after_warming(
    original: Callable[..., Any], manager: Any, tokenized_objs: Any, *args: Any, **kwargs: Any
) -> Any:
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
