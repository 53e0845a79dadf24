"""Queue-based prefetch and the I/O process through a real server on CPU: correctness under
a deep queue, no disk I/O in the scheduler, kill -9 of the I/O process and of the server."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.e2e.helpers import (COMMON_ARGS, generate_greedy, prometheus_counts, serving, ssd_server,
                               wait_for_write_back)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    from pcr_sglang.launcher import ServerProcess

    baseline = ServerProcess(tiny_model, (*COMMON_ARGS, "--disable-radix-cache"))
    prefetch = ssd_server(tiny_model, tmp_path_factory.mktemp("pcr-prefetch") / "store",
                          "--pcr-prefetch-window", "16", "--enable-metrics")
    everything = {"baseline": baseline, "prefetch": prefetch}
    with serving(everything):
        yield everything


def io_pid(server) -> int:
    return server.pcr_state()["ssd"]["io_process"]["pid"]


PROMETHEUS_OUTCOMES = {"issued": "prefetch_issued", "in_time": "prefetch_in_time",
                       "late": "prefetch_late", "on_demand": "on_demand_reads"}


def test_deep_queue_with_prefetch_matches_baseline_and_scheduler_does_no_disk_io(
        servers, rag_prompt_ids, baseline_outputs):
    server = servers["prefetch"]
    results = generate_greedy(server, rag_prompt_ids, concurrency=4)  # fills all tiers
    assert [ids for ids, _ in results] == baseline_outputs
    wait_for_write_back(server)
    # Replay with many clients at once: the waiting queue is deep, its SSD chunks prefetched.
    replay = generate_greedy(server, rag_prompt_ids, concurrency=16)
    assert [ids for ids, _ in replay] == baseline_outputs
    state = server.pcr_state()
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
