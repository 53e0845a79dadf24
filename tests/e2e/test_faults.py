"""Faults a production server meets, each through a real server on CPU: a prompt longer than
the device pool, the store's file system turning read-only mid-run, the disk filling during
a warm restart, and a request aborted while its chunks are being prefetched. In each, every
request completes with the baseline's tokens (or a clear error) and no slot leaks.

The store's file-system faults are real: to fill the disk, the store lives on a small tmpfs
of its own, which another writer fills (ENOSPC; needs the right to mount, as root in CI);
to turn it read-only mid-run, its directories are made immutable (``chattr +i``: root can
write through a mode of 0500, not through that) or, for another user, read-only by mode.
A remount read-only cannot stand in: the kernel refuses it while a server holds files open
for writing. Without those rights the tests are skipped, saying why. The other faults of the matrix live
beside the code they exercise: the I/O process stopped for 30 s (``test_prefetch_io``), two
servers on one store directory (``test_store_sharing``), kill -9 during write-back
(``test_ssd_tier``).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import requests

from pcr_tools.launcher import ServerProcess
from tests.e2e.helpers import GREEDY, generate_greedy, serving, ssd_server, wait_for_write_back

pytestmark = [pytest.mark.e2e, pytest.mark.paced]

TMPFS_MB = 96


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@contextmanager
def own_tmpfs(path: Path) -> Iterator[Path]:
    """A small tmpfs at ``path`` for the duration (unmounted lazily: a server may still
    hold files there while it stops)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={TMPFS_MB}m,mode=0700", "tmpfs", str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs the right to mount a tmpfs (root): {getattr(e, 'stderr', e)}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def settled_state(server, timeout_s: float = 90) -> dict:
    """The server's state once no request, read or write is in flight, with the full check.
    An idle scheduler sleeps (``--sleep-on-idle``) and applies I/O completions only when it
    steps, so a one-token request drives it meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = server.pcr_state(check_invariants=True)
        ssd = state["ssd"] or {}
        if (
            not state["requests"]["tracked"] and not ssd.get("reads_in_flight") and not ssd.get("writes_in_flight")
        ) or time.monotonic() > deadline:
            return state
        server.generate({"input_ids": [3] * 8, "sampling_params": {"max_new_tokens": 1}})
        time.sleep(0.3)


def assert_no_slot_leaks(state: dict) -> None:
    assert state["invariants"]["ok"], state["invariants"]
    assert state["tree"]["locked_chunks"] == 0 and state["requests"]["tracked"] == 0, state["requests"]
    slots = state["host_slots"]
    assert slots["reserved"] == slots["filling"] == slots["releasing"] == 0, slots
    assert state["host_pool_slots"] - state["host_pool_free_slots"] == state["tree"]["host_chunks"]
    assert state["device_pool_free_tokens"] + state["cached_tokens"] == state["device_pool_tokens"]


def fill_to_the_last_byte(path: Path) -> None:
    """Write ``path`` until the file system refuses (ENOSPC). Unbuffered: a buffered file
    keeps the bytes a short write left over and raises ENOSPC again when it is closed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = b"\xa5" * (1 << 16)
        while True:
            try:
                if os.write(fd, block) == 0:
                    break
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
        # The last few bytes may still fit where a whole block did not.
        for size in (4096, 1):
            try:
                while os.write(fd, block[:size]) == size:
                    pass
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


@contextmanager
def read_only_tree(path: Path) -> Iterator[None]:
    """Every file and directory under ``path`` read-only until the block ends."""
    if os.geteuid() == 0:
        try:
            subprocess.run(["chattr", "-R", "+i", str(path)], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            pytest.skip(f"needs chattr +i on this file system: {getattr(e, 'stderr', e)}")
        undo = ["chattr", "-R", "-i", str(path)]
    else:
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
        undo = ["chmod", "-R", "u+w", str(path)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


@pytest.fixture(scope="module")
def mounts(tmp_path_factory) -> Iterator[dict[str, Path]]:
    with own_tmpfs(tmp_path_factory.mktemp("pcr-faults") / "filling") as filling:
        yield {"filling": filling}


@pytest.fixture(scope="module")
def servers(tiny_model, baseline_server, tmp_path_factory, mounts):
    # A context longer than the 2,600-token device pool: SGLang's own limit then applies.
    readonly_dir = tmp_path_factory.mktemp("pcr-readonly") / "store"
    readonly = ssd_server(tiny_model, readonly_dir, "--context-length", "4096")
    readonly.store_dir = readonly_dir
    filling = ssd_server(tiny_model, mounts["filling"] / "store")
    # Every SSD read takes 0.25 s: a queued request's prefetches are in flight for seconds.
    # Two requests run at a time, so the tail of 16 sent at once is still queued (its reads
    # prefetching) when the test aborts it, however slowly the machine runs: with no limit,
    # the whole batch could finish before the aborts arrived (seen on a loaded machine).
    slow_reads = ssd_server(
        tiny_model,
        tmp_path_factory.mktemp("pcr-slow") / "store",
        "--pcr-prefetch-window",
        "16",
        "--max-running-requests",
        "2",
    )
    slow_reads.env = {**slow_reads.env, "PCR_IO_TEST_FAULTS": json.dumps({"read_delay_s": 0.25})}
    everything = {"readonly": readonly, "filling": filling, "slow_reads": slow_reads}
    with serving(everything, shared={"baseline": baseline_server}):
        yield everything


def test_a_prompt_longer_than_the_device_pool(servers, rag_prompt_ids, baseline_outputs):
    server = servers["readonly"]
    generate_greedy(server, rag_prompt_ids[:6], concurrency=3)  # the tiers hold chunks
    r = requests.post(
        f"{server.base_url}/generate",
        json={"input_ids": [11 + i % 3000 for i in range(3200)], "sampling_params": GREEDY},
        timeout=60,
    )
    assert r.status_code == 400 and "exceeds the maximum allowed length" in r.text, r.text
    # Prompts of nearly the whole pool, four at once: each must evict every cached chunk
    # (to host memory) and they take turns; all complete, token for token.
    near_pool = [[13 + (7 * i + k) % 3000 for i in range(2500)] for k in range(4)]
    expected = generate_greedy(servers["baseline"], near_pool)
    assert generate_greedy(server, near_pool, concurrency=4) == [(ids, 0) for ids, _ in expected]
    assert [ids for ids, _ in generate_greedy(server, rag_prompt_ids[:10])] == baseline_outputs[:10]
    assert_no_slot_leaks(settled_state(server))


def test_the_store_turning_read_only_mid_run(servers, rag_prompt_ids, baseline_outputs):
    server = servers["readonly"]
    generate_greedy(server, rag_prompt_ids, concurrency=4)
    wait_for_write_back(server)
    written = server.pcr_state()["ssd"]["counters"]["written_chunks"]
    assert written > 0
    fresh = [[5, *ids] for ids in rag_prompt_ids[:12]]
    expected = [ids for ids, _ in generate_greedy(servers["baseline"], fresh)]
    with read_only_tree(server.store_dir):
        # New chunks (a new first token) must be written and cannot be; the persisted ones
        # must still be read back.
        assert [ids for ids, _ in generate_greedy(server, fresh, concurrency=4)] == expected
        assert [ids for ids, _ in generate_greedy(server, rag_prompt_ids, concurrency=4)] == baseline_outputs
        state = settled_state(server)
    ssd = state["ssd"]
    assert ssd["counters"]["write_errors"] >= 1 and not ssd["writes_enabled"], ssd["counters"]
    assert ssd["counters"]["hit_chunks"] > 0 and ssd["io_process"]["healthy"], ssd
    assert_no_slot_leaks(state)


def test_the_disk_filling_during_a_warm_restart(servers, tiny_model, mounts, rag_prompt_ids, baseline_outputs):
    server = servers["filling"]
    generate_greedy(server, rag_prompt_ids[:25], concurrency=4)
    wait_for_write_back(server)
    server.stop()
    # While it is down, another tenant fills the file system to the last byte.
    filler = mounts["filling"] / "filler"
    fill_to_the_last_byte(filler)
    restarted = ssd_server(tiny_model, mounts["filling"] / "store")
    servers["filling"] = restarted
    try:
        restarted.start()  # a full disk is no reason not to serve
        state = restarted.pcr_state()
        ssd, counters = state["ssd"], state["ssd"]["counters"]
        # It sized its tier to what it can free, its own records: nothing more fits.
        assert 0 < counters["restored_chunks"] and ssd["capacity_chunks"] <= counters["restored_chunks"] + 1, ssd
        results = generate_greedy(restarted, rag_prompt_ids, concurrency=4)  # old hits, new chunks
        assert [ids for ids, _ in results] == baseline_outputs
        state = settled_state(restarted)
    finally:
        filler.unlink(missing_ok=True)
    ssd = state["ssd"]
    counters = ssd["counters"]
    assert counters["hit_chunks"] > 0, counters  # what the restart restored serves
    assert ssd["chunks"] <= ssd["capacity_chunks"], ssd
    # New chunks replace its own old records (or, where even that fails, write-back stops).
    assert (counters["written_chunks"] > 0 and counters["evicted_chunks"] > 0) or (
        counters["write_errors"] >= 1 and not ssd["writes_enabled"]
    ), counters
    assert_no_slot_leaks(state)
    assert [ids for ids, _ in generate_greedy(restarted, rag_prompt_ids[:10])] == baseline_outputs[:10]


def test_a_request_aborted_while_its_chunks_are_prefetched(servers, tiny_model, rag_prompt_ids, baseline_outputs):
    server = servers["slow_reads"]
    generate_greedy(server, rag_prompt_ids[:16], concurrency=4)
    wait_for_write_back(server)
    server.stop()
    restarted = ServerProcess(server.model_path, server.extra_args, env=server.env)
    servers["slow_reads"] = restarted
    restarted.start()  # its chunks are on SSD only now: every hit is a (slow) read
    rids = [f"abort-{k}-{uuid.uuid4().hex[:8]}" for k in range(16)]
    results: dict[int, dict] = {}

    def client(k: int) -> None:
        results[k] = restarted.generate({"input_ids": rag_prompt_ids[k], "rid": rids[k], "sampling_params": GREEDY})

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while restarted.pcr_state()["ssd"]["reads_in_flight"] == 0:
        assert time.monotonic() < deadline, "no SSD read was ever in flight"
        time.sleep(0.05)
    aborted = [k for k in range(8, 16)]  # the queue's tail: still waiting, its reads prefetching
    for k in aborted:
        requests.post(f"{restarted.base_url}/abort_request", json={"rid": rids[k]}, timeout=30).raise_for_status()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == 16
    for k, out in results.items():
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            assert k in aborted
        else:
            assert out["output_ids"] == baseline_outputs[k], k
    assert any(results[k]["meta_info"]["finish_reason"]["type"] == "abort" for k in aborted)
    state = settled_state(restarted)
    counters = state["ssd"]["counters"]
    assert counters["prefetch_issued"] > 0, counters
    # The aborted requests were waiting for their reads; those not started were cancelled.
    assert counters["abandoned_reads"] > 0 and counters["cancelled_reads"] > 0, counters
    assert_no_slot_leaks(state)
    # The aborted requests' chunks serve the next ones, token for token.
    assert [ids for ids, _ in generate_greedy(restarted, rag_prompt_ids[8:16], concurrency=4)] == baseline_outputs[8:16]
    assert_no_slot_leaks(settled_state(restarted))
