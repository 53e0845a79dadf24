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

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

# The one place PCR's series are named: ``PCRMetrics`` makes them, ``sync`` feeds them,
# and scripts/metrics_doc.py writes docs/architecture.md's table of them from here.


@dataclass(frozen=True)
class Metric:
    """One Prometheus family: ``sglang:pcr_<name>_total`` (a counter) or ``sglang:pcr_<name>``
    (a gauge), with the server's labels and at most one of its own."""

    name: str
    help: str
    label: str = ""  # its own label (tier, kind, ...); "" for none
    gauge: bool = False

    @property
    def series(self) -> str:
        return f"sglang:pcr_{self.name}" + ("" if self.gauge else "_total")


METRICS = (
    Metric(
        "hit_chunks",
        "PCR chunks reused by admitted requests (once per request), by the tier they came "
        "from (host: copied back to the device instead of recomputed; ssd: read from the "
        "SSD tier into host memory first).",
        "tier",
    ),
    Metric("evicted_chunks", "PCR chunks evicted from a tier (device evictions may be kept on the host).", "tier"),
    Metric("demoted_chunks", "PCR chunks evicted from the device and kept in the host tier."),
    Metric(
        "offloaded_chunks",
        "New PCR chunks copied to the host tier layer by layer during their prefill "
        "(--pcr-layerwise offload), so evicting them later needs no copy.",
    ),
    Metric("dropped_chunks", "PCR chunks evicted from the device that the host tier could not keep."),
    Metric("transfer_bytes", "KV bytes PCR copied between the device and the host tier.", "direction"),
    Metric("ssd_written_chunks", "PCR chunks persisted to the SSD tier."),
    Metric(
        "ssd_errors",
        "SSD tier faults: failed writes (write-back then stops) and reads that failed or did "
        "not verify (the chunk is recomputed).",
        "kind",
    ),
    Metric(
        "prefetch_chunks",
        "PCR queue-based prefetch: chunks ordered from SSD for waiting requests (issued), "
        "found in host memory when their request ran (in_time), still in flight when it "
        "was first considered for admission (late), landed but left unused when its request "
        "left the prefetch window (unused), dropped before reading (cancelled), and SSD "
        "chunks read only when their request was considered (on_demand); for KV hints' "
        "chains: ordered (hint_issued), in host memory or still in flight when a request "
        "needed them (hint_in_time, hint_late), landed and dropped unused (hint_wasted), "
        "loaded on into free device slots ahead of their request (hint_promoted).",
        "outcome",
    ),
    Metric("ssd_read_bytes", "Bytes PCR read from the SSD tier, by prefetch or on demand.", "reason"),
    Metric("cached_chunks", "PCR chunks resident in each tier.", "tier", gauge=True),
    Metric(
        "doc_reuse",
        "PCR document reuse (--pcr-doc-reuse): admitted requests that marked documents "
        "(requests), canonical document prefills the server ran for them (canonical_requests), "
        "documents marked and reused (docs_marked, docs_reused), tokens whose KV was reused "
        "from a document's canonical chain (tokens_reused) and, of those, moved to another "
        "position (tokens_rotated), re-placed tokens recomputed instead (tokens_recomputed: "
        "lego, blend), tokens between reused documents with no cached KV, computed in place "
        "(gap_tokens), planned reuse not loadable at admission (load_failures), "
        "admission passes a planned load waited for device room while other requests ran (load_deferred), "
        "requests recomputed at admission because blend's probe or the permuted row's position mask "
        "could need more than reserved (probe_over_budget, mask_over_budget), "
        "admission passes a request waited because its batch's position mask could exceed it (mask_batch_held), "
        "bounds the scheduler could not use (malformed).",
        "kind",
    ),
    Metric(
        "doc_reuse_calibration_overrides",
        "Marked requests served outside the --pcr-doc-reuse-calibration file because of "
        "--pcr-doc-reuse-calibration-warn (without it they get HTTP 400), by what they asked for: "
        "another mode, a K (recompute_tokens) or R (recompute_ratio) below the calibrated one, "
        "another blend selector or anchor tokens.",
        "what",
    ),
    Metric(
        "hints",
        "PCR KV hints (kv_hints action 'pcr.lookahead_prefetch' or 'kv.prefetch'): registered "
        "(accepted), dropped over --pcr-hint-rate (rate_limited), accepted with their ttl_s cut to "
        "the server's maximum (clipped), ended by their TTL (expired) or by an admitted request "
        "covering them (consumed).",
        "kind",
    ),
    Metric(
        "remote_probes",
        "PCR remote tier (--pcr-remote): probes sent (one per request whose chains go past "
        "the local tiers), answered, and given up on by their request (timed_out).",
        "kind",
    ),
    Metric(
        "remote_chunks",
        "PCR remote tier chunks: held there when probed (found), entered into the tree "
        "(adopted), read (read; read_missing: gone since the probe; read_corrupt: failed "
        "verification, removed; read_failed: the store could not be asked), written through "
        "(written; write_present: held already; write_dropped: queue full; write_failed).",
        "kind",
    ),
    Metric("remote_bytes", "Record bytes PCR read from and wrote to the remote tier.", "direction"),
    Metric("remote_errors", "Remote tier calls that failed (each marks the tier down until a retry succeeds)."),
    Metric("remote_outages", "Times the remote tier went down (unreachable or failing)."),
    Metric("remote_up", "1 while the I/O process reaches the remote tier, 0 while it is down.", gauge=True),
    Metric(
        "ssd_tier_up",
        "1 while PCR's SSD tier writes, 0 once it has switched its writes off (a write "
        "failed, a weight update's new namespace store could not be opened, or the TP ranks "
        "disagreed); chunks already on SSD stay readable. /server_info's ssd.tier says why.",
        gauge=True,
    ),
)
_BY_NAME = {metric.name: metric for metric in METRICS}

# What feeds the counters: a source's counter field -> (metric, its label's value).
# CacheStats (pcr_sglang.core.stats):
_COUNTER_FIELDS = {
    "device_hit_chunks": ("hit_chunks", "device"),
    "host_hit_chunks": ("hit_chunks", "host"),
    "evicted_chunks": ("evicted_chunks", "device"),
    "host_evicted_chunks": ("evicted_chunks", "host"),
    "demoted_chunks": ("demoted_chunks", None),
    "offloaded_chunks": ("offloaded_chunks", None),
    "dropped_chunks": ("dropped_chunks", None),
    "bytes_host_to_device": ("transfer_bytes", "host_to_device"),
    "bytes_device_to_host": ("transfer_bytes", "device_to_host"),
}
# SSDStats:
_SSD_FIELDS = {
    "hit_chunks": ("hit_chunks", "ssd"),
    "evicted_chunks": ("evicted_chunks", "ssd"),
    "written_chunks": ("ssd_written_chunks", None),
    "write_errors": ("ssd_errors", "write"),
    "read_failures": ("ssd_errors", "read"),
    "prefetch_issued": ("prefetch_chunks", "issued"),
    "prefetch_in_time": ("prefetch_chunks", "in_time"),
    "prefetch_late": ("prefetch_chunks", "late"),
    "prefetch_unused": ("prefetch_chunks", "unused"),
    "prefetch_cancelled": ("prefetch_chunks", "cancelled"),
    "on_demand_reads": ("prefetch_chunks", "on_demand"),
    "hint_issued": ("prefetch_chunks", "hint_issued"),
    "hint_in_time": ("prefetch_chunks", "hint_in_time"),
    "hint_late": ("prefetch_chunks", "hint_late"),
    "hint_wasted": ("prefetch_chunks", "hint_wasted"),
    "hint_promoted": ("prefetch_chunks", "hint_promoted"),
    "bytes_read_prefetch": ("ssd_read_bytes", "prefetch"),
    "bytes_read_on_demand": ("ssd_read_bytes", "on_demand"),
}
# HintStats (pcr_sglang.core.hints), each under its own name:
_HINT_KINDS = ("registered", "rate_limited", "clipped", "expired", "consumed")
# The remote tier: the scheduler's probe counters, then the I/O process's store counters.
_REMOTE_PROBE_FIELDS = {
    "probes": ("remote_probes", "sent"),
    "answered": ("remote_probes", "answered"),
    "timed_out": ("remote_probes", "timed_out"),
    "found_chunks": ("remote_chunks", "found"),
    "adopted_chunks": ("remote_chunks", "adopted"),
}
_REMOTE_STORE_FIELDS = {
    "read_ok": ("remote_chunks", "read"),
    "read_missing": ("remote_chunks", "read_missing"),
    "read_corrupt": ("remote_chunks", "read_corrupt"),
    "read_failed": ("remote_chunks", "read_failed"),
    "writes": ("remote_chunks", "written"),
    "writes_present": ("remote_chunks", "write_present"),
    "writes_dropped": ("remote_chunks", "write_dropped"),
    "writes_failed": ("remote_chunks", "write_failed"),
    "read_bytes": ("remote_bytes", "read"),
    "write_bytes": ("remote_bytes", "write"),
    "errors": ("remote_errors", None),
    "outages": ("remote_outages", None),
}
_FIELD_MAPS = (_COUNTER_FIELDS, _SSD_FIELDS, _REMOTE_PROBE_FIELDS, _REMOTE_STORE_FIELDS)
_TIERS = ("device", "host", "ssd")  # cached_chunks


def label_values(metric: Metric) -> tuple[str, ...]:
    """The values ``metric``'s own label takes, in the order they are fed (for the docs)."""
    if metric.name == "doc_reuse":
        from pcr_sglang.reuse.placement import DocReuseStats

        return tuple(f.name for f in fields(DocReuseStats))
    if metric.name == "doc_reuse_calibration_overrides":
        from pcr_sglang.reuse.gate import OVERRIDES

        return OVERRIDES
    dynamic = {"hints": _HINT_KINDS, "cached_chunks": _TIERS}
    if metric.name in dynamic:
        return dynamic[metric.name]
    found = [value for fed in _FIELD_MAPS for name, value in fed.values() if name == metric.name and value]
    return tuple(dict.fromkeys(found))


def _labelled(fed: Mapping[str, tuple[str, Optional[str]]]) -> dict[str, tuple[str, dict[str, str]]]:
    """A field map as ``_add`` reads it: field -> (metric, its label as a keyword)."""
    return {
        field: (name, {_BY_NAME[name].label: value} if value is not None else {})
        for field, (name, value) in fed.items()
    }


_FEEDS = {
    "cache": _labelled(_COUNTER_FIELDS),
    "ssd": _labelled(_SSD_FIELDS),
    "remote": _labelled(_REMOTE_PROBE_FIELDS),
    "remote-store": _labelled(_REMOTE_STORE_FIELDS),
}


class PCRMetrics:
    """PCR's series (each :data:`METRICS` entry by its name in ``counters`` or ``gauges``), fed by :meth:`sync`."""

    def __init__(self, labels: dict[str, str]):
        import prometheus_client

        names = list(labels)
        self.labels = dict(labels)
        self.counters: dict[str, Counter] = {}
        self.gauges: dict[str, Gauge] = {}
        for metric in METRICS:
            labelnames = names + [metric.label] if metric.label else names
            if metric.gauge:
                self.gauges[metric.name] = prometheus_client.Gauge(
                    metric.series, metric.help, labelnames=labelnames, multiprocess_mode="mostrecent"
                )
            else:
                self.counters[metric.name] = prometheus_client.Counter(
                    metric.series, metric.help, labelnames=labelnames
                )
        self._last: dict[str, int] = {}
        self._remote_pid = 0

    def _gauge(self, name: str, **labels: str) -> Gauge:
        return self.gauges[name].labels(**self.labels, **labels)

    def _add(self, prefix: str, values: Mapping[str, Any], fields: Mapping[str, tuple[str, dict[str, str]]]) -> None:
        for field, (attr, extra) in fields.items():
            delta = values[field] - self._last.get(prefix + field, 0)
            if delta > 0:
                self.counters[attr].labels(**self.labels, **extra).inc(delta)
            self._last[prefix + field] = values[field]

    def sync(
        self,
        state: Any,
        doc_stats: Any = None,
        hint_stats: Any = None,
        remote_probes: Any = None,
        remote_status: Any = None,
        calibration_overrides: Optional[dict[str, int]] = None,
    ) -> None:
        """Publish ``state``'s (a :class:`~pcr_sglang.core.CacheState`) counters and sizes,
        document reuse's (a :class:`~pcr_sglang.reuse.placement.DocReuseStats`),
        the KV hints' (a :class:`~pcr_sglang.core.hints.HintStats`), the remote tier's
        (the scheduler's probe counters, the I/O process's last ``RemoteStatus``) and the
        calibration gate's overrides (``CalibrationGate.overrides``)."""
        tree = state.tree
        if remote_probes is not None:
            self._add("remote.", asdict(remote_probes), _FEEDS["remote"])
        if remote_status is not None:  # the I/O process's counters (from 0 again after a restart)
            if remote_status.pid != self._remote_pid:
                self._remote_pid = remote_status.pid
                for name in [k for k in self._last if k.startswith("remote-store.")]:
                    del self._last[name]  # a new process: its counts are all new
            self._add(
                "remote-store.",
                {k: int(v) for k, v in remote_status.counters.items()},
                {k: v for k, v in _FEEDS["remote-store"].items() if k in remote_status.counters},
            )
            self._gauge("remote_up").set(1 if remote_status.healthy else 0)
        if hint_stats is not None:
            values = {k: v for k, v in asdict(hint_stats).items() if k in _HINT_KINDS}
            self._add("hint.", values, {name: ("hints", {"kind": name}) for name in values})
        if calibration_overrides is not None:
            self._add(
                "calibration.",
                calibration_overrides,
                {what: ("doc_reuse_calibration_overrides", {"what": what}) for what in calibration_overrides},
            )
        if doc_stats is not None:
            values = asdict(doc_stats)
            self._add("doc.", values, {name: ("doc_reuse", {"kind": name}) for name in values})
        self._add("", asdict(state.stats), _FEEDS["cache"])
        if state.ssd_enabled:
            self._add("ssd.", asdict(state.ssd_stats), _FEEDS["ssd"])
            self._gauge("cached_chunks", tier="ssd").set(tree.ssd_chunks)
            # mutant: ssd-tier-off-only-a-log-line
            self._gauge("ssd_tier_up").set(1 if state.writes_enabled else 0)
        self._gauge("cached_chunks", tier="device").set(tree.device_chunks)
        self._gauge("cached_chunks", tier="host").set(tree.host_chunks)
