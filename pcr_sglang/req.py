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
    extra_key: Optional[str]
    cache_salt: Optional[str]
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
