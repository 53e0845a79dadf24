"""PCR's Prometheus metrics, exported through SGLang's ``/metrics`` (``--enable-metrics``).

The cache state keeps plain counters (:class:`~pcr_sglang.core.stats.CacheStats` and
:class:`~pcr_sglang.core.stats.SSDStats`, also shown in ``/server_info``); once per
scheduler step :meth:`PCRMetrics.sync` adds what changed since the last sync to the
Prometheus series. Hits are counted once per admitted request, by the tier SGLang
reports in the response, so ``sglang:pcr_hit_chunks_total`` times the chunk size is the
sum of the responses' ``cached_tokens_details``. SGLang runs the client in
multiprocess mode, so series written in the scheduler process show up on the HTTP
server's ``/metrics``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

# counter field -> (metric attribute, label values)
_COUNTER_FIELDS = {
    "device_hit_chunks": ("hit_chunks", {"tier": "device"}),
    "host_hit_chunks": ("hit_chunks", {"tier": "host"}),
    "evicted_chunks": ("evicted_chunks", {"tier": "device"}),
    "host_evicted_chunks": ("evicted_chunks", {"tier": "host"}),
    "demoted_chunks": ("demoted_chunks", {}),
    "offloaded_chunks": ("offloaded_chunks", {}),
    "dropped_chunks": ("dropped_chunks", {}),
    "bytes_host_to_device": ("transfer_bytes", {"direction": "host_to_device"}),
    "bytes_device_to_host": ("transfer_bytes", {"direction": "device_to_host"}),
}
# SSD tier counter field -> (metric attribute, label values)
_SSD_FIELDS = {
    "hit_chunks": ("hit_chunks", {"tier": "ssd"}),
    "evicted_chunks": ("evicted_chunks", {"tier": "ssd"}),
    "written_chunks": ("ssd_written_chunks", {}),
    "write_errors": ("ssd_errors", {"kind": "write"}),
    "read_failures": ("ssd_errors", {"kind": "read"}),
    "prefetch_issued": ("prefetch_chunks", {"outcome": "issued"}),
    "prefetch_in_time": ("prefetch_chunks", {"outcome": "in_time"}),
    "prefetch_late": ("prefetch_chunks", {"outcome": "late"}),
    "prefetch_unused": ("prefetch_chunks", {"outcome": "unused"}),
    "prefetch_cancelled": ("prefetch_chunks", {"outcome": "cancelled"}),
    "on_demand_reads": ("prefetch_chunks", {"outcome": "on_demand"}),
    "hint_issued": ("prefetch_chunks", {"outcome": "hint_issued"}),
    "hint_in_time": ("prefetch_chunks", {"outcome": "hint_in_time"}),
    "hint_late": ("prefetch_chunks", {"outcome": "hint_late"}),
    "hint_wasted": ("prefetch_chunks", {"outcome": "hint_wasted"}),
    "hint_promoted": ("prefetch_chunks", {"outcome": "hint_promoted"}),
    "bytes_read_prefetch": ("ssd_read_bytes", {"reason": "prefetch"}),
    "bytes_read_on_demand": ("ssd_read_bytes", {"reason": "on_demand"}),
}

_HINT_KINDS = ("registered", "rate_limited", "clipped", "expired", "consumed")
# The remote tier: the scheduler's probe counters, then the I/O process's store counters.
_REMOTE_PROBE_FIELDS = {"probes": ("remote_probes", {"kind": "sent"}),
                        "answered": ("remote_probes", {"kind": "answered"}),
                        "timed_out": ("remote_probes", {"kind": "timed_out"}),
                        "found_chunks": ("remote_chunks", {"kind": "found"}),
                        "adopted_chunks": ("remote_chunks", {"kind": "adopted"})}
_REMOTE_STORE_FIELDS = {"read_ok": ("remote_chunks", {"kind": "read"}),
                        "read_missing": ("remote_chunks", {"kind": "read_missing"}),
                        "read_corrupt": ("remote_chunks", {"kind": "read_corrupt"}),
                        "read_failed": ("remote_chunks", {"kind": "read_failed"}),
                        "writes": ("remote_chunks", {"kind": "written"}),
                        "writes_present": ("remote_chunks", {"kind": "write_present"}),
                        "writes_dropped": ("remote_chunks", {"kind": "write_dropped"}),
                        "writes_failed": ("remote_chunks", {"kind": "write_failed"}),
                        "read_bytes": ("remote_bytes", {"direction": "read"}),
                        "write_bytes": ("remote_bytes", {"direction": "write"}),
                        "errors": ("remote_errors", {}),
                        "outages": ("remote_outages", {})}


class PCRMetrics:
    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Counter, Gauge

        names = list(labels)
        self.labels = dict(labels)
        self.hit_chunks = Counter(
            "sglang:pcr_hit_chunks_total",
            "PCR chunks reused by admitted requests (once per request), by the tier they came "
            "from (host: copied back to the device instead of recomputed; ssd: read from the "
            "SSD tier into host memory first).",
            labelnames=names + ["tier"],
        )
        self.evicted_chunks = Counter(
            "sglang:pcr_evicted_chunks_total",
            "PCR chunks evicted from a tier (device evictions may be kept on the host).",
            labelnames=names + ["tier"],
        )
        self.demoted_chunks = Counter(
            "sglang:pcr_demoted_chunks_total",
            "PCR chunks evicted from the device and kept in the host tier.",
            labelnames=names,
        )
        self.offloaded_chunks = Counter(
            "sglang:pcr_offloaded_chunks_total",
            "New PCR chunks copied to the host tier layer by layer during their prefill "
            "(--pcr-layerwise offload), so evicting them later needs no copy.",
            labelnames=names,
        )
        self.dropped_chunks = Counter(
            "sglang:pcr_dropped_chunks_total",
            "PCR chunks evicted from the device that the host tier could not keep.",
            labelnames=names,
        )
        self.transfer_bytes = Counter(
            "sglang:pcr_transfer_bytes_total",
            "KV bytes PCR copied between the device and the host tier.",
            labelnames=names + ["direction"],
        )
        self.ssd_written_chunks = Counter(
            "sglang:pcr_ssd_written_chunks_total",
            "PCR chunks persisted to the SSD tier.",
            labelnames=names,
        )
        self.ssd_errors = Counter(
            "sglang:pcr_ssd_errors_total",
            "SSD tier faults: failed writes (write-back then stops) and reads that failed or did "
            "not verify (the chunk is recomputed).",
            labelnames=names + ["kind"],
        )
        self.prefetch_chunks = Counter(
            "sglang:pcr_prefetch_chunks_total",
            "PCR queue-based prefetch: chunks ordered from SSD for waiting requests (issued), "
            "found in host memory when their request ran (in_time), still in flight when it "
            "was first considered for admission (late), landed but left unused when its request "
            "left the prefetch window (unused), dropped before reading (cancelled), and SSD "
            "chunks read only when their request was considered (on_demand); for KV hints' "
            "chains: ordered (hint_issued), in host memory or still in flight when a request "
            "needed them (hint_in_time, hint_late), landed and dropped unused (hint_wasted), "
            "loaded on into free device slots ahead of their request (hint_promoted).",
            labelnames=names + ["outcome"],
        )
        self.ssd_read_bytes = Counter(
            "sglang:pcr_ssd_read_bytes_total",
            "Bytes PCR read from the SSD tier, by prefetch or on demand.",
            labelnames=names + ["reason"],
        )
        self.cached_chunks = Gauge(
            "sglang:pcr_cached_chunks",
            "PCR chunks resident in each tier.",
            labelnames=names + ["tier"],
            multiprocess_mode="mostrecent",
        )
        self.doc_reuse = Counter(
            "sglang:pcr_doc_reuse_total",
            "PCR document reuse (--pcr-doc-reuse): admitted requests that marked documents "
            "(requests), canonical document prefills the server ran for them (canonical_requests), "
            "documents marked and reused (docs_marked, docs_reused), tokens whose KV was reused "
            "from a document's canonical chain (tokens_reused) and, of those, moved to another "
            "position (tokens_rotated), re-placed tokens recomputed instead (tokens_recomputed: "
            "lego, blend), tokens between reused documents with no cached KV, computed in place "
            "(gap_tokens), planned reuse not loadable at admission (load_failures), "
            "bounds the scheduler could not use (malformed).",
            labelnames=names + ["kind"],
        )
        self.calibration_overrides = Counter(
            "sglang:pcr_doc_reuse_calibration_overrides_total",
            "Marked requests served outside the --pcr-doc-reuse-calibration file because of "
            "--pcr-doc-reuse-calibration-warn (without it they get HTTP 400), by what they asked for: "
            "another mode, a K (recompute_tokens) or R (recompute_ratio) below the calibrated one, "
            "another blend selector or anchor tokens.",
            labelnames=names + ["what"],
        )
        self.hints = Counter(
            "sglang:pcr_hints_total",
            "PCR KV hints (kv_hints action 'pcr.lookahead_prefetch' or 'kv.prefetch'): registered "
            "(accepted), dropped over --pcr-hint-rate (rate_limited), accepted with their ttl_s cut to "
            "the server's maximum (clipped), ended by their TTL (expired) or by an admitted request "
            "covering them (consumed).",
            labelnames=names + ["kind"],
        )
        self.remote_probes = Counter(
            "sglang:pcr_remote_probes_total",
            "PCR remote tier (--pcr-remote): probes sent (one per request whose chains go past "
            "the local tiers), answered, and given up on by their request (timed_out).",
            labelnames=names + ["kind"],
        )
        self.remote_chunks = Counter(
            "sglang:pcr_remote_chunks_total",
            "PCR remote tier chunks: held there when probed (found), entered into the tree "
            "(adopted), read (read; read_missing: gone since the probe; read_corrupt: failed "
            "verification, removed; read_failed: the store could not be asked), written through "
            "(written; write_present: held already; write_dropped: queue full; write_failed).",
            labelnames=names + ["kind"],
        )
        self.remote_bytes = Counter(
            "sglang:pcr_remote_bytes_total",
            "Record bytes PCR read from and wrote to the remote tier.",
            labelnames=names + ["direction"],
        )
        self.remote_errors = Counter(
            "sglang:pcr_remote_errors_total",
            "Remote tier calls that failed (each marks the tier down until a retry succeeds).",
            labelnames=names,
        )
        self.remote_outages = Counter(
            "sglang:pcr_remote_outages_total",
            "Times the remote tier went down (unreachable or failing).",
            labelnames=names,
        )
        self.remote_up = Gauge(
            "sglang:pcr_remote_up",
            "1 while the I/O process reaches the remote tier, 0 while it is down.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        self.ssd_tier_up = Gauge(
            "sglang:pcr_ssd_tier_up",
            "1 while PCR's SSD tier writes, 0 once it has switched its writes off (a write "
            "failed, a weight update's new namespace store could not be opened, or the TP ranks "
            "disagreed); chunks already on SSD stay readable. /server_info's ssd.tier says why.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        self._last: dict[str, int] = {}
        self._remote_pid = 0

    def _add(self, prefix: str, values: dict[str, Any], fields: dict) -> None:
        for field, (attr, extra) in fields.items():
            delta = values[field] - self._last.get(prefix + field, 0)
            if delta > 0:
                getattr(self, attr).labels(**self.labels, **extra).inc(delta)
            self._last[prefix + field] = values[field]

    def sync(self, state: Any, doc_stats: Any = None, hint_stats: Any = None, remote_probes: Any = None,
             remote_status: Any = None, calibration_overrides: Optional[dict[str, int]] = None) -> None:
        """Publish ``state``'s (a :class:`~pcr_sglang.core.CacheState`) counters and sizes,
        document reuse's (a :class:`~pcr_sglang.reuse.placement.DocReuseStats`),
        the KV hints' (a :class:`~pcr_sglang.core.hints.HintStats`), the remote tier's
        (the scheduler's probe counters, the I/O process's last ``RemoteStatus``) and the
        calibration gate's overrides (``CalibrationGate.overrides``)."""
        tree = state.tree
        if remote_probes is not None:
            self._add("remote.", asdict(remote_probes), _REMOTE_PROBE_FIELDS)
        if remote_status is not None:  # the I/O process's counters (from 0 again after a restart)
            if remote_status.pid != self._remote_pid:
                self._remote_pid = remote_status.pid
                for name in [k for k in self._last if k.startswith("remote-store.")]:
                    del self._last[name]  # a new process: its counts are all new
            self._add("remote-store.", {k: int(v) for k, v in remote_status.counters.items()},
                      {k: v for k, v in _REMOTE_STORE_FIELDS.items() if k in remote_status.counters})
            self.remote_up.labels(**self.labels).set(1 if remote_status.healthy else 0)
        if hint_stats is not None:
            values = {k: v for k, v in asdict(hint_stats).items() if k in _HINT_KINDS}
            self._add("hint.", values, {name: ("hints", {"kind": name}) for name in values})
        if calibration_overrides is not None:
            self._add("calibration.", calibration_overrides,
                      {what: ("calibration_overrides", {"what": what}) for what in calibration_overrides})
        if doc_stats is not None:
            values = asdict(doc_stats)
            self._add("doc.", values, {name: ("doc_reuse", {"kind": name}) for name in values})
        self._add("", asdict(state.stats), _COUNTER_FIELDS)
        if state.ssd_enabled:
            self._add("ssd.", asdict(state.ssd_stats), _SSD_FIELDS)
            self.cached_chunks.labels(**self.labels, tier="ssd").set(tree.ssd_chunks)
            self.ssd_tier_up.labels(**self.labels).set(1 if state.writes_enabled else 0)
        self.cached_chunks.labels(**self.labels, tier="device").set(tree.device_chunks)
        self.cached_chunks.labels(**self.labels, tier="host").set(tree.host_chunks)
