"""PCR's Prometheus series are declared once (``METRICS``): the exporter makes them from it,
its field maps name only declared series and existing counters, and docs/architecture.md's
table is written from it."""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import fields
from pathlib import Path

import prometheus_client
import pytest

from pcr_sglang.core.hints import HintStats
from pcr_sglang.core.stats import CacheStats, SSDStats
from pcr_sglang.io.remote_calls import RemoteCounters
from pcr_sglang.sglang_adapter import metrics
from pcr_sglang.sglang_adapter.remote_probes import RemoteProbeStats

REPO = Path(__file__).resolve().parents[3]


def load_metrics_doc():
    spec = importlib.util.spec_from_file_location("metrics_doc", REPO / "scripts" / "metrics_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_of_metrics_is_written_from_the_declaration():
    doc = load_metrics_doc()
    text = doc.DOC.read_text(encoding="utf-8")
    assert doc.rewritten(text) == text, "run python scripts/metrics_doc.py"
    for metric in metrics.METRICS:
        assert f"| `{metric.series}` |" in text


@pytest.mark.parametrize(
    "fed, counters",
    [
        (metrics._COUNTER_FIELDS, CacheStats),
        (metrics._SSD_FIELDS, SSDStats),
        (metrics._REMOTE_PROBE_FIELDS, RemoteProbeStats),
        (metrics._REMOTE_STORE_FIELDS, RemoteCounters),
    ],
)
def test_each_field_map_feeds_declared_series_from_existing_counters(fed, counters):
    declared = {metric.name: metric for metric in metrics.METRICS}
    assert set(fed) <= {f.name for f in fields(counters)}
    for name, value in fed.values():
        assert (value is not None) == bool(declared[name].label), name


def test_the_hint_kinds_are_hint_counters():
    assert set(metrics._HINT_KINDS) <= {f.name for f in fields(HintStats)}


def test_the_exporter_makes_every_declared_series(monkeypatch):
    registry = prometheus_client.CollectorRegistry()
    for name in ("Counter", "Gauge"):
        monkeypatch.setattr(
            prometheus_client, name, functools.partial(getattr(prometheus_client, name), registry=registry)
        )
    made = metrics.PCRMetrics({"model_name": "m"})
    families = {family.name: family for family in registry.collect()}
    for metric in metrics.METRICS:
        family = families[metric.series.removesuffix("_total")]
        assert family.type == ("gauge" if metric.gauge else "counter") and family.documentation == metric.help
        made_one = (made.gauges if metric.gauge else made.counters)[metric.name]
        assert made_one._labelnames == (("model_name", metric.label) if metric.label else ("model_name",))
