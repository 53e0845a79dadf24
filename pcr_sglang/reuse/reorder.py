"""``reorder``: the exact document-reuse mode. A request's marked documents are served in
an order this server already served them in, so their KV is an exact prefix hit and none
of it is approximated.

RAG retrievers return the same documents in another order from one question to the next.
``concat``/``lego``/``blend`` reuse each document's KV at its new place and approximate
(or partly recompute) what the new order changes. ``reorder`` changes the order instead:
when the request's documents are a permutation of a sequence served before under the same
leading tokens (or begin with a run of one), they are sent to the scheduler in that
sequence's order, and the prefix cache serves the leading tokens and that run exactly. The
question (everything after the last document) stays last, the leading tokens (everything
before the first) stay first, and the tokens between documents stay where they are (slot
``j``'s separator is the request's own). The documents that match no run follow in the
client's order. The answer can still differ from the client's order's answer, as full
prefill's does when its documents are shuffled; no KV is approximated.

Where: the tokenizer process, right before a marked request is sent to the scheduler
(:func:`reorder_request`, called from ``reuse/tokenizer.py``'s send hooks, which every
marked request passes through, documents sent as text included: by then they are token
ids with ``pcr_doc_bounds``). The request's tokens and bounds are replaced there; the
scheduler sees a request in mode ``reorder``, which it serves exactly (as ``off``). The
response says the order served: ``meta_info["pcr_doc_order"]``, the client's document
indices in served order (:func:`report_doc_order`).

What is remembered (:class:`OrderStore`, one per tokenizer process): per root (a hash of
the tenant, the client's ``extra_key``, ``cache_salt`` and LoRA adapter, as separate
length-prefixed fields, and of the leading tokens), the sequences served as a list of
``(separator before the slot, document)`` hashes, least recently used forgotten first, at
most :attr:`OrderLimits.max_sequences` in all and :attr:`OrderLimits.per_root` per root.
A tenant's orders are found only under its own root, so no tenant can steer another's
order or learn it from its own. The store is a guess about the prefix cache, never a
promise: a sequence evicted meanwhile only costs the hit, never exactness.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pcr_sglang.reuse.bounds import (
    DOC_BOUNDS_PARAM,
    REORDER_MODE,
    DocBoundsError,
    DocSpan,
    doc_params,
    parse_doc_bounds,
    request_mode,
)

logger = logging.getLogger(__name__)

ORDER_META_KEY = "pcr_doc_order"  # meta_info: the client's document indices in served order
_STATE_ATTR = "pcr_doc_order"  # on the tokenizer manager's ReqState of a reordered request
_STORE_ATTR = "_pcr_doc_order_store"
_HASH_BYTES = 16
_TOKEN_TYPECODE = "q"


@dataclass(frozen=True)
class OrderLimits:
    """How many served sequences the tokenizer process remembers: in all, and per root
    (tenant and leading tokens). A sequence is at most ``--pcr-doc-max-documents`` pairs
    of 16-byte hashes, so the store stays under a few MiB at the defaults."""

    max_sequences: int = 4096
    per_root: int = 64

    def __post_init__(self) -> None:
        if self.max_sequences < 1 or self.per_root < 1:
            raise ValueError(f"OrderLimits must be positive, got {self}")


@dataclass(frozen=True)
class Tenant:
    """Whose cache a request reads: SGLang keeps these apart in its prefix cache, so the
    orders are kept apart by the same fields."""

    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
    lora_id: Optional[str] = None
    lora_name: Optional[str] = None


@dataclass(frozen=True)
class Reordering:
    """What a request is served as: ``order[k]`` is the client's index of the document at
    slot ``k``; ``matched`` documents follow a sequence served before."""

    order: tuple[int, ...]
    input_ids: list[int]
    doc_bounds: list[int]
    matched: int

    @property
    def moved(self) -> bool:
        return any(i != k for k, i in enumerate(self.order))


@dataclass
class OrderStats:
    """What the store did: requests planned, requests following a served run (``hits``),
    requests whose documents it moved, and documents in the runs followed."""

    requests: int = 0
    hits: int = 0
    moved: int = 0
    matched_documents: int = 0


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    for part in parts:  # length-prefixed: no two field lists hash alike
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return array(_TOKEN_TYPECODE, tokens).tobytes()


def _field(value: Optional[str]) -> bytes:
    return b"\x00" if value is None else b"\x01" + str(value).encode()


def root_key(tenant: Tenant, leading: Sequence[int]) -> bytes:
    """The root a request's orders are remembered under."""
    # mutant: reorder-tenants-share-orders
    return _digest(
        b"pcr-doc-order-v1",
        _field(tenant.extra_key),
        _field(tenant.cache_salt),
        _field(tenant.lora_id),
        _field(tenant.lora_name),
        _tokens_bytes(leading),
    )


def _gaps(tokens: Sequence[int], spans: Sequence[DocSpan]) -> list[list[int]]:
    """The tokens before each slot's document, after the previous one (slot 0's: none;
    what precedes it is the leading part)."""
    return [[]] + [list(tokens[spans[j - 1].end : spans[j].start]) for j in range(1, len(spans))]


class OrderStore:
    """The served sequences of documents, per root, least recently used forgotten first."""

    def __init__(self, limits: OrderLimits = OrderLimits()):
        self.limits = limits
        self.stats = OrderStats()
        self._roots: OrderedDict[bytes, OrderedDict[tuple[bytes, ...], None]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def best_run(self, root: bytes, gap_hashes: Sequence[bytes], doc_hashes: Sequence[bytes]) -> list[int]:
        """The longest run of a remembered sequence the request's documents can follow from
        slot 0 (each slot's separator the same, each document one of the request's not yet
        placed): the request's document indices in that run's order. Ties: the most recent."""
        sequences = self._roots.get(root)
        if not sequences:
            return []
        n = len(doc_hashes)
        where: dict[bytes, list[int]] = {}
        for i, h in enumerate(doc_hashes):
            where.setdefault(h, []).append(i)
        best: list[int] = []
        best_seq: Optional[tuple[bytes, ...]] = None
        for seq in reversed(sequences):  # most recent first
            available = {h: list(ids) for h, ids in where.items()}
            run: list[int] = []
            for j, item in enumerate(seq[:n]):
                gap, doc = item[:_HASH_BYTES], item[_HASH_BYTES:]
                ids = available.get(doc)
                # mutant: reorder-run-ignores-separators
                if gap != gap_hashes[j] or not ids:
                    break
                run.append(ids.pop(0))
            if len(run) > len(best):
                best, best_seq = run, seq
                if len(best) == n:
                    break
        if best_seq is not None:
            sequences.move_to_end(best_seq)
            self._roots.move_to_end(root)
        return best

    def record(self, root: bytes, items: tuple[bytes, ...]) -> None:
        """Remember a served sequence: one it extends is replaced, one that extends it (or
        equals it) is only marked recent."""
        if not items:
            return
        sequences = self._roots.get(root)
        if sequences is None:
            sequences = self._roots[root] = OrderedDict()
        self._roots.move_to_end(root)
        for seq in list(sequences):
            if seq[: len(items)] == items:  # already covered
                sequences.move_to_end(seq)
                return
            if items[: len(seq)] == seq:  # the new one covers it
                del sequences[seq]
                self._size -= 1
        sequences[items] = None
        self._size += 1
        while len(sequences) > self.limits.per_root:
            sequences.popitem(last=False)
            self._size -= 1
        # mutant: reorder-store-unbounded
        while self._size > self.limits.max_sequences:
            oldest_root, oldest = next(iter(self._roots.items()))
            oldest.popitem(last=False)
            self._size -= 1
            if not oldest:
                del self._roots[oldest_root]

    def plan(self, tokens: Sequence[int], spans: Sequence[DocSpan], tenant: Tenant) -> Reordering:
        """The order to serve ``tokens`` in (its documents ``spans``), remembered as served."""
        spans = list(spans)
        gaps = _gaps(tokens, spans)
        gap_hashes = [_digest(_tokens_bytes(g)) for g in gaps]
        doc_hashes = [_digest(_tokens_bytes(tokens[s.start : s.end])) for s in spans]
        root = root_key(tenant, tokens[: spans[0].start])
        run = self.best_run(root, gap_hashes, doc_hashes)
        placed = set(run)
        order = tuple(run + [i for i in range(len(spans)) if i not in placed])
        ids = list(tokens[: spans[0].start])
        bounds: list[int] = []
        for slot, index in enumerate(order):
            ids += gaps[slot]
            span = spans[index]
            bounds += [len(ids), len(ids) + span.length]
            ids += tokens[span.start : span.end]
        ids += tokens[spans[-1].end :]
        self.record(root, tuple(gap_hashes[slot] + doc_hashes[index] for slot, index in enumerate(order)))
        result = Reordering(order, ids, bounds, len(run))
        self.stats.requests += 1
        self.stats.hits += bool(run)
        self.stats.moved += result.moved
        self.stats.matched_documents += len(run)
        return result


def _store_for(manager: Any) -> OrderStore:
    store = getattr(manager, _STORE_ATTR, None)
    if store is None:
        store = OrderStore()
        setattr(manager, _STORE_ATTR, store)
    return store


def _custom_params(tokenized: Any) -> Any:
    return getattr(getattr(tokenized, "sampling_params", None), "custom_params", None)


def reorder_request(manager: Any, tokenized: Any, server_mode: str) -> Optional[Reordering]:
    """A marked request in mode ``reorder`` (its own, or the server's ``server_mode``):
    its ``input_ids`` and ``pcr_doc_bounds`` replaced by those of the order to serve, which
    is noted on its request state for the response. Anything else is left as it is (None).
    Bounds were checked at validation; a request that cannot be read here is served as
    given."""
    try:
        custom = doc_params(_custom_params(tokenized))
        if not custom or DOC_BOUNDS_PARAM not in custom or request_mode(custom, server_mode) != REORDER_MODE:
            return None
        tokens = getattr(tokenized, "input_ids", None)
        if (
            tokens is None
            or getattr(tokenized, "input_embeds", None) is not None
            or getattr(tokenized, "mm_inputs", None)
        ):
            return None  # only plain token prompts: embeddings and media are placed by position
        spans = parse_doc_bounds(custom[DOC_BOUNDS_PARAM], len(tokens))  # its limits: checked at validation
    except DocBoundsError:
        return None
    tenant = Tenant(
        getattr(tokenized, "extra_key", None),
        getattr(tokenized, "cache_salt", None),
        _str_or_none(getattr(tokenized, "lora_id", None)),
        _str_or_none(getattr(tokenized, "lora_name", None)),
    )
    result = _store_for(manager).plan(list(tokens), spans, tenant)
    if result.moved:
        # New objects, never edits: the samples of a request (``n`` > 1) are shallow copies of
        # one tokenized request, sharing its ``sampling_params`` (and its custom_params dict).
        # mutant: reorder-bounds-without-tokens
        tokenized.input_ids = (
            array(tokens.typecode, result.input_ids) if isinstance(tokens, array) else list(result.input_ids)
        )
        # mutant: reorder-writes-the-samples-shared-sampling-params
        tokenized.sampling_params = copy.copy(tokenized.sampling_params)
        # mutant: reorder-edits-the-shared-custom-params
        tokenized.sampling_params.custom_params = {**custom, DOC_BOUNDS_PARAM: result.doc_bounds}
    state = getattr(manager, "rid_to_state", {}).get(getattr(tokenized, "rid", None))
    if state is not None:
        setattr(state, _STATE_ATTR, list(result.order))
    return result


def _str_or_none(value: Any) -> Optional[str]:
    return None if value is None else str(value)


async def report_doc_order(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager._stream_one_response``: a reordered request's outputs say
    the order served (``meta_info["pcr_doc_order"]``)."""
    state = kwargs.get("state", args[1] if len(args) > 1 else None)
    order = getattr(state, _STATE_ATTR, None)
    async for out in original(manager, *args, **kwargs):
        if order is not None and isinstance(out, dict) and isinstance(out.get("meta_info"), dict):
            out["meta_info"][ORDER_META_KEY] = list(order)
        yield out


def order_stats(manager: Any) -> Optional[OrderStats]:
    """The tokenizer process's reorder counts (None before its first reorder request)."""
    store = getattr(manager, _STORE_ATTR, None)
    return store.stats if store is not None else None


__all__ = [
    "ORDER_META_KEY",
    "OrderLimits",
    "OrderStats",
    "OrderStore",
    "Reordering",
    "Tenant",
    "reorder_request",
    "report_doc_order",
    "root_key",
]
