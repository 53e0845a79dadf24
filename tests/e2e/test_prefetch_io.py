"""Queue-based prefetch and the I/O process through a real server on CPU: correctness under
a deep queue, no disk I/O in the scheduler, kill -9 of the I/O process and of the server;
and SGLang's KV cache events from the same server, replayed against its tree."""

from __future__ import annotations

import json
import os
import signal
import time

import msgspec
import psutil
import pytest
import requests
import zmq
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from pcr_sglang.core.keys import CacheNamespace, chunk_keys, root_key
from pcr_sglang.sglang_adapter.kv_events import block_hash
from pcr_tools.launcher import free_port
from tests.conftest import CHUNK_SIZE
from tests.e2e.helpers import (
    GREEDY,
    TIERED_ARGS,
    generate_greedy,
    prometheus_counts,
    serving,
    ssd_server,
    wait_for_write_back,
)

pytestmark = [pytest.mark.e2e, pytest.mark.paced]


@pytest.fixture(scope="module")
def servers(tiny_model, baseline_server, tmp_path_factory):
    from pcr_tools.launcher import ServerProcess

    # It publishes KV cache events, which the last test replays (SGLang's replay socket
    # keeps every batch since the start, so no subscriber has to be there first).
    events = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "bind": True,
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "buffer_steps": 1_000_000,
        "topic": "kv",
    }
    prefetch = ssd_server(
        tiny_model,
        tmp_path_factory.mktemp("pcr-prefetch") / "store",
        "--pcr-prefetch-window",
        "16",
        "--enable-metrics",
        "--kv-events-config",
        json.dumps(events),
    )
    prefetch.kv_events = events
    # Host memory of ~100 chunks for a working set of ~1,600: every burst of evictions
    # cycles host slots many times over (the benchmark that found a batched-copy bug).
    churn = ServerProcess(
        tiny_model,
        (
            *TIERED_ARGS[:-1],
            "0.003",
            "--pcr-ssd-path",
            str(tmp_path_factory.mktemp("pcr-churn") / "store"),
            "--pcr-ssd-gb",
            "0.5",
            "--pcr-ssd-reserve-gb",
            "0",
        ),
    )
    everything = {"prefetch": prefetch, "churn": churn}
    with serving(everything, shared={"baseline": baseline_server}):
        yield everything


def io_pid(server) -> int:
    return server.pcr_state()["ssd"]["io_process"]["pid"]


PROMETHEUS_OUTCOMES = {
    "issued": "prefetch_issued",
    "in_time": "prefetch_in_time",
    "late": "prefetch_late",
    "on_demand": "on_demand_reads",
}


def test_deep_queue_with_prefetch_matches_baseline_and_scheduler_does_no_disk_io(
    servers, rag_prompt_ids, baseline_outputs
):
    server = servers["prefetch"]
    results = generate_greedy(server, rag_prompt_ids, concurrency=4)  # fills all tiers
    assert [ids for ids, _ in results] == baseline_outputs
    wait_for_write_back(server)
    # Replay with many clients at once: the waiting queue is deep, its SSD chunks prefetched.
    replay = generate_greedy(server, rag_prompt_ids, concurrency=16)
    assert [ids for ids, _ in replay] == baseline_outputs
    state = server.pcr_state(check_invariants=True)
    ssd = state["ssd"]
    counters = ssd["counters"]
    assert counters["prefetch_issued"] > 0 and counters["prefetch_in_time"] > 0, counters
    assert counters["max_queue_depth"] > 1
    assert counters["written_chunks"] > 0 and counters["hit_chunks"] > 0
    # Every chunk read or written went through the I/O process: this process's own store
    # did no payload I/O (it only scanned headers at startup).
    assert ssd["store"]["read_chunks"] == 0 and ssd["store"]["written_chunks"] == 0, ssd["store"]
    assert ssd["io_process"]["healthy"]
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0
    assert state["host_pool_io_slots"] == 0
    # Prometheus (published once per scheduler pass; a /server_info call makes one) counts
    # the same outcomes: a chunk is counted late only when its request is admitted, so no
    # count is ever taken back, which a Prometheus counter could not follow.
    deadline = time.monotonic() + 30
    while True:
        counters = server.pcr_state()["ssd"]["counters"]
        wanted = {outcome: float(counters[field]) for outcome, field in PROMETHEUS_OUTCOMES.items()}
        exported = prometheus_counts(server, "sglang:pcr_prefetch_chunks_total", "outcome")
        agree = all(exported.get(o, 0.0) == v for o, v in wanted.items())
        if agree or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert agree, (exported, wanted)


def test_host_slots_cycling_under_8_clients_keep_every_output_right(servers, rag_prompt_ids, baseline_outputs):
    """400 requests from 8 clients through a host tier of ~100 chunks: each eviction burst
    demotes, evicts and reuses host slots many times, reads land and leave, and every
    output still equals the no-cache baseline."""
    server = servers["churn"]
    prompts = [rag_prompt_ids[i % 40] for i in range(400)]
    results = generate_greedy(server, prompts, concurrency=8)
    wrong = [i for i, (ids, _) in enumerate(results) if ids != baseline_outputs[i % 40]]
    assert not wrong, f"{len(wrong)} of {len(prompts)} outputs differ from the baseline"
    state = server.pcr_state(check_invariants=True)
    assert state["counters"]["host_evicted_chunks"] > 10 * state["host_pool_slots"], state["counters"]
    assert state["ssd"]["counters"]["hit_chunks"] > 0
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0


def wait_until_settled(server, timeout_s: float = 90) -> dict:
    """Poll until the I/O process is healthy with nothing in flight; the state then."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = server.pcr_state(check_invariants=True)
        ssd = state["ssd"]
        if (
            ssd["io_process"]["healthy"]
            and not ssd["reads_in_flight"]
            and not ssd["writes_in_flight"]
            and not state["requests"]["tracked"]
        ) or time.monotonic() > deadline:
            return state
        generate_greedy(server, [[7] * 40])  # scheduler steps drive the supervisor
        time.sleep(0.5)


def test_an_io_process_stopped_for_30_s_costs_no_request_and_no_slot(servers, rag_prompt_ids, baseline_outputs):
    """SIGSTOP the I/O process for 30 s while requests keep arriving: every request
    completes with the right tokens and no slot leaks. (How long the scheduler's steps
    take meanwhile is a timing, not asserted here: ``/server_info``'s step histograms show it.)"""
    server = servers["prefetch"]
    wait_for_write_back(server)
    pid = io_pid(server)
    os.kill(pid, signal.SIGSTOP)
    outputs, start = [], time.monotonic()
    try:
        while time.monotonic() - start < 30:
            i = len(outputs) % len(rag_prompt_ids)
            batch = rag_prompt_ids[i : i + 8]
            outputs += [(i + k, ids) for k, (ids, _) in enumerate(generate_greedy(server, batch, concurrency=8))]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the supervisor killed it after 30 s of silence
    assert len(outputs) >= 16
    assert all(ids == baseline_outputs[i] for i, ids in outputs)
    state = wait_until_settled(server)
    assert state["ssd"]["io_process"]["healthy"], state["ssd"]
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0
    slots = state["host_slots"]
    assert slots["reserved"] == slots["filling"] == slots["releasing"] == 0, slots
    assert state["host_pool_slots"] - state["host_pool_free_slots"] == state["tree"]["host_chunks"]
    assert state["device_pool_free_tokens"] + state["cached_tokens"] == state["device_pool_tokens"]


def test_kill_9_of_the_io_process_costs_hits_not_requests(servers, rag_prompt_ids, baseline_outputs):
    server = servers["prefetch"]
    pid = io_pid(server)
    os.kill(pid, signal.SIGKILL)
    results = generate_greedy(server, rag_prompt_ids[:20], concurrency=8)
    assert [ids for ids, _ in results] == baseline_outputs[:20]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = server.pcr_state()
        if state["ssd"]["io_process"]["healthy"] and state["ssd"]["io_process"]["pid"] != pid:
            break
        generate_greedy(server, rag_prompt_ids[:1])  # scheduler steps drive the supervisor
        time.sleep(0.5)
    ssd = state["ssd"]
    assert ssd["io_process"]["healthy"] and ssd["io_process"]["pid"] != pid, ssd
    assert ssd["counters"]["io_failures"] >= 1 and ssd["counters"]["io_restarts"] >= 1
    hits_before = ssd["counters"]["hit_chunks"]
    results = generate_greedy(server, rag_prompt_ids, concurrency=4)
    assert [ids for ids, _ in results] == baseline_outputs
    assert server.pcr_state()["ssd"]["counters"]["hit_chunks"] > hits_before  # hits resume


def test_kill_9_of_the_server_leaves_no_io_process(servers, tiny_model, tmp_path):
    server = ssd_server(tiny_model, tmp_path / "store")
    server.start()
    pid = io_pid(server)
    assert psutil.pid_exists(pid)
    server.kill()
    deadline = time.monotonic() + 10
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break  # dead, waiting to be reaped by init
        except psutil.NoSuchProcess:
            break
        assert time.monotonic() < deadline, "the I/O process outlived its server"
        time.sleep(0.2)


def replayed_events(replay_endpoint: str) -> list:
    """Every event the server published since it started, in order (SGLang's replay
    protocol: the first sequence number asked for, then batches until an end marker)."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay_endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        events, expected_seq = [], 0
        while True:
            _, topic, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return events
            assert topic == b"kv" and int.from_bytes(seq, "big") == expected_seq  # none lost
            expected_seq += 1
            events.extend(decoder.decode(payload).events)
    finally:
        sock.close()


def mirror(events) -> tuple[dict[str, set[int]], dict[int, tuple]]:
    """What an event-driven router rebuilds: block hashes per medium, (parent, tokens) per
    block; with the checks a router relies on (a parent is known, nothing stored twice in
    a medium or removed unstored)."""
    media: dict[str, set[int]] = {}
    blocks_seen: dict[int, tuple] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            media.clear()
        elif isinstance(event, BlockStored):
            assert event.block_size == CHUNK_SIZE and len(event.token_ids) == CHUNK_SIZE * len(event.block_hashes)
            known = set().union(*media.values()) | set(event.block_hashes)
            assert event.parent_block_hash is None or event.parent_block_hash in known, event
            blocks = media.setdefault(event.medium, set())
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                assert h not in blocks, (event.medium, h)
                blocks.add(h)
                blocks_seen[h] = (parent, list(event.token_ids[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]))
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in media.get(event.medium, set()), (event.medium, h)
                media[event.medium].discard(h)
    return media, blocks_seen


def expected_blocks(server, sequences) -> dict[int, tuple]:
    """(parent hash, tokens) of every whole chunk of ``sequences``, by block hash: a block
    hash is its chunk key's first 8 bytes, in the server's namespace."""
    ns = CacheNamespace(**server.pcr_state()["namespace"])
    expected = {}
    for seq in sequences:
        parent = None
        for i, key in enumerate(chunk_keys(root_key(ns.chain_digest()), seq, CHUNK_SIZE)):
            expected[block_hash(key)] = (parent, list(seq[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]))
            parent = block_hash(key)
    return expected


def test_kv_cache_events_replayed_hold_what_the_tree_holds(servers, rag_prompt_ids, baseline_outputs):
    """After this module's traffic (a deep queue, host churn, the I/O process killed), the
    server's published events, replayed, give per medium exactly the tree's chunk counts,
    and every stored block is a chunk of a sequence it served, under its true parent."""
    server = servers["prefetch"]
    info = requests.get(f"{server.base_url}/server_info", timeout=30).json()
    assert info["kv_events"]["block_size"] == CHUNK_SIZE  # PCR's chunks, not SGLang's page size
    driving = [7] * 40  # the supervisor test's prompt
    served = [p + out for p, out in zip(rag_prompt_ids, baseline_outputs)]
    served.append(
        driving + servers["baseline"].generate({"input_ids": driving, "sampling_params": GREEDY})["output_ids"]
    )
    expected = expected_blocks(server, served)
    deadline = time.monotonic() + 60
    while True:
        wait_for_write_back(server)
        tree = server.pcr_state()["tree"]
        media, tokens = mirror(replayed_events(server.kv_events["replay_endpoint"]))
        counts = {m: len(media.get(m, ())) for m in ("GPU", "CPU_PINNED", "DISK")}
        if counts == {"GPU": tree["device_chunks"], "CPU_PINNED": tree["host_chunks"], "DISK": tree["ssd_chunks"]}:
            break
        # The last step's events are published with the next step: one more request.
        assert time.monotonic() < deadline, (counts, tree)
        server.generate({"input_ids": [3] * 8, "sampling_params": {"max_new_tokens": 1}})
    assert counts["GPU"] and counts["CPU_PINNED"] and counts["DISK"], counts
    assert set(tokens) <= set(expected), len(set(tokens) - set(expected))
    assert all(tokens[h] == expected[h] for h in tokens)
    report = server.pcr_state()["kv_events"]
    assert report["removed_blocks"] > 0 and report["unannounced_chunks"] == 0, report
