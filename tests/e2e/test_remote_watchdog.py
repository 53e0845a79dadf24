"""A remote-tier call that never returns is detected while local SSD reads keep completing
(the review's finding: the supervisor kept hearing from the I/O process, so the hung read's
host slot stayed filling and its chunk "reading" forever). A real server on CPU with the SSD
and remote tiers over a real Mooncake Store on loopback, every remote read of which takes an
hour (``remote_read_delay_s``): the remote thread's watchdog gives the read up after
``remote_call_timeout_s`` (10 s), its slot drains, the I/O process is not restarted, and
every request gets the baseline's tokens."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pcr_sglang.core.keys import CacheNamespace, chunk_keys, root_key
from pcr_tools.launcher import ServerProcess
from pcr_tools.mooncake_services import MooncakeMaster, MooncakeStoreProcess, client_config, keygen
from tests.e2e.helpers import GREEDY, TIERED_ARGS, serving, wait_for_write_back

pytestmark = [pytest.mark.e2e, pytest.mark.paced]

CHUNK = 64  # as in test_remote_tier: reading a chunk must beat recomputing it on a busy machine
HUNG_READ_S = 3600
WAIT_S = 120  # the most the drain is waited for: the watchdog's 10 s, many times over


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    logs = tmp_path_factory.mktemp("mooncake-watchdog")
    master = MooncakeMaster(log_path=logs / "master.log")
    store = MooncakeStoreProcess(master, 64 << 20, log_path=logs / "store.log")
    master.start()
    store.start()
    yield {"master": master, "key": keygen(logs / "fleet.key")}
    store.stop()
    master.stop()


@pytest.fixture(scope="module")
def servers(tiny_model, mooncake, tmp_path_factory, baseline_server):
    ssd = tmp_path_factory.mktemp("pcr-remote-watchdog")
    remote = json.dumps(client_config(mooncake["master"], mooncake["key"]))
    hung = ServerProcess(
        tiny_model,
        (
            *TIERED_ARGS,
            "--pcr-chunk-size",
            str(CHUNK),
            "--pcr-ssd-path",
            str(ssd),
            "--pcr-ssd-gb",
            "0.5",
            "--pcr-ssd-reserve-gb",
            "0",
            "--pcr-remote",
            "mooncake",
            "--pcr-remote-config",
            remote,
        ),
        env={"PCR_IO_TEST_FAULTS": json.dumps({"remote_read_delay_s": HUNG_READ_S})},
    )
    hung.ssd_path = ssd
    with serving({"hung": hung}, shared={"baseline": baseline_server}) as running:
        yield running


def send(server, prompt) -> dict:
    return server.generate({"input_ids": prompt, "sampling_params": GREEDY})


def prompt_keys(server, prompt) -> set[bytes]:
    """The keys of ``prompt``'s whole chunks on ``server`` (as test_remote_tier derives them)."""
    ns = CacheNamespace(**server.pcr_state()["namespace"])
    return set(chunk_keys(root_key(ns.chain_digest()), prompt[: len(prompt) - 1], CHUNK))


def storage_tokens(out) -> int:
    return (out["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)


def test_a_hung_remote_read_is_given_up_on_under_steady_local_reads(servers, rag_prompt_ids, baseline_outputs):
    server = servers["hung"]
    ssd = Path(server.ssd_path)
    # One prompt, then ten more (beyond device and host memory together), reach the local
    # SSD. The first prompt's own chunks (those no other prompt has) then lose their records
    # there, as a peer's eviction of a shared directory would: the tree still has them at the
    # SSD level, so they are read, miss locally and go to the remote tier, where every read
    # hangs; the other prompts' chunks stay local.
    remote_prompt, local_prompts = rag_prompt_ids[0], rag_prompt_ids[1:11]
    for i, prompt in enumerate([remote_prompt, *local_prompts]):
        assert send(server, prompt)["output_ids"] == baseline_outputs[i]
    assert wait_for_write_back(server)["ssd"]["writes_in_flight"] == 0
    shared = set().union(*(prompt_keys(server, p) for p in local_prompts))
    lost = [path for k in prompt_keys(server, remote_prompt) - shared for path in ssd.rglob(f"{k.hex()}.chunk")]
    assert lost
    for path in lost:
        path.unlink()
    server.flush_cache()  # device and host emptied; the SSD level stays in the tree
    before = server.pcr_state()
    pid = before["ssd"]["io_process"]["pid"]

    assert send(server, remote_prompt)["output_ids"] == baseline_outputs[0]  # recomputed: its reads hang
    # Steady local reads: the other prompts, round after round, read back from the SSD
    # while the remote read hangs, until its slot has drained.
    deadline, rounds, local_hits, filling_seen = time.monotonic() + WAIT_S, 0, 0, 0
    while True:
        state = server.pcr_state()
        store = state["remote"]["store"] or {}
        filling_seen = max(filling_seen, state["host_slots"].get("filling", 0))
        if (
            store.get("calls_timed_out", 0) >= 1
            and state["host_slots"].get("filling", 0) == 0
            and state["ssd"]["reads_in_flight"] == 0
        ):
            break
        assert time.monotonic() < deadline, (
            f"the hung remote read was never given up on (max filling "
            f"{filling_seen}): {state['host_slots']}, {state['remote']}, "
            f"reads in flight {state['ssd']['reads_in_flight']}"
        )
        i = rounds % len(local_prompts)
        out = send(server, local_prompts[i])
        assert out["output_ids"] == baseline_outputs[i + 1]
        local_hits += storage_tokens(out)
        rounds += 1
    assert local_hits > 0  # local SSD reads completed meanwhile
    assert state["ssd"]["io_process"]["pid"] == pid  # the remote client was restarted, not the process
    assert store["read_failed"] > (before["remote"]["store"] or {}).get("read_failed", 0)
    assert store.get("read_ok", 0) == 0  # nothing came back from the hung reads
    # Later requests are served, with the baseline's tokens: the given-up chunks recomputed.
    outs = [send(server, p) for p in [remote_prompt, *local_prompts[:3]]]
    assert [o["output_ids"] for o in outs] == [baseline_outputs[i] for i in (0, 1, 2, 3)]
