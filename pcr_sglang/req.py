"""The parts of SGLang's ``Req`` (``sglang.srt.managers.schedule_batch``) PCR reads and writes.

Typed as :class:`typing.Protocol`\\ s, not imported: the adapter and the document-reuse
wing are then typed against what they use (a renamed field in a new SGLang shows in one
place, not as an ``AttributeError`` in the scheduler loop), and the unit tests' lightweight
requests satisfy the same contract. On the ground floor, so that both import it. Attributes
that only some SGLang requests carry (``positional_embed_overrides``,
``_compute_max_prefix_len``) are read with ``getattr`` where they are used and are not part
of it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from pcr_sglang.core.keys import RequestTenant


class PcrReqKv(Protocol):
    """``Req.kv``: where the request's KV row is, and how much of it the tree owns."""

    req_pool_idx: Optional[int]
    cache_protected_len: int


class PcrSamplingParams(Protocol):
    custom_params: Optional[dict[str, Any]]


class PcrReq(Protocol):
    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]
    extra_key: Optional[str]  # SGLang's: the client's extra_key with the LoRA id appended
    cache_salt: Optional[str]
    lora_id: Optional[str]
    sampling_params: PcrSamplingParams
    kv: PcrReqKv
    # Set by the prefix cache's match (SGLang's ``init_next_round_input``).
    last_node: Any
    prefix_len: int
    # SGLang's split of the cached tokens, reported in the response (read at admission).
    cached_tokens_device: int
    cached_tokens_host: int
    cached_tokens_storage: int
    # Written by a load that read chunks from the SSD tier (SGLang's ``storage`` hits).
    storage_hit_length: int
    storage_hit_start: int


def request_tenant(req: Any) -> RequestTenant:
    """The fields ``req``'s chain root folds in, apart.

    SGLang 0.5.23 makes ``req.extra_key`` the client's ``extra_key`` with the LoRA id
    appended and no separator (``Req.__init__``), so a client without an adapter that sends
    an adapter's id as its ``extra_key`` gets the same string as that adapter's requests.
    The adapter's id is taken back off here and keyed as a field of its own, which only the
    server sets. (A suffix SGLang adds after it, as elastic EP's namespace, leaves the
    string whole: still apart from every request without that adapter.)"""
    extra_key = req.extra_key
    lora_id = getattr(req, "lora_id", None)
    if lora_id is not None and extra_key is not None and extra_key.endswith(lora_id):
        extra_key = extra_key[: len(extra_key) - len(lora_id)] or None
    # mutant: lora-id-keyed-inside-the-clients-extra-key
    return RequestTenant(extra_key=extra_key, cache_salt=req.cache_salt, lora_id=lora_id)
