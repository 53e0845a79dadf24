"""The tokenizer manager's side of document reuse: bounds checked at the door, documents
warmed before the request that needs them.

* ``_validate_one_request`` (AFTER): ``custom_params["pcr_doc_bounds"]`` must describe the
  prompt's tokens; bad bounds raise ``ValueError``, which SGLang's HTTP server returns as
  400 naming the problem. Checked whether or not the server has document reuse on.
* ``_send_one_request`` (AROUND): with ``--pcr-doc-reuse`` on, a request marking
  documents first has the canonical sequence ``S ‖ d ‖ pad`` of each of its documents
  prefilled (one ``max_new_tokens=0`` request each, concurrently, at the request's
  priority, under its ``extra_key`` and ``cache_salt``), so it reuses them all itself. A
  document warmed in the last ``WARM_TTL_S`` seconds is not warmed again (a prefill of a
  cached chain costs little, but not nothing); one being warmed is waited for, not sent
  twice. A failed warm-up only costs reuse: the request is served either way.

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
    DOC_MODE_PARAM,
    DocBoundsError,
    canonical_tokens,
    parse_doc_bounds,
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
    mode = custom.get(DOC_MODE_PARAM, "concat")
    if mode not in ("off", "concat"):
        raise ValueError(f"{DOC_MODE_PARAM} must be 'off' or 'concat', got {mode!r}")
    if input_ids is None:
        raise ValueError(f"{DOC_BOUNDS_PARAM} needs a token prompt (input_ids or text)")
    try:
        parse_doc_bounds(custom[DOC_BOUNDS_PARAM], len(input_ids))
    except DocBoundsError as e:
        raise ValueError(str(e)) from None
    return None


class DocWarmer:
    def __init__(self, chunk_size: int, pad_token_id: int, ttl_s: float = WARM_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
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

    async def warm(self, manager: Any, tokenized: Any) -> None:
        """Prefill the canonical sequences ``tokenized`` needs, and wait for them."""
        custom = _custom_params(tokenized) or {}
        if custom.get(DOC_MODE_PARAM, "concat") == "off" or getattr(tokenized, "lora_id", None):
            return
        tokens = list(tokenized.input_ids)
        try:
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
            future = asyncio.ensure_future(self._prefill(manager, canonical, extra_key, salt,
                                                         getattr(tokenized, "priority", None)))
            self._in_flight[key] = future
            future.add_done_callback(lambda f, key=key: self._done(key, f))
            waits.append(future)
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)

    def _done(self, key: bytes, future: asyncio.Future) -> None:
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

    async def _prefill(self, manager: Any, canonical: list[int], extra_key: Optional[str],
                       salt: Optional[str], priority: Optional[int]) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        self.sent += 1
        obj = GenerateReqInput(
            input_ids=canonical,
            sampling_params={"max_new_tokens": 0, "temperature": 0.0,
                             "custom_params": {CANONICAL_PARAM: 1}},
            extra_key=extra_key, cache_salt=salt, priority=priority,
        )
        async for _ in manager.generate_request(obj, None):
            pass


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
    warmer = DocWarmer(int(args.pcr_chunk_size), doc_pad_token_id(hf_config))
    manager._pcr_doc_warmer = warmer
    return warmer


async def send_after_warming(original: Callable[..., Any], manager: Any, tokenized: Any, *args: Any,
                             **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager._send_one_request``."""
    custom = _custom_params(tokenized)
    if custom and DOC_BOUNDS_PARAM in custom and getattr(tokenized, "input_ids", None) is not None:
        warmer = _warmer_for(manager)
        if warmer is not None:
            try:
                await warmer.warm(manager, tokenized)
            except Exception:  # never lose the request over its warm-up
                logger.exception("PCR document reuse: warming failed; the request is served without it")
    return await original(manager, tokenized, *args, **kwargs)
