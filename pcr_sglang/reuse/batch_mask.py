"""The position mask of a batch being formed: whether one more request may join it.

SGLang's Triton extend kernel takes one position mask over every request of a forward that
carries a permuted row (:func:`pcr_sglang.reuse.rows.triton_position_mask`: a byte per
query and key of each request's extend), so the requests batched beside a permuted row add
their parts to it. Placement holds a permuted row's own part to ``--pcr-position-mask-mb``
(:func:`own_mask_bound`); admission holds the whole mask to it: a request that could take a
batch's mask past the budget, in a batch that carries a permuted row or with a plan that
may permute its own, waits for a later batch (the adapter asks :meth:`BatchMask.holds` in
SGLang's ``PrefillAdder.add_one_req``). A batch's first request is never held: its own
bound is placement's check, and nothing then keeps it waiting for ever.

Pure bookkeeping: the adapter reads SGLang's adder and requests and hands the numbers here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pcr_sglang.req import PcrReq
from pcr_sglang.reuse.plan import ReusePlan
from pcr_sglang.reuse.rows import position_mask_bytes, row_mask_bound


def needs_position_mask(plan: ReusePlan) -> bool:
    """Whether serving ``plan`` permutes the request's row (recomputed or gap tokens inside
    it): its forward then takes the position mask."""
    return bool(plan.recompute_count or plan.gaps)


def input_length(req: PcrReq) -> int:
    """All of ``req``'s tokens so far (its prompt and what it generated): the most keys
    its part of a mask can have, known before SGLang matches it."""
    return len(req.origin_input_ids) + len(getattr(req, "output_ids", None) or ())


def own_mask_bound(req: PcrReq, plan: ReusePlan) -> int:
    """The most bytes ``req``'s own part of the mask can take once ``plan`` is placed: its
    extend past the reused tokens over all its tokens (:func:`rows.row_mask_bound`)."""
    return row_mask_bound(plan.start + plan.prefix_tokens, input_length(req))


def extend_bound(prefix: int, total: int, chunk: Optional[int]) -> int:
    """The most bytes a request's part of the mask can take in the coming forward: its
    extend starts at ``prefix`` or later (admission only grows it: a host hit, reused
    documents), takes at most ``total - prefix`` tokens and, under chunked prefill, at
    most ``chunk`` (the adder's chunk budget left), over keys up to ``total``."""
    extend = max(total - prefix, 0)
    if chunk is not None:
        extend = min(extend, max(chunk, 0))
    return extend * total


@dataclass(frozen=True)
class MaskCandidate:
    """A request the adder is about to try: what its part of the mask can take at most
    (:func:`extend_bound`), and whether it may get a permuted row itself."""

    bound: int
    may_permute: bool


@dataclass
class BatchMask:
    """The requests of one batch being formed, in the order the adder committed them: the
    bytes their parts of the mask take and whether any row among them is permuted."""

    budget: int  # --pcr-position-mask-mb, in bytes
    bytes: int = 0
    permuted: bool = False
    counted: int = 0  # the batch's first requests counted so far

    def add(self, prefix: int, end: int, permuted: bool) -> None:
        """A committed request extends ``[prefix, end)`` (``permuted``: its row is)."""
        self.bytes += position_mask_bytes([prefix], [max(end - prefix, 0)])
        self.permuted = self.permuted or permuted
        self.counted += 1

    def holds(self, candidate: MaskCandidate) -> bool:
        """Whether ``candidate`` waits for a later batch: with it the mask of a forward with
        a permuted row could exceed the budget. Never a batch's first request."""
        if self.counted == 0 or not (self.permuted or candidate.may_permute):
            return False
        # mutant: batch-position-mask-unbounded
        return self.bytes + candidate.bound > self.budget
