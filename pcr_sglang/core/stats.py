"""The cache state's counters, since start.

Written only by :class:`~pcr_sglang.core.residency.CacheState` and its parts (the host and SSD
tiers, the prefetch planner and :class:`~pcr_sglang.core.prefetch.UnusedReads` share them); the adapter reports
what it saw through the state's ``note_*`` methods. Read by ``/server_info``, the Prometheus
exporter and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheStats", "SSDStats"]


@dataclass
class CacheStats:
    """Counters since start; hits are counted once per admitted request."""

    inserted_chunks: int = 0
    duplicate_chunks: int = 0  # chunks a request computed that another had cached meanwhile
    evicted_chunks: int = 0
    evicted_protected_chunks: int = 0  # look-ahead chunks evicted because nothing else was left
    lookahead_refreshes: int = 0
    device_hit_chunks: int = 0
    host_hit_chunks: int = 0
    demoted_chunks: int = 0  # device evictions copied to the host when evicted
    offloaded_chunks: int = 0  # new chunks copied to the host during their forward
    host_evicted_chunks: int = 0
    dropped_chunks: int = 0  # device evictions the host tier could not keep
    bytes_host_to_device: int = 0
    bytes_device_to_host: int = 0


@dataclass
class SSDStats:
    hit_chunks: int = 0  # chunks admitted requests reused that were read from SSD
    read_failures: int = 0  # reads that failed or did not verify (chunk recomputed)
    written_chunks: int = 0
    write_errors: int = 0
    evicted_chunks: int = 0
    restored_chunks: int = 0
    orphaned_records: int = 0  # records whose parent chain was not persisted (deleted)
    recompute_chosen_chunks: int = 0  # SSD hits the cost model left to recomputation
    prefetch_issued: int = 0
    prefetch_completed: int = 0
    prefetch_in_time: int = 0  # in host memory when its request was first considered for admission
    prefetch_late: int = 0  # still in flight then (the request waited for it, or recomputed it)
    prefetch_unused: int = 0  # landed, then its request left the prefetch window before using it
    prefetch_cancelled: int = 0
    abandoned_reads: int = 0  # reads whose waiting request left before they landed (an abort)
    cancelled_reads: int = 0  # reads cancelled before they started (prefetch or abandoned)
    on_demand_reads: int = 0  # ordered only when its request was considered for admission
    # Admission holds: requests that waited in the queue for their SSD reads, those whose
    # wait ran out before the reads landed (the rest recomputed), and the time they waited.
    held_requests: int = 0
    held_expired: int = 0
    held_ms: int = 0
    # KV hints (pcr_sglang.core.hints): reads ordered for hinted chains, found in host
    # memory / still in flight when a request needed them, landed and dropped unused.
    hint_issued: int = 0
    hint_in_time: int = 0
    hint_late: int = 0
    hint_wasted: int = 0
    hint_promoted: int = 0  # hinted chunks loaded from host memory into free device slots ahead
    bytes_read_prefetch: int = 0
    bytes_read_on_demand: int = 0
    max_queue_depth: int = 0
    cancelled_writes: int = 0
    io_failures: int = 0
    io_restarts: int = 0
    # The remote tier: chunks a probe found there and the tree took in (SSD level: the
    # I/O process reads them from the remote tier when the local SSD has no record).
    remote_adopted_chunks: int = 0
    remote_recompute_chosen_chunks: int = 0  # remote-only chunks the cost model left to recomputation
