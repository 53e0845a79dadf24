"""Document reuse's counters: what ``/server_info`` reports under ``doc_reuse.counters`` and the
metrics export as ``sglang:pcr_doc_reuse_total{kind}`` (one kind per field, in this order).

They live apart from :class:`~pcr_sglang.reuse.placement.DocReuse` so that the report, the
metrics and the seam (:class:`~pcr_sglang.reuse.seam.DocReuseStatus`) name them without
importing the scheduler side's machinery; a request's reuse is added once, when its row is
written (:meth:`DocReuseStats.count_admitted`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pcr_sglang.reuse.plan import ReusePlan


@dataclass
class DocReuseStats:
    requests: int = 0  # admitted requests that marked documents
    canonical_requests: int = 0  # admitted canonical prefills (S ‖ d ‖ pad)
    docs_marked: int = 0
    docs_reused: int = 0
    tokens_reused: int = 0
    tokens_rotated: int = 0  # of those, moved to another position (delta != 0)
    tokens_recomputed: int = 0  # re-placed tokens recomputed instead (lego, blend)
    gap_tokens: int = 0  # tokens between reused documents with no cached KV, computed in place
    load_failures: int = 0  # planned but not loadable at admission (recomputed)
    load_deferred: int = 0  # admission passes a planned load waited for device room (others in flight)
    # Recomputed at admission, before anything was copied, because serving the reuse could
    # need more scratch than reserved: blend's probe (--pcr-blend-probe-mb) or the
    # permuted row's position mask (--pcr-position-mask-mb).
    probe_over_budget: int = 0
    mask_over_budget: int = 0
    # Admission passes a request waited in the queue because the batch's position mask (every
    # request's part, beside a permuted row) could exceed --pcr-position-mask-mb (reuse/batch_mask).
    mask_batch_held: int = 0
    malformed: int = 0  # bounds the scheduler could not use (the HTTP server checks them first)

    def count_admitted(self, plan: ReusePlan, docs_marked: int) -> None:
        """A request that marked ``docs_marked`` documents got its row with ``plan``'s reuse."""
        self.requests += 1
        self.docs_marked += docs_marked
        self.docs_reused += plan.docs
        self.tokens_reused += plan.prefix_tokens
        self.tokens_rotated += plan.rotated_tokens - plan.recompute_count
        self.tokens_recomputed += plan.recompute_count
        self.gap_tokens += plan.gap_tokens
