"""How much of a request's prompt was reused, with document reuse given apart from exact
prefix hits (hooks registered in ``plugin.py``, scheduler side).

SGLang's ``meta_info["cached_tokens"]`` (and so the OpenAI ``usage.prompt_tokens_details.
cached_tokens`` under ``--enable-cache-report``) already counts every token whose KV was
not computed, reused documents included: that total is what a client is told. Its
``cached_tokens_details`` splits the total by tier, and documents' tokens come in through
the host tier's load-back path, so they would read as exact host hits. Here they are
moved to a ``"documents"`` entry of their own: ``{"device": 32, "host": 0,
"documents": 180}``. SGLang's ``sglang:cached_tokens_total{cache_source}`` is summed from
these details, so it then counts exact hits only; document reuse is counted by
``sglang:pcr_doc_reuse_total{kind="tokens_reused"}`` (PCR's own
``sglang:pcr_hit_chunks_total`` already leaves documents out): a composed hit is never
reported as an exact one.

* ``ScheduleBatch.prepare_for_extend`` (AFTER, in ``plugin.py``): a request's reused
  document tokens (its reuse plan's) are noted on the request when its extend is prepared;
* ``SchedulerOutputStreamer.get_cached_tokens_details`` (AFTER): they are moved out of
  the tiers into ``"documents"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pcr_sglang.reuse.seam import SchedulerDocReuse

DETAILS_KEY = "documents"
_ATTR = "_pcr_doc_reused_tokens"


def note_reused_documents(reqs: Any, docs: SchedulerDocReuse) -> None:
    """Note on each of ``reqs`` its reused document tokens (``docs``: the scheduler's
    document reuse, whose ``reused(rid)`` is the plan a request was loaded with)."""
    for req in reqs:
        plan = docs.reused(req.rid)
        if plan is not None and plan.prefix_tokens:
            setattr(req, _ATTR, int(plan.prefix_tokens))


def split_details(details: Any, reused: int) -> Any:
    """``details`` with ``reused`` document tokens moved out of the host tier (then the
    device tier, where SGLang counted them there) into ``"documents"``."""
    if not reused or not isinstance(details, dict):
        return details
    split = dict(details)
    moved = 0
    for tier in ("host", "device"):
        value = split.get(tier)
        if isinstance(value, int) and moved < reused:
            take = min(value, reused - moved)
            split[tier] = value - take
            moved += take
    split[DETAILS_KEY] = moved
    return split


def split_cached_details(result: Any, streamer: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``SchedulerOutputStreamer.get_cached_tokens_details``."""
    # mutant: reused-documents-reported-as-exact-hits
    return split_details(result, getattr(req, _ATTR, 0))
