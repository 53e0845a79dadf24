"""Two PCR servers on one ``--pcr-ssd-path``: one is killed with writes in flight and
restarted on the same directory; both keep writing, and each serves the other's records
from SSD with outputs equal to a no-cache baseline, token for token."""

from __future__ import annotations

import threading
import time

import pytest

from tests.e2e.helpers import GREEDY, generate_greedy, serving, ssd_server, wait_for_write_back

pytestmark = [pytest.mark.e2e, pytest.mark.paced]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pcr-shared-ssd") / "store"


@pytest.fixture(scope="module")
def servers(tiny_model, store_dir, baseline_server):
    everything = {"a": ssd_server(tiny_model, store_dir)}
    with serving(everything, shared={"baseline": baseline_server}):
        yield everything


def storage_hits(server, prompts, baseline):
    """Replay ``prompts``; assert the outputs equal ``baseline``; SSD-read tokens."""
    outs = [server.generate({"input_ids": p, "sampling_params": GREEDY}) for p in prompts]
    assert [o["output_ids"] for o in outs] == baseline
    return sum((o["meta_info"].get("cached_tokens_details") or {}).get("storage", 0) for o in outs)


def healthy_writer(server) -> dict:
    ssd = server.pcr_state()["ssd"]
    assert ssd["writes_enabled"] and ssd["counters"]["write_errors"] == 0, ssd
    return ssd


def test_two_servers_share_a_store_through_a_crash_of_one(servers, tiny_model, store_dir, rag_prompt_ids):
    baseline_server, a = servers["baseline"], servers["a"]
    first = rag_prompt_ids[:10]  # written by a
    second = [[5, *ids] for ids in rag_prompt_ids[10:20]]  # written by b
    burst = [[7, *ids] for ids in rag_prompt_ids[20:44]]  # a is killed while writing these
    later_a = [[11, *ids] for ids in rag_prompt_ids[44:50]]
    later_b = [[13, *ids] for ids in rag_prompt_ids[44:50]]
    expected = {
        name: [ids for ids, _ in generate_greedy(baseline_server, prompts, concurrency=4)]
        for name, prompts in (("first", first), ("second", second), ("later_a", later_a), ("later_b", later_b))
    }

    assert [ids for ids, _ in generate_greedy(a, first, concurrency=4)] == expected["first"]
    assert wait_for_write_back(a)["ssd"]["writes_in_flight"] == 0
    b = ssd_server(tiny_model, store_dir)
    servers["b"] = b  # stopped by the module fixture
    b.start()
    ssd_b = b.pcr_state()["ssd"]
    assert ssd_b["counters"]["restored_chunks"] > 0 and ssd_b["store"]["peer_chunks"] > 0, ssd_b
    # b starts with empty device and host tiers: a's records come from SSD.
    assert storage_hits(b, first[:5], expected["first"][:5]) > 0
    assert [ids for ids, _ in generate_greedy(b, second, concurrency=4)] == expected["second"]
    wait_for_write_back(b)

    # kill -9 a while its write-back is busy, b writing all along.
    b_errors: list[BaseException] = []

    def b_keeps_writing() -> None:
        try:
            generate_greedy(b, later_b, concurrency=2)
        except BaseException as e:  # pragma: no cover - reported below
            b_errors.append(e)

    def a_client(prompts) -> None:
        for ids in prompts:
            try:
                a.generate({"input_ids": ids, "sampling_params": GREEDY})
            except Exception:
                return  # killed under us

    writer = threading.Thread(target=b_keeps_writing, daemon=True)
    clients = [threading.Thread(target=a_client, args=(burst[i::3],), daemon=True) for i in range(3)]
    writer.start()
    for t in clients:
        t.start()
    in_flight = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        in_flight = a.pcr_state()["ssd"]["writes_in_flight"]
        if in_flight > 0:
            break
        time.sleep(0.02)
    a.kill()
    assert in_flight > 0, "a never had a write in flight"  # it really was mid-write
    for t in clients:
        t.join(timeout=60)
    restarted = ssd_server(tiny_model, store_dir)
    servers["a"] = restarted
    restarted.start()
    writer.join(timeout=300)
    assert not b_errors and not writer.is_alive()
    ssd_a = restarted.pcr_state()["ssd"]
    assert ssd_a["counters"]["restored_chunks"] > 0 and ssd_a["store"]["peer_chunks"] > 0, ssd_a

    # The restarted a serves b's records from SSD; b still serves a's.
    assert storage_hits(restarted, second[:5], expected["second"][:5]) > 0
    assert storage_hits(b, first[5:], expected["first"][5:]) > 0
    # Both keep writing: no write error, write-back still on, new records on both sides.
    written_b = healthy_writer(b)["counters"]["written_chunks"]
    assert [ids for ids, _ in generate_greedy(restarted, later_a, concurrency=2)] == expected["later_a"]
    assert [ids for ids, _ in generate_greedy(b, later_a, concurrency=2)] == expected["later_a"]
    assert wait_for_write_back(restarted)["ssd"]["counters"]["written_chunks"] > 0
    assert wait_for_write_back(b)["ssd"]["counters"]["written_chunks"] > written_b
    healthy_writer(restarted)
    healthy_writer(b)
    for server in (restarted, b):
        state = server.pcr_state(check_invariants=True)
        assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0
