"""Admission under the position mask's budget: SGLang's prefill adder, one batch at a time.

SGLang forms each extend batch with one ``PrefillAdder``: the continuing chunked request
first (``add_chunked_req``), then waiting requests one by one (``add_one_req``), each
appended to ``adder.can_run_list`` when it is committed. Document placement decides
inside ``add_one_req`` (``init_load_back``) whether a request's row is permuted, and a
forward with a permuted row takes one position mask over all its requests. So, around
``add_one_req`` (``plugin._add_one_req``), :class:`MaskAdmission` keeps one
:class:`~pcr_sglang.reuse.batch_mask.BatchMask` per adder, keyed weakly by it (nothing is
put on SGLang's object): before the call it counts the requests committed since it last
looked and asks whether this one must wait for a later batch; it stays in the waiting
queue, and the pass ends there (the batch is full for masks; nothing behind it goes first,
so under SGLang's first-come order it is its batch's first soon). SGLang's mixed chunks
(decode rows joining the extend, their parts unknown at admission) are refused with
permuted rows instead (``refusals.permuted_row_flags``).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from pcr_sglang.reuse.batch_mask import (
    BatchMask,
    MaskCandidate,
    extend_bound,
    input_length,
    needs_position_mask,
    own_mask_bound,
)
from pcr_sglang.reuse.disabled import NoDocReuse
from pcr_sglang.reuse.doc_stats import DocReuseStats
from pcr_sglang.reuse.seam import DocReuseSeam


class MaskAdmission:
    """The batches being formed, by adder, while document reuse may permute a row."""

    def __init__(self) -> None:
        self.docs: DocReuseSeam = NoDocReuse()
        self.stats: Optional[DocReuseStats] = None  # where mask_batch_held is counted
        self._batches: weakref.WeakKeyDictionary[Any, BatchMask] = weakref.WeakKeyDictionary()

    def hold(self, adder: Any, req: Any, count: bool = True, before_match: bool = False) -> bool:
        """Before ``adder.add_one_req(req)``: whether ``req`` waits for a later batch
        because the batch's position mask could then exceed the budget (counted in
        ``mask_batch_held`` with ``count``). Never without a budget (no permuted rows).
        ``before_match``: SGLang has not matched ``req`` this pass (priority preemption asks
        first), so its whole input bounds its part, and marking documents may permute it."""
        budget = self.docs.mask_bytes
        if budget is None:
            return False
        batch = self._batches.get(adder)
        if batch is None:
            batch = self._batches[adder] = BatchMask(budget)
        self._count(batch, adder)
        chunk = getattr(adder, "rem_chunk_tokens", None)
        if before_match:
            candidate = MaskCandidate(
                extend_bound(0, input_length(req), chunk), bool(self.docs.canonical_chain_keys(req))
            )
        else:
            total = len(req.full_untruncated_fill_ids)
            candidate = MaskCandidate(extend_bound(int(req.prefix_len), total, chunk), self._may_permute(req, budget))
        held = batch.holds(candidate)
        if held and count and self.stats is not None:
            self.stats.mask_batch_held += 1
        return held

    def _count(self, batch: BatchMask, adder: Any) -> None:
        """Count the adder's requests committed since the last look (the continuing chunked
        request among them): each one's extend, and whether its row is permuted there."""
        for req in adder.can_run_list[batch.counted :]:
            prefix = int(req.prefix_len)
            end = req.extend_end if req.extend_end is not None else len(req.full_untruncated_fill_ids)
            row = self.docs.row(req.rid)
            batch.add(prefix, int(end), row is not None and row.permutes(prefix, int(end)))

    def _may_permute(self, req: Any, budget: int) -> bool:
        """Whether ``req``'s planned reuse may give it a permuted row: a plan with recomputed
        or gap tokens whose own mask placement lets through (``DocReuse._over_budget``)."""
        plan = self.docs.planned(req.rid)
        return plan is not None and needs_position_mask(plan) and own_mask_bound(req, plan) <= budget
