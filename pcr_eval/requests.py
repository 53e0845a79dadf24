"""What a measurement sends a document-reuse server and reads back: a question with its
documents marked and its mode asked for, the warm-up that caches every document's canonical
KV before it is measured, whether a reply reused every document, and the order ``reorder``
served. Each measurement runs under a cache namespace of its own (``extra_key``), so no mode
reads what another cached."""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from pcr_eval.gold import GoldPrompt
from pcr_eval.modes import ModeSpec


class Documents(Protocol):
    """A prompt's documents: both the questions' and the trace's prompts have them."""

    @property
    def doc_bounds(self) -> Sequence[int]: ...

    @property
    def last_doc_end(self) -> int: ...


def marked_request(p: GoldPrompt, spec: ModeSpec, max_new_tokens: int, extra_key: str, **custom: Any) -> dict[str, Any]:
    """A greedy ``/generate`` body for ``p`` with its documents marked, served as ``spec``
    (``custom``: more ``custom_params``), under the cache namespace ``extra_key``."""
    from pcr_client.prompt import DocPrompt

    sampling = DocPrompt(p.input_ids, p.doc_bounds).sampling_params(temperature=0.0, max_new_tokens=max_new_tokens)
    sampling["custom_params"].update({**spec.custom_params(), **custom})
    return {"input_ids": p.input_ids, "sampling_params": sampling, "extra_key": extra_key}


def all_docs_reused(p: Documents, spec: ModeSpec, cached_tokens: int, chunk_size: int = 1) -> bool:
    """Whether a marked request reused every document: its cached tokens and the ones
    ``spec`` recomputes reach the last document's end. ``reorder``'s reuse is an exact
    prefix hit, matched in whole chunks (``chunk_size``, ``--pcr-chunk-size``): it reached
    the last whole chunk before the last document's end."""
    if spec.mode == "reorder":
        return cached_tokens >= p.last_doc_end - p.last_doc_end % max(1, chunk_size)
    return cached_tokens + spec.recomputed_if_all_reused(p.doc_bounds) == p.last_doc_end


def warm_request(p: GoldPrompt, spec: ModeSpec, extra_key: str) -> dict[str, Any]:
    """What a benchmark sends before measuring ``p`` in ``spec``: every document's
    canonical KV computed and cached, whatever the server's warm-up policy (a first
    sighting served by plain prefill would be cached exactly, and the measured request
    would reuse that exact prefix instead). ``reorder``: the documents once served in
    another order, the noise floor's (``shuffled_ids``), with no question after them, as
    a retriever returns them for another question; the measured request is then served
    in that order, its leading tokens and documents an exact prefix hit."""
    from pcr_client.prompt import DocPrompt
    from pcr_sglang.reuse.bounds import WARM_NOW_PARAM

    if spec.mode != "reorder":
        return marked_request(p, spec, 1, extra_key, **{WARM_NOW_PARAM: True})
    if not p.shuffled_bounds:
        raise ValueError(f"{p.rid}: reorder is measured after the shuffled order; this prompt has no shuffled bounds")
    ids = p.shuffled_ids[: p.shuffled_bounds[-1]]
    sampling = DocPrompt(ids, p.shuffled_bounds).sampling_params(temperature=0.0, max_new_tokens=1)
    sampling["custom_params"].update(spec.custom_params())
    return {"input_ids": ids, "sampling_params": sampling, "extra_key": extra_key}


def served_order(meta: dict[str, Any]) -> Optional[list[int]]:
    """``reorder``: the client's document indices in the order served (None: not reordered)."""
    from pcr_sglang.reuse.reorder import ORDER_META_KEY

    order = meta.get(ORDER_META_KEY)
    return [int(i) for i in order] if isinstance(order, list) else None
