"""The calibration gate on the scheduler side, over SGLang's real CPU pool (the adapter
harness): a refused request that reaches the scheduler is served without document reuse,
what ``--pcr-doc-reuse-calibration-warn`` lets through is counted in Prometheus, and a
weight update in place to other weights stops document reuse (review N4, N5)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import prometheus_client
import pytest

from pcr_sglang.config import PCRConfig
from pcr_sglang.reuse import settings as reuse_settings
from pcr_sglang.reuse.placement import DocReuse
from pcr_sglang.reuse.setup import calibration_status, with_gate
from pcr_sglang.sglang_adapter.report import build_report
from pcr_sglang.sglang_adapter.weight_updates import WeightsIdentity, around_weight_update
from pcr_sglang.transfer.rope_shift import RopeSpec
from tests.unit.adapter_harness import CHUNK, make  # noqa: F401 - the fixture

COMMITTED = Path(__file__).resolve().parents[3] / "pcr_tools/models/calibrations/smollm2-135m-doc-reuse.json"
LEADING = [7] * 6
DOC = 8


def _calibration(tmp_path, fingerprint: str) -> str:
    """The committed calibration (blend R=0.15, gradual), as measured on ``fingerprint``."""
    raw = json.loads(COMMITTED.read_text())
    raw["model_fingerprint"] = fingerprint
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _with_docs(h, config: PCRConfig, fingerprint: str) -> DocReuse:
    """What ``attach_doc_reuse`` builds (it needs a real model for its RoPE self-test)."""
    kv = h.allocator.get_kvcache()
    docs = DocReuse(
        h.state,
        reuse_settings.recompute(config),
        CHUNK,
        0,
        RopeSpec(8, 8, True, (1.0, 0.1, 0.01, 0.001)),
        list(zip(kv.k_buffer, kv.v_buffer)),
        h.allocator,
        h.scheduler.keyer,
        h.scheduler.executor.free_private,
    )
    docs.calibration = with_gate(calibration_status(config, fingerprint), docs.server.gate)
    h.scheduler.docs = docs
    return docs


def _marked(h, rid: str, **custom):
    tokens = LEADING + list(range(100, 100 + DOC)) + list(range(200, 200 + DOC)) + [5, 5, 5]
    req = h.request(tokens, rid)
    bounds = [len(LEADING), len(LEADING) + DOC, len(LEADING) + DOC, len(LEADING) + 2 * DOC]
    req.sampling_params = SimpleNamespace(custom_params={"pcr_doc_bounds": bounds, **custom})
    return req


def _reused(docs: DocReuse, req) -> bool:
    """Whether the scheduler takes ``req``'s documents up for reuse (their canonical chains)."""
    return bool(docs.canonical_chain_keys(req))


def test_a_refused_request_that_reaches_the_scheduler_is_served_without_reuse(make, tmp_path):
    """The tokenizer refuses it first (HTTP 400); a path that skipped that check still gets
    no reuse in a mode, selector or ratio the gate refused."""
    h = make(model_fingerprint="a" * 32)
    config = PCRConfig(
        enabled=True, chunk_size=CHUNK, doc_reuse="blend", doc_reuse_calibration=_calibration(tmp_path, "a" * 32)
    )
    docs = _with_docs(h, config, "a" * 32)
    assert _reused(docs, _marked(h, "inside"))
    for i, custom in enumerate(
        ({"pcr_doc_reuse": "concat"}, {"pcr_doc_recompute_ratio": 0.0}, {"pcr_doc_selector": "deviation"})
    ):
        req = _marked(h, f"outside-{i}", **custom)
        assert not _reused(docs, req)
        assert docs.plan(req, req.origin_input_ids[:-1], 0) is None
    assert docs.server.gate.overrides == dict.fromkeys(docs.server.gate.overrides, 0)


def test_with_warn_overrides_are_served_and_counted_in_prometheus(make, tmp_path, monkeypatch):
    registry = prometheus_client.CollectorRegistry()
    for name in ("Counter", "Gauge"):  # PCRMetrics' series in a registry of this test's
        monkeypatch.setattr(
            prometheus_client, name, functools.partial(getattr(prometheus_client, name), registry=registry)
        )
    from pcr_sglang.sglang_adapter.metrics import PCRMetrics

    h = make(model_fingerprint="a" * 32)
    config = PCRConfig(
        enabled=True,
        chunk_size=CHUNK,
        doc_reuse="blend",
        doc_reuse_calibration_warn=True,
        doc_reuse_calibration=_calibration(tmp_path, "a" * 32),
    )
    docs = _with_docs(h, config, "a" * 32)
    h.cache.metrics = PCRMetrics({"model_name": "m"})
    for rid, custom in (
        ("r1", {"pcr_doc_reuse": "concat"}),
        ("r2", {"pcr_doc_recompute_ratio": 0.05}),
        ("r3", {"pcr_doc_recompute_ratio": 0.0, "pcr_doc_anchor_tokens": 2}),
        ("r4", {}),
    ):
        req = _marked(h, rid, **custom)
        assert _reused(docs, req) and _reused(docs, req)  # asked twice: counted once
    h.cache.on_scheduler_step([], busy=False)

    def count(what: str) -> float:
        return registry.get_sample_value(
            "sglang:pcr_doc_reuse_calibration_overrides_total", {"model_name": "m", "what": what}
        )

    assert (count("mode"), count("recompute_ratio"), count("anchor_tokens"), count("selector")) == (1, 2, 1, None)
    assert build_report(h.cache)["doc_reuse"]["calibration"]["overrides"]["recompute_ratio"] == 2


def _disk_update(h, path: Path):
    def flushing(manager, recv_req):
        h.cache.reset()
        h.cache.token_to_kv_pool_allocator.clear()
        return SimpleNamespace(success=True)

    around_weight_update(
        "update_weights_from_disk",
        flushing,
        SimpleNamespace(scheduler=SimpleNamespace(tree_cache=h.cache)),
        SimpleNamespace(model_path=str(path)),
    )


def test_a_weight_update_to_other_weights_stops_document_reuse_and_says_why(make, tmp_path):
    """Review N5: after ``/update_weights_from_disk`` to other weights, the server served
    document reuse at the K or R calibrated for the old ones and reported
    ``meets_target: true``. Now the fingerprint is checked again where the namespace moves."""
    model_a, model_b = tmp_path / "a", tmp_path / "b"
    for folder, byte in ((model_a, b"A"), (model_b, b"B")):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(byte * 4096)
    identity = WeightsIdentity(SimpleNamespace(hf_config=None), str(model_a))
    fingerprint_a = identity.of_checkpoint(str(model_a))
    h = make(model_fingerprint=fingerprint_a)
    h.cache.weights_identity = identity
    config = PCRConfig(
        enabled=True, chunk_size=CHUNK, doc_reuse="blend", doc_reuse_calibration=_calibration(tmp_path, fingerprint_a)
    )
    docs = _with_docs(h, config, fingerprint_a)
    assert _reused(docs, _marked(h, "before"))

    _disk_update(h, model_b)
    calibration = build_report(h.cache)["doc_reuse"]["calibration"]
    assert "the weights changed in place" in calibration["stopped"] and calibration["meets_target"] is None
    assert "calibration.json was measured on " + fingerprint_a[:16] in calibration["stopped"]
    req = _marked(h, "after")
    assert not _reused(docs, req) and docs.plan(req, req.origin_input_ids[:-1], 0) is None

    _disk_update(h, model_a)  # a rollback to the calibrated weights
    calibration = build_report(h.cache)["doc_reuse"]["calibration"]
    assert calibration["stopped"] is None and calibration["meets_target"] is True
    assert _reused(docs, _marked(h, "rolled-back"))

    def in_memory(manager, recv_req):
        h.cache.reset()
        return SimpleNamespace(success=True)

    around_weight_update(
        "update_weights_from_tensor",
        in_memory,
        SimpleNamespace(scheduler=SimpleNamespace(tree_cache=h.cache)),
        SimpleNamespace(),
    )
    assert not _reused(docs, _marked(h, "in-memory"))
    assert build_report(h.cache)["doc_reuse"]["calibration"]["stopped"]


@pytest.mark.parametrize("warn", [False, True])
def test_without_a_calibration_a_weight_update_changes_nothing_of_document_reuse(make, tmp_path, warn):
    h = make(model_fingerprint="a" * 32)
    config = PCRConfig(enabled=True, chunk_size=CHUNK, doc_reuse="blend", doc_reuse_calibration_warn=warn)
    docs = _with_docs(h, config, "a" * 32)
    assert docs.server.gate is None and docs.calibration == {"file": None, "measured": False}

    def in_memory(manager, recv_req):
        h.cache.reset()
        return SimpleNamespace(success=True)

    around_weight_update(
        "update_weights_from_tensor",
        in_memory,
        SimpleNamespace(scheduler=SimpleNamespace(tree_cache=h.cache)),
        SimpleNamespace(),
    )
    assert _reused(docs, _marked(h, "after"))
