"""PCR's state for ``/server_info`` (``internal_states[i]["pcr"]``)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any, Optional

from pcr_sglang.core.hints import HINT_CAPABILITIES
from pcr_sglang.reuse.seam import DocReuseStatus

logger = logging.getLogger(__name__)


def build_report(cache: Any, check_invariants: bool = False) -> dict[str, Any]:
    """Tree size, locks, slot states, counters, I/O health and scheduler-step timings.

    ``check_invariants`` walks the whole tree and slot table to verify their bookkeeping
    (O(tree)): for tests and debugging, not for scraping at a high rate. Without it,
    ``invariants.ok`` is None (not checked), never a claim. The checks are ``assert``s, which
    ``python -O`` strips: there the check reports itself as not run.
    """
    state, scheduler = cache.state, cache.scheduler
    invariant_error: Optional[str] = None
    check_invariants = check_invariants and __debug__
    if check_invariants:
        try:
            state.check()
        except (AssertionError, RuntimeError) as e:  # reported, never raised into the scheduler
            invariant_error = f"{type(e).__name__}: {e}"
            logger.error("PCR invariant violated: %s", invariant_error)
    tree = state.tree
    allocator = cache.token_to_kv_pool_allocator
    slot_counts = state.slots.counts() if state.slots is not None else {}
    engine = scheduler.engine
    report: dict[str, Any] = {
        "chunk_size": state.chunk_size,
        "lookahead_window": state.lookahead.window,
        "lookahead_protected_chunks": len(state.lookahead),
        "namespace": asdict(cache.namespace) if cache.namespace is not None else None,
        "tree": asdict(tree.stats()),
        "cached_tokens": cache.total_size(),
        "host_cached_tokens": tree.host_chunks * state.chunk_size,
        "device_pool_tokens": int(getattr(allocator, "size", 0)),
        "device_pool_free_tokens": int(allocator.available_size()),
        "host_pool_slots": state.slots.num_slots if state.slots is not None else 0,
        "host_pool_free_slots": state.slots.num_free if state.slots is not None else 0,
        "host_pool_bytes": cache.host_pool.layout.total_bytes if cache.host_pool is not None else 0,
        # The POSIX shared-memory segment of the host tier (what an operator inspects).
        "host_pool_shm": cache.host_pool.info().shm_name if cache.host_pool is not None else None,
        # Slots by state: reserved for offloads no tree node owns yet, filling from SSD, ...
        "host_slots": slot_counts,
        "host_pool_offload_slots": slot_counts.get("reserved", 0),
        # Of those, held by decode-time offloads (at most a quarter of the tier).
        "host_pool_decode_offload_slots": state.decode_reserved_slots,
        "host_pool_io_slots": slot_counts.get("filling", 0),
        "layerwise": engine.mode.value if engine is not None else None,
        "forwards": scheduler.worker.forwards if scheduler.worker is not None else None,
        "transfers": {"pending_loads": engine.pending_loads, "planned_offloads": engine.planned_offloads}
        if engine is not None
        else None,
        "counters": asdict(state.stats),
        "requests": {"tracked": len(scheduler.requests), "waiting_for_reads": len(scheduler.requests.holds())},
        # Cumulative histograms (bucket edges: pcr_sglang.sglang_adapter.step_timing).
        "scheduler_step": {"pcr": scheduler.step_time.report(), "iteration": scheduler.iteration_time.report()},
        "tp": {
            "size": scheduler.tp.size if scheduler.tp is not None else 1,
            "agreement_rounds": scheduler.agreement.rounds,
            "inconsistent": scheduler.agreement.broken,
            # Rounds in which the ranks' digests of admitted prefix lengths differed.
            "prefix_digest_mismatches": scheduler.agreement.digest_mismatches,
        },
        "ssd": _ssd_report(cache) if state.ssd_enabled else None,
        "hints": {
            "live": len(scheduler.hints),
            "counters": asdict(scheduler.hints.stats),
            "capabilities": list(HINT_CAPABILITIES),
        },
        "remote": remote_report(scheduler) if scheduler.probes.enabled else None,
        "kv_events": cache.kv_events.report() if cache.kv_events is not None else None,
        "doc_reuse": _doc_reuse_report(scheduler.doc_status) if scheduler.doc_status is not None else None,
        "invariants": {
            "checked": check_invariants,
            "ok": (invariant_error is None) if check_invariants else None,
            "error": invariant_error,
        },
    }
    return report


def _doc_reuse_report(docs: DocReuseStatus) -> dict[str, Any]:
    return {
        "mode": docs.mode,
        "rope": docs.rope.signature(),
        "fill_gaps": docs.fill_gaps,
        "calibration": docs.calibration,
        "conditions": asdict(docs.conditions) if docs.conditions else None,
        "counters": asdict(docs.stats),
    }


def _ssd_report(cache: Any) -> dict[str, Any]:
    state, scheduler, store = cache.state, cache.scheduler, cache.store
    io = scheduler.io
    return {
        "dir": str(store.dir) if store is not None else None,
        "capacity_chunks": state.config.ssd_capacity_chunks,
        "chunks": state.tree.ssd_chunks,
        "writes_in_flight": state.writes_in_flight,
        "reads_in_flight": state.reads_in_flight,
        "deferred_orders": len(scheduler.executor.deferred),
        "writes_enabled": state.writes_enabled,
        # "on", or "writes_off" with the reason (the sglang:pcr_ssd_tier_up gauge is 0 then).
        "tier": ssd_tier(cache),
        # Namespaces left at weight updates and kept for a rollback (--pcr-ssd-keep-namespaces).
        "namespaces": cache.ssd_namespaces.report() if getattr(cache, "ssd_namespaces", None) else None,
        "write_policy": "through" if state.config.write_through else "on-evict",
        "prefetch_window": scheduler.config.prefetch_window,
        "prefetch_timeliness": state.timeliness(),
        "io_process": {"pid": io.pid, "healthy": io.healthy, "phase": io.phase, "in_flight": io.in_flight}
        if io is not None
        else None,
        "counters": asdict(state.ssd_stats),
        "cost_model": asdict(state.cost_model),
        "store": asdict(store.stats) if store is not None else None,  # this process's own store I/O
    }


def ssd_tier(cache: Any) -> dict[str, Any]:
    """Whether the SSD tier still writes, and if not why: it switches its writes off by
    itself, for good, when a write fails, when a weight update's new namespace store cannot
    be opened, or when the TP ranks' I/O views disagree."""
    state, scheduler = cache.state, cache.scheduler
    if state.writes_enabled:
        return {"state": "on", "reason": None}
    kept = getattr(cache, "ssd_namespaces", None)
    if kept is not None and kept.writes_off_reason:
        reason = kept.writes_off_reason
    elif scheduler.agreement.broken:
        reason = f"the TP ranks disagreed: {scheduler.agreement.broken}"
    elif state.ssd_stats.write_errors:
        reason = "a write failed (on this or another TP rank)"
    else:
        reason = "stopped"
    return {"state": "writes_off", "reason": reason}


def remote_report(scheduler: Any) -> dict[str, Any]:
    """The remote tier: the scheduler's probes, and the I/O process's last report of the
    store (reachable or not, and its reads and writes)."""
    if scheduler.io is not None:
        scheduler.io.take_replies()  # an idle scheduler runs no step that would
    status = scheduler.io.remote_status if scheduler.io is not None else None
    probes = asdict(scheduler.probes.stats)
    answered = probes["answered"]
    return {
        "backend": scheduler.config.remote,
        "healthy": status.healthy if status is not None else None,
        "error": status.error if status is not None else "no report from the I/O process yet",
        "probes": {
            **probes,
            "in_flight": scheduler.probes.in_flight,
            "mean_seconds": probes["seconds_total"] / answered if answered else None,
        },
        "store": dict(status.counters) if status is not None else None,
    }
