"""A real ``--tp 2`` server on CPU with PCR's host and SSD tiers, one rank's reads late.

Each rank has its own I/O process, store and clock, and rank 1's reads arrive late (the
I/O process's test knob): every decision that sets a prefix length must still be the same
on both ranks, or the ranks' collectives would mismatch. Checked three ways: outputs
equal the TP 2 no-cache baseline token for token, the SSD tier was used, and the ranks'
digests of admitted prefix lengths never differed (``/server_info``'s ``tp`` section).
KV hints too: every rank registers a hint at the clock the ranks agree on, so every rank
orders the same hinted reads."""

from __future__ import annotations

import time
import uuid

import pytest

from pcr_tools.launcher import ServerProcess
from tests.conftest import CHUNK_SIZE
from tests.e2e.helpers import GREEDY, generate_greedy, serving, wait_for_write_back

pytestmark = [pytest.mark.e2e, pytest.mark.paced]

# Two ranks on two cores: each rank's OpenMP threads on a core of its own, and an explicit
# KV pool size (SGLang's CPU sizing would refuse a rank, or be OOM-killed, without one).
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
TP_ARGS = (
    "--tp",
    "2",
    "--max-total-tokens",
    "2600",
    "--context-length",
    "2048",
    "--log-level",
    "warning",
    "--sleep-on-idle",
)
PROMPTS = 16


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    baseline = ServerProcess(tiny_model, (*TP_ARGS, "--disable-radix-cache"), env=TP_ENV)
    # Host memory of ~100 chunks per rank for a working set of ~500: most reuse is from SSD.
    pcr = ServerProcess(
        tiny_model,
        (
            *TP_ARGS,
            "--enable-pcr",
            "--pcr-debug-checks",
            "--pcr-chunk-size",
            str(CHUNK_SIZE),
            "--pcr-dram-gb",
            "0.003",
            "--pcr-ssd-path",
            str(tmp_path_factory.mktemp("pcr-tp") / "store"),
            "--pcr-ssd-gb",
            "0.5",
            "--pcr-ssd-reserve-gb",
            "0",
            "--enable-metrics",
        ),
        env={**TP_ENV, "PCR_IO_TEST_FAULTS": '{"tp_ranks": [1], "read_delay_s": 0.002}'},
    )
    everything = {"baseline": baseline, "pcr": pcr}
    with serving(everything, start_first=("pcr",)):
        yield everything


def test_tp2_with_host_and_ssd_tiers_matches_the_tp2_baseline_and_the_ranks_agree(servers, rag_prompt_ids):
    prompts = rag_prompt_ids[:PROMPTS]
    baseline = [ids for ids, _ in generate_greedy(servers["baseline"], prompts)]
    server = servers["pcr"]
    first = generate_greedy(server, prompts, concurrency=4)
    assert [ids for ids, _ in first] == baseline
    wait_for_write_back(server)
    replays = [server.generate({"input_ids": p, "sampling_params": GREEDY}) for p in prompts[:8]]
    assert [r["output_ids"] for r in replays] == baseline[:8]
    storage = sum((r["meta_info"].get("cached_tokens_details") or {}).get("storage", 0) for r in replays)
    assert storage > 0  # read back from SSD, with rank 1's reads late
    state = server.pcr_state(check_invariants=True)
    tp = state["tp"]
    assert tp["size"] == 2 and tp["agreement_rounds"] > 0
    assert tp["prefix_digest_mismatches"] == 0 and tp["inconsistent"] is None, tp
    ssd = state["ssd"]["counters"]
    assert ssd["written_chunks"] > 0 and ssd["hit_chunks"] > 0 and ssd["read_failures"] == 0
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0
    assert all(c % CHUNK_SIZE == 0 for _, c in first)


def test_tp2_a_kv_hint_reads_its_chain_ahead_on_both_ranks(servers, rag_prompt_ids):
    """After ``/flush_cache`` every chain is on SSD only. A hint-only request for a prompt
    (registered on both ranks, no forward) has its chain read into host memory while
    nothing else runs; the prompt then finds part of its chain in host memory (the hint
    budget is a quarter of the host tier: the rest is read on demand), with the TP 2
    baseline's tokens, and the ranks never disagreed."""
    from pcr_client.hints import hint_envelope

    server = servers["pcr"]
    prompts = rag_prompt_ids[:2]
    baseline = [ids for ids, _ in generate_greedy(servers["baseline"], prompts)]
    generate_greedy(server, prompts)  # cached (and written back) whatever ran before
    wait_for_write_back(server)
    server.flush_cache()
    before = server.pcr_state()
    out = server.generate(
        {
            "input_ids": prompts[0],
            "sampling_params": {"max_new_tokens": 0},
            "kv_hints": hint_envelope({"hint_only": True, "ttl_s": 30}, uuid.uuid4().hex),
        }
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0, "pcr_hint": "registered"}
    deadline = time.monotonic() + 60
    while True:  # the prefetcher reads the hinted chain in the background
        state = server.pcr_state()
        ssd = state["ssd"]
        done = ssd["counters"]["hint_issued"] > before["ssd"]["counters"]["hint_issued"] and ssd["reads_in_flight"] == 0
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert done, ssd
    assert state["forwards"] == before["forwards"]  # the hint-only request ran no forward
    final = server.generate({"input_ids": prompts[0], "sampling_params": GREEDY})
    assert final["output_ids"] == baseline[0]
    assert final["meta_info"]["cached_tokens_details"].get("host", 0) > 0, final["meta_info"]
    control = server.generate({"input_ids": prompts[1], "sampling_params": GREEDY})  # nobody hinted it
    assert control["output_ids"] == baseline[1]
    state = server.pcr_state(check_invariants=True)
    assert state["hints"]["counters"]["registered"] == before["hints"]["counters"]["registered"] + 1
    assert state["ssd"]["counters"]["hint_in_time"] > before["ssd"]["counters"]["hint_in_time"]
    assert state["tp"]["prefix_digest_mismatches"] == 0 and state["tp"]["inconsistent"] is None, state["tp"]
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0
