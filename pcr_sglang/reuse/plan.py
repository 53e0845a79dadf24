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
``blend`` (CacheBlend) recomputes the R share of re-placed tokens its selector ranks first
(by default those whose KV deviates most from full prefill's; the adapter's probe measures
that, ``reuse/blend_select.py``). SGLang extends a contiguous suffix of
a request's row, so the recomputed tokens move behind the kept ones:
``row = [exact prefix ‖ kept reused tokens ‖ recomputed tokens ‖ the rest]``, each
computed at its true position under a position-causal mask (:class:`RowOrder`). The same
row carries *gaps*: a document whose canonical KV is not cached, after a reused one, is
computed in place like recomputed tokens, and the documents after it are still reused (a
prefix of cached documents would stop at the first new one).

This module plans over the spans :mod:`pcr_sglang.reuse.bounds` parses; the adapter copies
(:mod:`pcr_sglang.reuse.placement`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from pcr_sglang.core.keys import ChunkKey, chunk_keys
from pcr_sglang.reuse.bounds import DEFAULT_SELECTOR, DocSpan, Recompute


def canonical_tokens(
    tokens: Sequence[int], span: DocSpan, leading_len: int, chunk_size: int, pad_token_id: int
) -> list[int]:
    """``S ‖ d ‖ pad``: the sequence whose chain holds document ``span``'s canonical KV."""
    body = list(tokens[:leading_len]) + list(tokens[span.start : span.end])
    return body + [pad_token_id] * (-len(body) % chunk_size)


def canonical_chain_keys(
    root: ChunkKey, tokens: Sequence[int], spans: Sequence[DocSpan], chunk_size: int, pad_token_id: int
) -> list[list[ChunkKey]]:
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
        body = tail + list(tokens[span.start : span.end])
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
    # planning for ``lego``; chosen at admission for ``blend``, by its selector's probe).
    recompute_count: int = 0
    recompute: tuple[int, ...] = ()
    gaps: tuple[tuple[int, int], ...] = ()  # request ranges [start, end) with no cached KV
    # ``blend`` with anchor tokens: positions recomputed whatever their score (part of
    # ``recompute_count``; the adapter picks the rest).
    anchors: tuple[int, ...] = ()
    selector: str = DEFAULT_SELECTOR  # blend: what ranks the rest (SELECTORS)
    question_end: Optional[int] = None  # the question selectors' question ends here (None: the input's end)

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


def plan_reuse(
    spans: Sequence[DocSpan],
    exact_len: int,
    limit: int,
    canonical_cached: Callable[[DocSpan], bool],
    fill_gaps: bool = False,
) -> Optional[ReusePlan]:
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
        return tuple(
            p for s in plan.segments if s.delta != 0 for p in range(s.start, min(s.end, firsts[s.doc] + tokens))
        )

    anchors: tuple[int, ...] = ()
    if recompute.mode == "lego":
        chosen = leading(recompute.tokens)
        count = len(chosen)
    else:
        rotated = plan.rotated_tokens
        chosen, count = (), min(rotated, int(round(recompute.ratio * rotated)))
        # Anchors fill the budget in document order; the budget never grows for them.
        # mutant: blend-anchors-overrun-the-budget
        anchors = leading(recompute.anchor_tokens)[:count] if recompute.anchor_tokens else ()
    if count == 0:
        return plan
    if count >= plan.reused_tokens:
        return None
    return replace(
        plan,
        recompute_count=count,
        recompute=chosen,
        anchors=anchors,
        selector=recompute.selector,
        question_end=recompute.question_end,
    )


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
        inside = list(self.positions[max(begin - self.start, 0) : max(min(end, self.end) - self.start, 0)])
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
