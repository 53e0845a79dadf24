"""Document KV reuse in any order: where a request's documents are, and what can be reused.

A RAG prompt is ``S ‖ d_1 ‖ ... ‖ d_n ‖ question``, where ``S`` is everything before the
first document (BOS, system prompt, template). A document's *canonical* KV is the KV of
``S ‖ d``: the document computed right after the request's leading tokens. That is an
ordinary prefix-tree chain, so it lives in the tiers PCR already has (device, host, SSD,
warm restart); nothing here is a second store. To end on the chunk grid (only whole chunks
are cached), the canonical sequence is ``S ‖ d ‖ pad``: the pad tokens' KV is cached
but never copied, so a document is reused from its first token to its last, at any
offset, and no reuse is lost at the chunk seams.

A request that reuses ``d_i`` at offset ``s_i`` gets the canonical KV copied into its own
slots with K rotated by ``s_i - |S|`` (RoPE composes: ``R(p + δ) = R(δ) R(p)``). For the
first document (``s_1 == |S|``) the delta is 0 and the copy is exactly the KV prefix
caching would have given: the request's KV stays exact up to the end of that document.
Past it, KV is *blended* (later documents did not attend to earlier ones), so it is
never entered into the prefix tree: a request that does not ask for document reuse must
still get the no-cache output token for token.

Recompute modes repair part of the blend. ``lego`` (EPIC's LegoLink) recomputes the first
K tokens of each re-placed document, whose canonical KV made them attention sinks;
``blend`` (CacheBlend) recomputes the R share of re-placed tokens whose layer-1 KV deviates
most from full prefill's (the adapter measures that). SGLang extends a contiguous suffix of
a request's row, so the recomputed tokens move behind the kept ones:
``row = [exact prefix ‖ kept reused tokens ‖ recomputed tokens ‖ the rest]``, each
computed at its true position under a position-causal mask (:class:`RowOrder`). The same
row carries *gaps*: a document whose canonical KV is not cached, after a reused one, is
computed in place like recomputed tokens, and the documents after it are still reused (a
prefix of cached documents would stop at the first new one).

This module only parses and plans; the adapter copies (``sglang_adapter/doc_reuse``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

from pcr_sglang.core.keys import ChunkKey, chunk_keys

CUSTOM_PARAMS_FIELD = "sampling_params.custom_params"
DOC_BOUNDS_PARAM = "pcr_doc_bounds"
DOC_MODE_PARAM = "pcr_doc_reuse"
RECOMPUTE_TOKENS_PARAM = "pcr_doc_recompute_tokens"
RECOMPUTE_RATIO_PARAM = "pcr_doc_recompute_ratio"
# ``blend``: the first N tokens of each re-placed document always recomputed, inside the R
# budget; the rest of the budget by deviation (the "hybrid" selector).
ANCHOR_TOKENS_PARAM = "pcr_doc_anchor_tokens"
# ``blend``: what ranks the re-placed tokens: ``deviation`` (CacheBlend: layer-1 V against
# full prefill's) or ``query`` (the question's layer-1 attention on each token).
SELECTOR_PARAM = "pcr_doc_selector"
SELECTORS = ("deviation", "query")
# ``query`` selector: where the question ends (a token offset; default: the end of the
# input). A client that teacher-forces an answer after the prompt sets it to the prompt's
# length, so the selection sees the question alone, as it does when the answer is generated.
QUESTION_END_PARAM = "pcr_doc_question_end"
CANONICAL_PARAM = "pcr_canonical_doc"
# ``True``: warm this request's documents before it, whatever the server's warm-up policy
# (what ``python -m pcr_tools.precompute`` sends: a precomputed document is seen once).
WARM_NOW_PARAM = "pcr_doc_warm"

SERVER_MODES = ("concat", "lego", "blend")
RECOMPUTE_MODES = ("lego", "blend")
# What a marked request may ask for in ``custom_params["pcr_doc_reuse"]`` (default: the server's).
REQUEST_MODES = ("off", *SERVER_MODES)


class DocBoundsError(ValueError):
    """A request's ``pcr_doc_bounds`` cannot describe its tokens (or it asks for an unknown mode)."""


@dataclass(frozen=True)
class DocLimits:
    """What one request may ask of document reuse (``--pcr-doc-max-documents``,
    ``--pcr-doc-min-tokens``). Every marked document costs work whatever its length: its
    canonical chain is hashed and matched (every scheduler step while the request waits),
    stored padded to whole chunks, and warmed by a prefill of the leading tokens plus
    itself. So both the count and a floor on the length are bounded."""

    max_documents: int
    min_tokens: int


def doc_params(custom_params: Any) -> Optional[dict]:
    """A request's ``custom_params`` as the dict PCR reads (None when absent or empty).
    SGLang declares it a dict but does not check; anything else is refused, naming the
    field, before a ``pcr_*`` key is looked up in it (``"pcr_doc_bounds" in "xpcr_doc_boundsx"``
    is a substring test, not a key lookup)."""
    if custom_params is None:
        return None
    if not isinstance(custom_params, dict):
        raise DocBoundsError(f"{CUSTOM_PARAMS_FIELD} must be an object of named parameters, "
                             f"got {type(custom_params).__name__}")
    return custom_params or None


@dataclass(frozen=True)
class Recompute:
    """How a request's re-placed documents are repaired: ``concat`` not at all, ``lego`` the
    first ``tokens`` of each document, ``blend`` a ``ratio`` share of their tokens (with
    ``anchor_tokens``: each document's first ones among them, the rest by deviation)."""

    mode: str = "concat"
    tokens: int = 0
    ratio: float = 0.0
    anchor_tokens: int = 0
    selector: str = "deviation"
    question_end: Optional[int] = None  # per request (QUESTION_END_PARAM); None: the input's end

    @property
    def recomputes(self) -> bool:
        return (self.mode == "lego" and self.tokens > 0) or (self.mode == "blend" and self.ratio > 0)


def request_mode(custom_params: dict, server_mode: str = "concat") -> str:
    """The document-reuse mode a request's ``custom_params`` ask for (default: the server's).
    Recompute modes need a server started in one (its attention computes permuted rows)."""
    custom_params = doc_params(custom_params) or {}
    mode = custom_params.get(DOC_MODE_PARAM, server_mode)
    if mode not in REQUEST_MODES:
        raise DocBoundsError(f"{DOC_MODE_PARAM} must be one of {', '.join(map(repr, REQUEST_MODES))}, got {mode!r}")
    if mode in RECOMPUTE_MODES and server_mode not in RECOMPUTE_MODES:
        raise DocBoundsError(f"{DOC_MODE_PARAM}={mode!r} recomputes tokens: this server runs --pcr-doc-reuse "
                             f"{server_mode}; start it with --pcr-doc-reuse lego or blend")
    return mode


def request_recompute(custom_params: dict, server: Recompute) -> Optional[Recompute]:
    """The request's mode and its K or R (``pcr_doc_recompute_tokens`` / ``_ratio`` override
    the server's), or None for ``off``. Raises :class:`DocBoundsError` for bad values."""
    custom_params = doc_params(custom_params) or {}
    mode = request_mode(custom_params, server.mode)
    if mode == "off":
        return None
    tokens = custom_params.get(RECOMPUTE_TOKENS_PARAM, server.tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise DocBoundsError(f"{RECOMPUTE_TOKENS_PARAM} must be an integer >= 0, got {tokens!r}")
    ratio = custom_params.get(RECOMPUTE_RATIO_PARAM, server.ratio)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise DocBoundsError(f"{RECOMPUTE_RATIO_PARAM} must be a number in [0, 1], got {ratio!r}")
    anchors = custom_params.get(ANCHOR_TOKENS_PARAM, server.anchor_tokens)
    if isinstance(anchors, bool) or not isinstance(anchors, int) or anchors < 0:
        raise DocBoundsError(f"{ANCHOR_TOKENS_PARAM} must be an integer >= 0, got {anchors!r}")
    selector = custom_params.get(SELECTOR_PARAM, server.selector)
    if selector not in SELECTORS:
        raise DocBoundsError(f"{SELECTOR_PARAM} must be one of {', '.join(map(repr, SELECTORS))}, got {selector!r}")
    question_end = custom_params.get(QUESTION_END_PARAM)
    if question_end is not None and (isinstance(question_end, bool) or not isinstance(question_end, int)
                                     or question_end < 1):
        raise DocBoundsError(f"{QUESTION_END_PARAM} must be a positive token offset, got {question_end!r}")
    return Recompute(mode, int(tokens), float(ratio), int(anchors), selector, question_end)


def request_warm_now(custom_params: dict) -> bool:
    """Whether the request asks for its documents to be warmed now (``pcr_doc_warm``)."""
    value = (doc_params(custom_params) or {}).get(WARM_NOW_PARAM, False)
    if not isinstance(value, bool):
        raise DocBoundsError(f"{WARM_NOW_PARAM} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class DocSpan:
    """Document ``index`` covers request tokens ``[start, end)``."""

    index: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def parse_doc_bounds(raw: object, num_tokens: int, limits: Optional[DocLimits] = None) -> tuple[DocSpan, ...]:
    """Validate ``[s0, e0, s1, e1, ...]`` (flat token offsets into the prompt).

    Documents must be non-empty, sorted, non-overlapping, inside the prompt, and the first
    must not start at 0 (there is always a BOS or template before it; ``S`` may be empty
    only if the model has no BOS, which we do not assume); with ``limits`` (the server's),
    at most ``max_documents`` of them, each of at least ``min_tokens``. Raises
    :class:`DocBoundsError` naming the problem (and the flag of a limit), which the server
    returns as HTTP 400.
    """
    if not isinstance(raw, (list, tuple)):
        raise DocBoundsError(f"{DOC_BOUNDS_PARAM} must be a flat list of token offsets [s0, e0, s1, e1, ...], "
                             f"got {type(raw).__name__}")
    if len(raw) == 0 or len(raw) % 2:
        raise DocBoundsError(f"{DOC_BOUNDS_PARAM} must hold pairs of offsets [start, end), got {len(raw)} values")
    if limits is not None and len(raw) // 2 > limits.max_documents:
        raise DocBoundsError(f"{DOC_BOUNDS_PARAM} marks {len(raw) // 2} documents; this server takes at most "
                             f"{limits.max_documents} per request (--pcr-doc-max-documents)")
    values: list[int] = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DocBoundsError(f"{DOC_BOUNDS_PARAM} offsets must be integers, got {value!r}")
        values.append(value)
    spans: list[DocSpan] = []
    previous_end = 0
    for i in range(0, len(values), 2):
        start, end = values[i], values[i + 1]
        doc = i // 2
        if start < 0 or end > num_tokens:
            raise DocBoundsError(f"{DOC_BOUNDS_PARAM}: document {doc} [{start}, {end}) is outside the prompt's "
                                 f"{num_tokens} tokens")
        if end <= start:
            raise DocBoundsError(f"{DOC_BOUNDS_PARAM}: document {doc} [{start}, {end}) is empty or reversed")
        if start < previous_end:
            raise DocBoundsError(f"{DOC_BOUNDS_PARAM}: document {doc} starts at {start}, before the previous "
                                 f"document ends ({previous_end}): bounds must be sorted and not overlap")
        if doc == 0 and start == 0:
            raise DocBoundsError(f"{DOC_BOUNDS_PARAM}: the first document starts at token 0; the tokens before "
                                 "it (BOS, system prompt) are what every document's KV is computed behind")
        spans.append(DocSpan(doc, start, end))
        previous_end = end
    short = next((span for span in spans if span.length < limits.min_tokens), None) if limits is not None else None
    if short is not None:  # after the format: a malformed list is named as such first
        raise DocBoundsError(f"{DOC_BOUNDS_PARAM}: document {short.index} [{short.start}, {short.end}) has "
                             f"{short.length} tokens; this server takes documents of at least {limits.min_tokens} "
                             "(--pcr-doc-min-tokens)")
    return tuple(spans)


def canonical_tokens(tokens: Sequence[int], span: DocSpan, leading_len: int, chunk_size: int,
                     pad_token_id: int) -> list[int]:
    """``S ‖ d ‖ pad``: the sequence whose chain holds document ``span``'s canonical KV."""
    body = list(tokens[:leading_len]) + list(tokens[span.start:span.end])
    return body + [pad_token_id] * (-len(body) % chunk_size)


def canonical_chain_keys(root: ChunkKey, tokens: Sequence[int], spans: Sequence[DocSpan], chunk_size: int,
                         pad_token_id: int) -> list[list[ChunkKey]]:
    """Each document's canonical chain keys (``chunk_keys`` of :func:`canonical_tokens`),
    with ``S`` hashed once for all of them: every chain starts with the keys of ``S``'s
    whole chunks, and only the chunk straddling the seam needs ``S``'s last tokens again.
    So a request costs ``O(|S| + documents x (chunk + document))`` hashing, not
    ``O(documents x |S|)``."""
    if not spans:
        return []
    leading = spans[0].start
    whole = leading - leading % chunk_size
    shared = chunk_keys(root, tokens[:whole], chunk_size)
    parent = shared[-1] if shared else root
    tail = list(tokens[whole:leading])
    chains = []
    for span in spans:
        body = tail + list(tokens[span.start:span.end])
        body += [pad_token_id] * (-len(body) % chunk_size)
        chains.append(shared + chunk_keys(parent, body, chunk_size))
    return chains


@dataclass(frozen=True)
class CopySegment:
    """Request tokens ``[start, end)`` take the KV of canonical positions
    ``[source_start, source_start + end - start)`` of document ``doc``'s chain."""

    doc: int
    start: int
    end: int
    source_start: int

    @property
    def delta(self) -> int:
        return self.start - self.source_start

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReusePlan:
    """What a request reuses beyond its exact prefix: segments and ``gaps`` (computed in
    place, see :func:`plan_reuse`) cover ``[start, end)``; KV is exact (delta 0, right
    after ``S``) up to ``exact_end``."""

    segments: tuple[CopySegment, ...]
    start: int
    end: int
    exact_end: int
    # Recompute modes: how many re-placed tokens are recomputed, and which (known at
    # planning for ``lego``; chosen at admission for ``blend``, from measured deviation).
    recompute_count: int = 0
    recompute: tuple[int, ...] = ()
    gaps: tuple[tuple[int, int], ...] = ()  # request ranges [start, end) with no cached KV
    # ``blend`` with anchor tokens: positions recomputed whatever their deviation (part of
    # ``recompute_count``; the adapter picks the rest).
    anchors: tuple[int, ...] = ()
    selector: str = "deviation"  # blend: what ranks the rest (SELECTORS)
    question_end: Optional[int] = None  # the query selector's question ends here (None: the input's end)

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def gap_tokens(self) -> int:
        return sum(end - start for start, end in self.gaps)

    @property
    def reused_tokens(self) -> int:
        """Tokens the segments copy (recomputed ones included)."""
        return self.tokens - self.gap_tokens

    @property
    def prefix_tokens(self) -> int:
        """Tokens that join the request's cached prefix (recomputed and gap tokens are extended)."""
        return self.reused_tokens - self.recompute_count

    def gap_positions(self) -> list[int]:
        return [p for start, end in self.gaps for p in range(start, end)]

    def extended_positions(self) -> list[int]:
        """Positions inside ``[start, end)`` the request computes: recomputed and gap
        tokens, ascending (known once ``recompute`` is chosen)."""
        return sorted({*self.recompute, *self.gap_positions()})

    @property
    def rotated_tokens(self) -> int:
        return sum(s.length for s in self.segments if s.delta != 0)

    @property
    def docs(self) -> int:
        return len({s.doc for s in self.segments})

    def rotated_positions(self) -> list[int]:
        """Request positions whose KV is re-placed (delta != 0): what recompute may pick."""
        return [p for s in self.segments if s.delta != 0 for p in range(s.start, s.end)]


def plan_reuse(spans: Sequence[DocSpan], exact_len: int, limit: int,
               canonical_cached: Callable[[DocSpan], bool], fill_gaps: bool = False) -> Optional[ReusePlan]:
    """Extend an exact prefix of ``exact_len`` tokens with canonical document KV.

    Reuse starts where the exact prefix ends and goes document by document, never past
    ``limit`` (SGLang computes at least the last prompt token, and fewer with logprobs
    requested earlier). The leading tokens still missing from the exact prefix, if any,
    come from the first reused document's chain at delta 0 (every canonical chain starts
    with them). Tokens between reused documents that are nobody's cached canonical KV (a
    document not cached, or tokens between documents) are *gaps*: without ``fill_gaps``
    reuse stops at the first one; with it, a gap *after a reused document* is computed in
    place at its true positions (the row is permuted as for recompute, :class:`RowOrder`)
    and reuse goes on with the next cached document, so one new document no longer costs
    the reuse of every document after it. A gap right after the exact prefix still ends
    the plan: that request is prefilled in order, exactly, and its whole prefix enters the
    tree, where the next request with the same leading documents finds it (computed in a
    permuted row, its KV past the leading tokens would stay out of the tree, and its
    output would be blended although nothing before the new document was reused).
    Returns None when nothing beyond the exact prefix can be reused. ``canonical_cached``
    only looks (it is called while matching).
    """
    if not spans:
        return None
    leading = spans[0].start
    segments: list[CopySegment] = []
    gaps: list[tuple[int, int]] = []
    position = exact_len  # [exact_len, position) is planned: segments and gaps
    reused_document = False  # a gap is filled only behind a document reused here
    for span in spans:
        if span.end <= position:
            continue  # already inside the exact prefix
        if position >= limit:
            break
        filling = fill_gaps and reused_document
        if span.start > max(position, leading) and (not filling or span.start >= limit):
            break  # a gap: its tokens must be computed, and everything after them
        if not canonical_cached(span):
            if filling:
                continue  # computed in place, if a later document is reused
            break
        if position < leading:  # the tail of S, from this document's chain (exact)
            tail_end = min(leading, limit)
            segments.append(CopySegment(span.index, position, tail_end, position))
            position = tail_end
            if position >= limit:
                break
        if span.start > position:
            if span.start >= limit:
                break  # nothing after the gap could be reused
            gaps.append((position, span.start))
            position = span.start
        end = min(span.end, limit)
        segments.append(CopySegment(span.index, position, end, leading + position - span.start))
        position = end
        reused_document = True
    if position <= exact_len:
        return None
    exact_end = exact_len
    for segment in segments:
        if segment.delta != 0 or segment.start != exact_end:
            break
        exact_end = segment.end
    return ReusePlan(tuple(segments), exact_len, position, exact_end, gaps=tuple(gaps))


def with_recompute(plan: ReusePlan, spans: Sequence[DocSpan], recompute: Recompute) -> Optional[ReusePlan]:
    """``plan`` with the request's recompute set: ``lego`` the first ``tokens`` of each
    re-placed document, ``blend`` a count of ``ratio`` of the re-placed tokens (which ones
    the adapter picks at admission). Tokens at delta 0 are exact and never recomputed.
    None when nothing would be left to reuse (everything reused would be recomputed)."""
    if not recompute.recomputes:
        return plan
    firsts = {span.index: span.start for span in spans}

    def leading(tokens: int) -> tuple[int, ...]:
        return tuple(p for s in plan.segments if s.delta != 0
                     for p in range(s.start, min(s.end, firsts[s.doc] + tokens)))

    anchors: tuple[int, ...] = ()
    if recompute.mode == "lego":
        chosen = leading(recompute.tokens)
        count = len(chosen)
    else:
        rotated = plan.rotated_tokens
        chosen, count = (), min(rotated, int(round(recompute.ratio * rotated)))
        # Anchors fill the budget in document order; the budget never grows for them.
        anchors = leading(recompute.anchor_tokens)[:count] if recompute.anchor_tokens else ()
    if count == 0:
        return plan
    if count >= plan.reused_tokens:
        return None
    return replace(plan, recompute_count=count, recompute=chosen, anchors=anchors, selector=recompute.selector,
                   question_end=recompute.question_end)


@dataclass(frozen=True)
class RowOrder:
    """Where a recompute request's tokens sit in its row. SGLang extends a contiguous
    suffix of the row, so the recomputed tokens move behind the kept reused ones: row slots
    ``[start, start + len(positions))`` hold request positions ``positions`` (the kept,
    then the recomputed, each ascending); every other slot ``i`` holds position ``i``.
    Attention keys carry their RoPE already, so the order is free once each query sees
    exactly the keys at positions up to its own (the position-causal mask)."""

    start: int
    positions: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.positions)

    def positions_of_slots(self, begin: int, end: int) -> list[int]:
        """Request positions of row slots ``[begin, end)``."""
        inside = list(self.positions[max(begin - self.start, 0): max(min(end, self.end) - self.start, 0)])
        head = list(range(begin, min(end, self.start)))
        tail = list(range(max(begin, self.end), end))
        return head + inside + tail

    def permutes(self, begin: int, end: int) -> bool:
        """Whether row slots ``[begin, end)`` overlap the permuted part."""
        return begin < self.end and end > self.start


def row_order(plan: ReusePlan) -> Optional[RowOrder]:
    """The row of a plan whose recompute set is chosen (None when it computes nothing
    inside ``[start, end)``: neither recomputed nor gap tokens)."""
    extended = plan.extended_positions()
    if not extended:
        return None
    computed = set(extended)
    kept = [p for p in range(plan.start, plan.end) if p not in computed]
    return RowOrder(plan.start, tuple(kept + extended))
