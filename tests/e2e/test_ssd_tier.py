"""The SSD tier through a real server on CPU: hits beyond device + DRAM, warm restart,
KV hints read ahead after it, crash during write-back, corrupt records, a full disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import uuid

import pytest
import requests

from pcr_sglang.tiers.records import _FIELDS
from pcr_tools.launcher import ServerProcess
from tests.e2e.helpers import (
    GREEDY,
    TIERED_ARGS,
    generate_greedy,
    serving,
    ssd_server,
    wait_for_write_back,
)

pytestmark = [pytest.mark.e2e, pytest.mark.paced]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pcr-ssd") / "store"


@pytest.fixture(scope="module")
def damaged_payloads() -> list:
    """Records the restart test damaged in a way only a full read detects."""
    return []


@pytest.fixture(scope="module")
def servers(tiny_model, baseline_server, store_dir, tmp_path_factory):
    ssd = ssd_server(tiny_model, store_dir)
    # Its disk keeps a reserve of all but ~200 MB of what is free now; the test then
    # fills those 200 MB, as another tenant of the disk would.
    full_dir = tmp_path_factory.mktemp("pcr-ssd-full") / "store"
    free_gb = shutil.disk_usage(full_dir.parent).free / 2**30
    full = ServerProcess(
        tiny_model,
        (
            *TIERED_ARGS,
            "--pcr-ssd-path",
            str(full_dir),
            "--pcr-ssd-gb",
            "0.5",
            "--pcr-ssd-reserve-gb",
            f"{free_gb - 0.2:.6f}",
        ),
    )
    full.filler_dir = full_dir.parent
    everything = {"ssd": ssd, "full": full}
    with serving(everything, shared={"baseline": baseline_server}):
        yield everything


def _leaf_records(store_dir) -> list:
    """The record files no other record names as its parent, deepest first (read from
    unverified headers: only for choosing which files to damage)."""
    headers = {}
    for path in store_dir.rglob("*.chunk"):
        with open(path, "rb") as f:
            fields = _FIELDS.unpack_from(f.read(_FIELDS.size))
        headers[path] = (fields[4], fields[5], fields[7])  # key, parent key, depth
    parents = {parent for _, parent, _ in headers.values()}
    leaves = [path for path, (key, _, _) in headers.items() if key not in parents]
    return sorted(leaves, key=lambda path: (-headers[path][2], path.name))


def replay_with_details(server, prompts):
    outs = [server.generate({"input_ids": p, "sampling_params": GREEDY}) for p in prompts]
    return [o["output_ids"] for o in outs], [o["meta_info"].get("cached_tokens_details") or {} for o in outs]


def test_working_set_beyond_device_and_dram_is_served_from_ssd(servers, rag_prompt_ids, baseline_outputs):
    server = servers["ssd"]
    results = generate_greedy(server, rag_prompt_ids, concurrency=4)
    assert [ids for ids, _ in results] == baseline_outputs
    wait_for_write_back(server)
    outputs, details = replay_with_details(server, rag_prompt_ids[:10])
    assert outputs == baseline_outputs[:10]
    assert sum(d.get("storage", 0) for d in details) > 0, details  # hits read from SSD
    state = server.pcr_state(check_invariants=True)
    ssd = state["ssd"]
    assert ssd["counters"]["hit_chunks"] > 0 and ssd["counters"]["written_chunks"] > 0, ssd
    assert ssd["store"]["corrupt_chunks"] == 0 and ssd["writes_enabled"]
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0
    assert state["host_pool_slots"] - state["host_pool_free_slots"] == state["tree"]["host_chunks"]


def test_restart_finds_the_persisted_chunks_and_skips_corrupt_ones(servers, tiny_model, store_dir, damaged_payloads):
    server = servers["ssd"]
    wait_for_write_back(server)
    server.stop()
    # Damage three records while the server is down: a flipped payload byte, a truncated
    # file and garbage; and leave a partial write, as a crash would.
    # Only leaves are damaged: that orphans no other record, so the chains the KV-hint
    # tests below rely on stay whole whichever files these are.
    files = _leaf_records(store_dir)
    assert len(files) > 10
    data = bytearray(files[0].read_bytes())
    data[-3] ^= 0xFF
    files[0].write_bytes(bytes(data))
    damaged_payloads.append(files[0])
    files[1].write_bytes(files[1].read_bytes()[:-100])
    files[2].write_bytes(b"\0" * 4096)
    (files[3].parent / "partial.123.tmp").write_bytes(b"half a chunk")
    restarted = ssd_server(tiny_model, store_dir)
    # Each record waits 0.1 s complete in its temp file before its rename, so that the next
    # test's kill -9 lands in the middle of a write.
    restarted.env = {**restarted.env, "PCR_IO_TEST_FAULTS": '{"write_delay_s": 0.1}'}
    servers["ssd"] = restarted
    restarted.start()
    state = restarted.pcr_state()
    assert state["ssd"]["counters"]["restored_chunks"] > 10
    assert state["ssd"]["store"]["corrupt_chunks"] >= 2  # truncated and garbage: found on open
    assert state["ssd"]["store"]["discarded_tmp_files"] == 1
    assert state["ssd"]["counters"]["orphaned_records"] == 0  # only leaves were damaged


# KV hints (kv_hints action pcr.lookahead_prefetch) on the restarted server, before any
# traffic: every chain is on SSD only, so what a hint reads ahead shows as a host hit where
# the same request without a hint reads SSD on demand (``storage``).
HINTED = slice(40, 43)  # prompts no other test sends before these


def _hint(payload=None, version="1") -> dict:
    from pcr_client.hints import hint_envelope

    return hint_envelope({"hint_only": True, "ttl_s": 20} if payload is None else payload, uuid.uuid4().hex, version)


def _hint_counters(server) -> dict:
    state = server.pcr_state()
    ssd = state["ssd"]
    return {
        **state["hints"]["counters"],
        **{k: v for k, v in ssd["counters"].items() if k.startswith("hint_")},
        "forwards": state["forwards"],
        "reads_in_flight": ssd["reads_in_flight"],
    }


def _send_hint(server, ids, **extra) -> dict:
    return server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "kv_hints": _hint(), **extra})


@pytest.mark.parametrize(
    "payload, version, message",
    [
        ({"ttl_s": -5}, "1", "ttl_s must be a number of seconds"),
        ({"hint_only": "yes"}, "1", "hint_only must be true or false"),
        ({}, "9", "action_version '9' is not supported"),
    ],
)
def test_a_malformed_kv_hint_gets_http_400_naming_the_problem(servers, rag_prompt_ids, payload, version, message):
    response = requests.post(
        servers["ssd"].base_url + "/generate",
        timeout=60,
        json={
            "input_ids": rag_prompt_ids[0],
            "sampling_params": {"max_new_tokens": 0},
            "kv_hints": _hint(payload, version),
        },
    )
    assert response.status_code == 400, response.text
    assert message in response.text


def test_a_kv_hint_then_the_final_request_finds_its_chain_in_host_memory(servers, rag_prompt_ids, baseline_outputs):
    server = servers["ssd"]
    prompt, control = rag_prompt_ids[HINTED][:2]
    before = _hint_counters(server)
    out = _send_hint(server, prompt)
    assert out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0, "pcr_hint": "registered"}
    deadline = time.monotonic() + 30
    while True:  # the prefetcher reads the hinted chain in the background
        counters = _hint_counters(server)
        if (
            counters["hint_issued"] > before["hint_issued"] and counters["reads_in_flight"] == 0
        ) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counters["hint_issued"] > before["hint_issued"] and counters["reads_in_flight"] == 0, counters
    assert counters["forwards"] == before["forwards"]  # a hint-only request runs no forward
    assert counters["registered"] == before["registered"] + 1
    final = server.generate({"input_ids": prompt, "sampling_params": GREEDY})
    details = final["meta_info"]["cached_tokens_details"]
    assert final["output_ids"] == baseline_outputs[HINTED][0]
    assert details.get("host", 0) > 0 and details.get("storage", 0) == 0, details
    after = _hint_counters(server)
    assert after["hint_in_time"] > before["hint_in_time"] and after["consumed"] == before["consumed"] + 1
    # The control: a prompt nobody hinted reads its chain from SSD when it arrives.
    unhinted = server.generate({"input_ids": control, "sampling_params": GREEDY})
    assert unhinted["output_ids"] == baseline_outputs[HINTED][1]
    assert unhinted["meta_info"]["cached_tokens_details"].get("storage", 0) > 0


def test_a_kv_hint_under_another_tenants_salt_prefetches_nothing(servers, rag_prompt_ids, baseline_outputs):
    server = servers["ssd"]
    prompt = rag_prompt_ids[HINTED][2]
    before = _hint_counters(server)
    out = _send_hint(server, prompt, cache_salt="another-tenant")
    assert out["meta_info"]["finish_reason"]["pcr_hint"] == "registered"
    time.sleep(1.0)  # several scheduler steps
    assert _hint_counters(server)["hint_issued"] == before["hint_issued"]  # no chain of this tenant
    final = server.generate({"input_ids": prompt, "sampling_params": GREEDY})
    assert final["output_ids"] == baseline_outputs[HINTED][2]
    ssd = server.pcr_state()["ssd"]
    assert final["meta_info"]["cached_tokens_details"].get("storage", 0) > 0, json.dumps(
        [ssd["cost_model"], ssd["counters"], ssd["prefetch_timeliness"]]
    )


def test_a_kv_hint_in_upstreams_words_is_registered_and_the_capability_advertised(servers, rag_prompt_ids):
    """``kv.prefetch`` version ``1.0`` (SGLang's envelope as it is converging) is the same
    hint as ``pcr.lookahead_prefetch``; /server_info says so with ``kv_hint.prefetch.v1``."""
    server = servers["ssd"]
    before = _hint_counters(server)
    envelope = _hint()
    envelope["actions"][0].update(action_type="kv.prefetch", action_version="1.0")
    out = server.generate(
        {"input_ids": rag_prompt_ids[43], "sampling_params": {"max_new_tokens": 0}, "kv_hints": envelope}
    )
    assert out["meta_info"]["finish_reason"]["pcr_hint"] == "registered"
    assert _hint_counters(server)["registered"] == before["registered"] + 1
    assert server.pcr_state()["hints"]["capabilities"][0] == "kv_hint.prefetch.v1"
    envelope["actions"][0]["action_version"] = "1"
    refused = requests.post(
        server.base_url + "/generate",
        timeout=60,
        json={"input_ids": rag_prompt_ids[43], "sampling_params": {"max_new_tokens": 0}, "kv_hints": envelope},
    )
    assert refused.status_code == 400 and "kv.prefetch action_version '1' is not supported" in refused.text


def test_a_hyde_pipeline_on_the_frontend_sends_its_hint_and_searches_exactly(servers):
    """The DSL program runs its pre-retrieval generation while the look-ahead and the KV
    hint go out; its search is faiss's IVF search of its query, and its answer is what the
    same final prompt gets when sent directly."""
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    from pcr_client.rag.budget import BudgetModel
    from pcr_client.rag.embedder import embed_texts, load_embedder
    from pcr_client.rag.fast_host import HostClusterTier
    from pcr_client.rag.ivf import IVFDatastore
    from pcr_client.rag.lookahead import LookaheadRetriever
    from pcr_client.rag.pipelines import KVHinter, PipelineConfig, Pipelines, render_rag_prompt
    from pcr_tools.data import load_wiki_articles

    server = servers["ssd"]
    articles = load_wiki_articles()[700:820]
    texts = [f"{a.title}. {a.text[:300]}" for a in articles]
    datastore = IVFDatastore.build(embed_texts(texts), 8, seed=0)
    embedder = load_embedder()
    retriever = LookaheadRetriever(
        datastore,
        embedder.encode,
        nprobe=2,
        k=3,
        tier=HostClusterTier(datastore.table, 8 << 20),
        budget=BudgetModel(stage_bytes={"hyde": 4 << 20}),
    )
    hinter = KVHinter(server.base_url)
    pipelines = Pipelines(
        retriever, texts, RuntimeEndpoint(server.base_url), hinter, PipelineConfig(hyde_tokens=16, answer_tokens=8)
    )
    before = _hint_counters(server)
    try:
        result = pipelines.hyde(f"What is {articles[5].title} known for?")
    finally:
        retriever.close()
        hinter.close()
    scores, ids = datastore.search(embedder.encode(result.queries), 4, 2)
    expected = [int(i) for i in ids[0][:3]]
    if set(result.doc_ids) != set(expected):  # rounding may only swap a tie at the third place
        assert abs(scores[0][2] - scores[0][3]) < 1e-5 and set(result.doc_ids) <= set(ids[0].tolist())
    assert result.searches[0].probed == 2
    assert hinter.stats.sent == 1 and hinter.stats.registered == 1 and hinter.stats.failed == 0
    assert _hint_counters(server)["registered"] == before["registered"] + 1
    direct = server.generate(
        {
            "text": render_rag_prompt([texts[i] for i in result.doc_ids], result.question),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
    )
    assert result.answer == direct["text"].strip()


def test_after_a_restart_every_prompt_is_served_right_from_ssd(servers, rag_prompt_ids, baseline_outputs):
    restarted = servers["ssd"]
    # The tests before this one wrote new chunks, each held 0.1 s by the write-delay knob:
    # reads queued behind them could outlast a request's wait (recomputed, no SSD hit).
    wait_for_write_back(restarted)
    outputs, details = replay_with_details(restarted, rag_prompt_ids[:10])
    assert outputs == baseline_outputs[:10]
    assert sum(d.get("storage", 0) for d in details) > 0, details
    results = generate_greedy(restarted, rag_prompt_ids, concurrency=4)
    assert [ids for ids, _ in results] == baseline_outputs
    state = restarted.pcr_state(check_invariants=True)
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0


def test_kill_9_during_write_back_then_restart(
    servers, tiny_model, store_dir, damaged_payloads, rag_prompt_ids, baseline_outputs
):
    from pcr_tools.store_cli import main as store_cli

    for path in damaged_payloads:  # still there unless a read found it: verify below checks the crash alone
        path.unlink(missing_ok=True)
    server = servers["ssd"]
    server.generate({"input_ids": rag_prompt_ids[0], "sampling_params": GREEDY})
    written_before = wait_for_write_back(server)["ssd"]["counters"]["written_chunks"]
    records_before = len(list(store_dir.rglob("*.chunk")))
    # Heavy write-back: new chunks (a new first token changes every chunk's key) from
    # several clients; kill -9 while the server reports writes in flight.
    errors: list[BaseException] = []

    def client(offset: int) -> None:
        for ids in rag_prompt_ids[offset::4]:
            try:
                server.generate({"input_ids": [7, *ids], "sampling_params": GREEDY})
            except Exception as e:  # the server is killed under us
                errors.append(e)
                return

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    in_flight_at_kill = io_pid = 0
    while time.monotonic() < deadline:
        ssd = server.pcr_state()["ssd"]
        # 20 of this test's own writes done (the server wrote others before it), more in flight.
        if ssd["counters"]["written_chunks"] >= written_before + 20 and ssd["writes_in_flight"] > 0:
            in_flight_at_kill, io_pid = ssd["writes_in_flight"], ssd["io_process"]["pid"]
            break
        time.sleep(0.05)
    # A crash of the machine takes the I/O process at the same instant as the server.
    if io_pid:
        os.kill(io_pid, signal.SIGKILL)
    server.kill()
    for t in threads:
        t.join(timeout=60)
    assert in_flight_at_kill > 0, "the kill must land while writes are in flight"
    # Records the kill caught in their temp files (each waits 0.1 s there before its rename;
    # whether one is caught depends on the instant, so it is not required): discarded below.
    cut_off = list(store_dir.rglob("*.tmp"))
    # The crash state itself, before any server touches it: every record under its final
    # name verifies in full (a write is visible only once complete), and new ones landed.
    assert store_cli(["verify", str(store_dir)]) == 0
    records_after_kill = len(list(store_dir.rglob("*.chunk")))
    assert records_after_kill > records_before
    restarted = ssd_server(tiny_model, store_dir)
    servers["ssd"] = restarted
    restarted.start()
    state = restarted.pcr_state()
    # Every complete record is adopted (none is lost to the crash), none fails; only a
    # record whose parent's write was cut off is unreachable.
    counters = state["ssd"]["counters"]
    assert counters["restored_chunks"] + counters["orphaned_records"] == records_after_kill, counters
    assert state["ssd"]["store"]["corrupt_chunks"] == 0
    assert state["ssd"]["store"]["discarded_tmp_files"] >= len(cut_off) and not list(store_dir.rglob("*.tmp"))
    outputs, _ = replay_with_details(restarted, [[7, *ids] for ids in rag_prompt_ids[:8]])
    assert outputs == [
        ids for ids, _ in generate_greedy(servers["baseline"], [[7, *ids] for ids in rag_prompt_ids[:8]])
    ]
    outputs, _ = replay_with_details(restarted, rag_prompt_ids[:10])
    assert outputs == baseline_outputs[:10]


def test_full_disk_keeps_serving_every_request(servers, rag_prompt_ids, baseline_outputs):
    server = servers["full"]
    filler = server.filler_dir / "filler"
    with open(filler, "wb") as f:  # the disk fills up under the running server
        os.posix_fallocate(f.fileno(), 0, 300 << 20)
    try:
        results = generate_greedy(server, rag_prompt_ids, concurrency=4)
    finally:
        filler.unlink()
    assert [ids for ids, _ in results] == baseline_outputs
    state = wait_for_write_back(server)
    ssd = state["ssd"]
    assert ssd["counters"]["write_errors"] >= 1 and not ssd["writes_enabled"], ssd
    outputs, _ = replay_with_details(server, rag_prompt_ids[:10])
    assert outputs == baseline_outputs[:10]
    assert server.pcr_state(check_invariants=True)["invariants"]["ok"]


def test_bad_ssd_path_fails_at_startup(tiny_model, tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    server = ssd_server(tiny_model, a_file)
    with pytest.raises(RuntimeError, match="not a writable directory"):
        server.start()
