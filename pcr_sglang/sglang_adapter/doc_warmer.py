"""The tokenizer manager's side of document reuse: bounds checked at the door, documents
warmed before the request that needs them.

* ``_validate_one_request`` (AFTER): ``custom_params["pcr_doc_bounds"]`` must describe the
  prompt's tokens; bad bounds raise ``ValueError``, which SGLang's HTTP server returns as
  400 naming the problem. Checked whether or not the server has document reuse on.
* ``_send_one_request`` and ``_send_batch_request`` (AROUND): with ``--pcr-doc-reuse`` on,
  a request marking documents first has the canonical sequence ``S ‖ d ‖ pad`` of each of
  its documents prefilled (one ``max_new_tokens=0`` request each, concurrently, at the
  request's priority, under its ``extra_key`` and ``cache_salt``), so it reuses them all
  itself. A document warmed in the last ``WARM_TTL_S`` seconds is not warmed again (a
  prefill of a cached chain costs little, but not nothing); one being warmed is waited
  for, not sent twice. A failed warm-up only costs reuse: the request is served either way.

The warm-up requests are sent below ``generate_request``: the marked request already holds
the tokenizer manager's pause condition and model-update reader lock, and taking them
again would deadlock against a waiting writer (a weight update) or an abort-mode pause.
An abort of the marked request that arrives while it is warming reaches a scheduler that
does not have it yet, so it is sent again right after the request.

This is the "as part of the request" choice of computing a document's canonical KV the
first time it is seen at a later position: the request pays roughly the prefill it would
have paid anyway (its documents, computed one by one instead of in sequence), and every
later request finds them cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

from pcr_sglang.core.doc_reuse import (
    CANONICAL_PARAM,
    DOC_BOUNDS_PARAM,
    DocBoundsError,
    Recompute,
    canonical_tokens,
    parse_doc_bounds,
    request_recompute,
)

logger = logging.getLogger(__name__)

WARM_TTL_S = 30.0
_MAX_REMEMBERED = 1 << 16


def _custom_params(obj: Any) -> Optional[dict]:
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, dict):
        return params.get("custom_params")
    return getattr(params, "custom_params", None)


def validate_doc_bounds(result: Any, manager: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager._validate_one_request``."""
    custom = _custom_params(obj)
    if not custom or DOC_BOUNDS_PARAM not in custom:
        return None
    if input_ids is None:
        raise ValueError(f"{DOC_BOUNDS_PARAM} needs a token prompt (input_ids or text)")
    try:
        request_recompute(custom, server_recompute(getattr(manager, "server_args", None)))
        parse_doc_bounds(custom[DOC_BOUNDS_PARAM], len(input_ids))
    except DocBoundsError as e:
        raise ValueError(str(e)) from None
    return None


def server_recompute(args: Any) -> Recompute:
    """The server's document-reuse mode and K/R (mode ``off`` without PCR or the flag)."""
    if not getattr(args, "enable_pcr", False):
        return Recompute("off")
    from pcr_sglang.config import PCRConfig

    return PCRConfig.from_server_args(args).doc_recompute()


class DocWarmer:
    def __init__(self, chunk_size: int, pad_token_id: int, server: Recompute = Recompute(),
                 ttl_s: float = WARM_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.server = server
        self.chunk = chunk_size
        self.pad_token_id = pad_token_id
        self.ttl_s = ttl_s
        self.clock = clock
        self._warmed: OrderedDict[bytes, float] = OrderedDict()
        self._in_flight: dict[bytes, asyncio.Future] = {}
        self.sent = 0
        self.failed = 0

    def _key(self, tokens: list[int], extra_key: Optional[str], cache_salt: Optional[str]) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((extra_key, cache_salt)).encode())
        digest.update(b"|")
        digest.update(",".join(map(str, tokens)).encode())
        return digest.digest()

    async def warm(self, manager: Any, tokenized: Any, send: Callable[..., Any]) -> None:
        """Prefill the canonical sequences ``tokenized`` needs, and wait for them."""
        custom = _custom_params(tokenized) or {}
        tokens = list(tokenized.input_ids)
        try:
            if request_recompute(custom, self.server) is None or getattr(tokenized, "lora_id", None):
                return
            spans = parse_doc_bounds(custom[DOC_BOUNDS_PARAM], len(tokens))
        except DocBoundsError:
            return  # checked at validation; the scheduler serves it without reuse
        extra_key, salt = getattr(tokenized, "extra_key", None), getattr(tokenized, "cache_salt", None)
        now = self.clock()
        waits = []
        for span in spans:
            canonical = canonical_tokens(tokens, span, spans[0].start, self.chunk, self.pad_token_id)
            key = self._key(canonical, extra_key, salt)
            if key in self._in_flight:
                waits.append(self._in_flight[key])
                continue
            warmed = self._warmed.get(key)
            if warmed is not None and now - warmed < self.ttl_s:
                continue
            future = asyncio.ensure_future(self._prefill(manager, send, canonical, extra_key, salt,
                                                         getattr(tokenized, "priority", None)))
            self._in_flight[key] = future
            future.add_done_callback(lambda f, key=key: self._done(key, f))
            waits.append(future)
        if waits:  # shielded: a waiter cancelled (its client gone) must not cancel another's warm-up
            await asyncio.gather(*(asyncio.shield(w) for w in waits), return_exceptions=True)

    def _done(self, key: bytes, future: asyncio.Future) -> None:
        """Remember a warm-up that completed; a failed or aborted one is tried again next time."""
        self._in_flight.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            self.failed += 1
            if not future.cancelled():
                logger.warning("PCR document reuse: warming a document failed: %s", future.exception())
            return
        self._warmed[key] = self.clock()
        self._warmed.move_to_end(key)
        while len(self._warmed) > _MAX_REMEMBERED:
            self._warmed.popitem(last=False)

    async def _prefill(self, manager: Any, send: Callable[..., Any], canonical: list[int],
                       extra_key: Optional[str], salt: Optional[str], priority: Optional[int]) -> None:
        """One canonical prefill, through the steps of ``generate_request`` without its
        locks (the marked request holds them)."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        self.sent += 1
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
    if not getattr(args, "enable_pcr", False) or getattr(args, "pcr_doc_reuse", "off") == "off":
        manager._pcr_doc_warmer = False
        return None
    from pcr_sglang.sglang_adapter.doc_reuse_setup import doc_pad_token_id

    hf_config = getattr(getattr(manager, "model_config", None), "hf_config", None)
    warmer = DocWarmer(int(args.pcr_chunk_size), doc_pad_token_id(hf_config), server_recompute(args))
    manager._pcr_doc_warmer = warmer
    return warmer


def _marked(tokenized: Any) -> bool:
    custom = _custom_params(tokenized)
    return bool(custom) and DOC_BOUNDS_PARAM in custom and getattr(tokenized, "input_ids", None) is not None


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


async def send_after_warming(original: Callable[..., Any], manager: Any, tokenized: Any, *args: Any,
                             **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager._send_one_request``."""
    if not _marked(tokenized):
        return await original(manager, tokenized, *args, **kwargs)
    await _warm_all(manager, [tokenized], original)
    result = await original(manager, tokenized, *args, **kwargs)
    _resend_aborts(manager, [tokenized])
    return result


async def send_batch_after_warming(original: Callable[..., Any], manager: Any, tokenized_objs: Any, *args: Any,
                                   **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager._send_batch_request`` (batches of token prompts)."""
    marked = [t for t in tokenized_objs if _marked(t)]
    if not marked:
        return await original(manager, tokenized_objs, *args, **kwargs)
    await _warm_all(manager, marked, type(manager)._send_one_request)
    result = await original(manager, tokenized_objs, *args, **kwargs)
    _resend_aborts(manager, marked)
    return result
