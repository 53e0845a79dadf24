"""The SSD tier over many weight updates (an RL run that saves and loads a checkpoint every
step): the namespaces a server leaves are kept for a rollback only within bounds
(``--pcr-ssd-keep-namespaces``, their bytes charged to ``--pcr-ssd-gb``), so the tier never
runs out of room; and when it does switch its writes off, a gauge and ``/server_info``
say so. Over PCR's cache on SGLang's real CPU KV pool, with a real SSD store and I/O
process, moved the way a weight update moves it (``factory.move_namespace``)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from pcr_sglang.core.orders import WriteChunk
from pcr_sglang.sglang_adapter.factory import move_namespace
from pcr_sglang.sglang_adapter.fingerprint import IN_MEMORY_UPDATE_TAG
from pcr_sglang.sglang_adapter.metrics import PCRMetrics
from pcr_sglang.sglang_adapter.report import build_report
from pcr_sglang.tiers.store_dir import list_namespaces
from tests.unit.adapter_harness import CHUNK, Harness, make  # noqa: F401
from tests.unit.sglang_adapter.test_weight_updates import persisted, prompt


def configure(h: Harness, **fields) -> None:
    """Flags as a server would have them (the move reads the scheduler's config)."""
    h.scheduler.config = replace(h.scheduler.config, **fields)


def move(h: Harness, fingerprint: str) -> str:
    """A weight update to ``fingerprint``'s checkpoint (SGLang's flush after it moves the
    tiers); returns the new namespace's directory name."""
    namespace = replace(h.cache.namespace, model_fingerprint=fingerprint)
    move_namespace(h.cache, namespace)
    h.step()
    return namespace.digest().hex()


def on_disk(h: Harness) -> set[str]:
    return {ns.digest_hex for ns in list_namespaces(h.cache.store.root)}


def reusable_chunks(h: Harness, tokens: list[int]) -> int:
    match = h.state.match(iter(h.scheduler.keys.of_tokens(tokens)))
    return match.device + match.host + match.ssd


def test_at_most_the_kept_namespaces_stay_on_disk_oldest_purged_first(make, tmp_path):
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    configure(h, ssd_keep_namespaces=2)
    start = h.cache.store.namespace.hex()
    persisted(h, prompt(100))
    names = {}
    for step, fingerprint in enumerate(("ckpt-a", "ckpt-b", "ckpt-c", "ckpt-d")):
        names[fingerprint] = move(h, fingerprint)
        persisted(h, prompt(200 + 100 * step))
    # Four disk updates: the startup namespace and A were purged, B and C kept, D served.
    assert on_disk(h) == {names["ckpt-b"], names["ckpt-c"], names["ckpt-d"]}
    assert start not in on_disk(h)
    report = build_report(h.cache)["ssd"]["namespaces"]
    assert [k["namespace"] for k in report["kept"]] == [names["ckpt-b"], names["ckpt-c"]]
    assert report["purged"] == 2
    # A rollback to B finds its records; D is kept now, C is the oldest.
    restored = h.state.ssd_stats.restored_chunks
    assert move(h, "ckpt-b") == names["ckpt-b"]
    assert h.state.ssd_stats.restored_chunks == restored + 3
    assert reusable_chunks(h, prompt(300)) == 3
    assert [k["namespace"] for k in build_report(h.cache)["ssd"]["namespaces"]["kept"]] == [
        names["ckpt-c"],
        names["ckpt-d"],
    ]
    assert on_disk(h) == {names["ckpt-b"], names["ckpt-c"], names["ckpt-d"]}
    h.check()


def test_kept_namespaces_are_charged_to_the_ssd_budget(make, tmp_path):
    """A budget of 20 records: kept namespaces may hold 10 of them together, and the served
    namespace's store gets what they leave."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    record = h.cache.store.record_bytes
    configure(h, ssd_keep_namespaces=5, ssd_gb=20 * record / 2**30)
    a = move(h, "ckpt-a")
    assert h.state.config.ssd_capacity_chunks == 20  # nothing kept yet worth a byte
    persisted(h, prompt(100, 4))
    b = move(h, "ckpt-b")
    assert h.state.config.ssd_capacity_chunks == 16  # A's 4 records are charged
    persisted(h, prompt(200, 7))
    c = move(h, "ckpt-c")
    # A and B together (11 records) are over half the budget: A, the oldest, is purged.
    assert a not in on_disk(h) and b in on_disk(h)
    assert h.state.config.ssd_capacity_chunks == 13
    kept = build_report(h.cache)["ssd"]["namespaces"]
    assert kept["kept"] == [{"namespace": b, "bytes": 7 * record}] and kept["kept_bytes"] == 7 * record
    persisted(h, prompt(300, 3))
    assert c in on_disk(h)
    h.check()


def test_an_in_memory_namespace_is_never_kept(make, tmp_path):
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    configure(h, ssd_keep_namespaces=2)
    start = h.cache.store.namespace.hex()
    first = move(h, IN_MEMORY_UPDATE_TAG + "1")
    persisted(h, prompt(100))
    second = move(h, IN_MEMORY_UPDATE_TAG + "2")
    persisted(h, prompt(200))
    move(h, IN_MEMORY_UPDATE_TAG + "3")
    assert first not in on_disk(h) and second not in on_disk(h)
    # Only the startup checkpoint's namespace is kept for a rollback.
    assert [k["namespace"] for k in build_report(h.cache)["ssd"]["namespaces"]["kept"]] == [start]


@pytest.fixture
def metrics():
    """PCR's real Prometheus series, unregistered afterwards (one registry per process)."""
    made = PCRMetrics({"model_name": "test"})
    yield made
    for value in [*made.counters.values(), *made.gauges.values()]:
        REGISTRY.unregister(value)


def test_the_ssd_tier_switching_its_writes_off_is_a_gauge_and_a_server_info_state(make, tmp_path, metrics):
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    persisted(h, prompt(100))
    metrics.sync(h.state)
    up = {"model_name": "test"}
    assert REGISTRY.get_sample_value("sglang:pcr_ssd_tier_up", up) == 1
    assert build_report(h.cache)["ssd"]["tier"] == {"state": "on", "reason": None}
    # The next checkpoint's namespace directory cannot be used (writable by others).
    target = replace(h.cache.namespace, model_fingerprint="ckpt-b").digest().hex()
    os.mkdir(tmp_path / "ssd" / target, 0o700)
    os.chmod(tmp_path / "ssd" / target, 0o777)
    move(h, "ckpt-b")
    persisted(h, prompt(200))  # served, nothing written
    metrics.sync(h.state)
    assert REGISTRY.get_sample_value("sglang:pcr_ssd_tier_up", up) == 0
    tier = build_report(h.cache)["ssd"]["tier"]
    assert tier["state"] == "writes_off" and target in tier["reason"] and "writable by other users" in tier["reason"]
    h.check()


def test_orders_kept_back_for_their_copies_do_not_outlive_a_weight_update(make, tmp_path, monkeypatch):
    """On CUDA an SSD order waits in the executor until the copies touching its host slot
    complete. Such orders used to survive the reset of a weight update and were sent after
    it: the old weights' chunks were written into the new namespace's directory. Here the
    copies are held back the way a GPU's would be (on the CPU they complete inline)."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    h.serve(prompt(100))
    engine = h.scheduler.executor.engine
    monkeypatch.setattr(engine, "host_slot_ready", lambda slot: False)
    h.cache.evict(EvictParams(num_tokens=10**6))  # demoted to host memory: their writes wait for the copies
    assert len(h.scheduler.executor.deferred) == 3
    move(h, "ckpt-b")
    io, sent = h.scheduler.io, []
    submit = io.submit
    monkeypatch.undo()  # the copies complete
    monkeypatch.setattr(io, "submit", lambda order: (sent.append(order), submit(order)))
    h.drain_io()
    assert [o for o in sent if isinstance(o, WriteChunk)] == []  # no write of the old weights' chunks
    assert h.state.ssd_stats.cancelled_writes == 3
    assert h.cache.store.scan() == []
    h.check()
