"""A real SGLang HTTP server with --enable-pcr on CPU, against one with no prefix cache."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from pcr_tools.launcher import ServerProcess
from tests.conftest import CHUNK_SIZE
from tests.e2e.helpers import COMMON_ARGS, GREEDY, generate_greedy, prometheus_counts, serving

pytestmark = pytest.mark.e2e

SMALL_POOL_ARGS = (
    "--max-total-tokens",
    "2600",
    "--context-length",
    "2048",
    "--log-level",
    "warning",
    "--sleep-on-idle",
)


ADMIN_KEY = "pcr-test-admin-key"


@pytest.fixture(scope="module")
def servers(tiny_model, baseline_server):
    pcr = ServerProcess(
        tiny_model, (*COMMON_ARGS, "--enable-pcr", "--pcr-debug-checks", "--pcr-chunk-size", str(CHUNK_SIZE))
    )
    # A KV pool of ~3 prompts for a working set of ~40 documents: eviction all the time.
    pcr_small = ServerProcess(
        tiny_model, (*SMALL_POOL_ARGS, "--enable-pcr", "--pcr-debug-checks", "--pcr-chunk-size", str(CHUNK_SIZE))
    )
    # SGLang's own HiCache on CPU (our host-pool patch and kvcacheio stand-in): the
    # benchmarks' baseline, checked here for correctness under the same small pool. Its
    # host pool is sized by ratio (20x the device pool: the whole working set, a few MB),
    # not by --hicache-size 1: SGLang refuses a host pool unless 10 GiB stay free beside
    # it, and a 1 GB pool was refused while the e2e module running beside this one held memory.
    hicache = ServerProcess(
        tiny_model,
        (*SMALL_POOL_ARGS, "--page-size", "16", "--enable-hierarchical-cache", "--hicache-ratio", "20"),
    )
    # The same small device pool with PCR's host tier behind it.
    pcr_dram = ServerProcess(
        tiny_model,
        (
            *SMALL_POOL_ARGS,
            "--enable-pcr",
            "--pcr-debug-checks",
            "--pcr-chunk-size",
            str(CHUNK_SIZE),
            "--pcr-dram-gb",
            "0.25",
            "--enable-metrics",
        ),
    )
    # A cache-aware policy: every pass matches the whole waiting queue (up to 128 requests).
    pcr_lpm = ServerProcess(
        tiny_model,
        (
            *SMALL_POOL_ARGS,
            "--enable-pcr",
            "--pcr-debug-checks",
            "--pcr-chunk-size",
            str(CHUNK_SIZE),
            "--pcr-dram-gb",
            "0.25",
            "--schedule-policy",
            "lpm",
            "--enable-metrics",
        ),
    )
    everything = {"pcr": pcr, "pcr_small": pcr_small, "hicache": hicache, "pcr_dram": pcr_dram, "pcr_lpm": pcr_lpm}
    # The other --pcr-layerwise settings (pcr_dram runs the default, both).
    # The 'off' one without --pcr-debug-checks and with an admin key: the tree check is
    # for the admin only there.
    for mode in ("off", "load", "offload"):
        checks = ("--admin-api-key", ADMIN_KEY) if mode == "off" else ("--pcr-debug-checks",)
        everything[f"pcr_dram_{mode}"] = ServerProcess(
            tiny_model,
            (
                *SMALL_POOL_ARGS,
                "--enable-pcr",
                *checks,
                "--pcr-chunk-size",
                str(CHUNK_SIZE),
                "--pcr-dram-gb",
                "0.25",
                "--pcr-layerwise",
                mode,
            ),
        )
    with serving(everything, start_first=("hicache",), shared={"baseline": baseline_server}):
        yield everything


def test_outputs_equal_baseline_and_cached_tokens_are_whole_chunks(servers, rag_prompt_ids, baseline_outputs):
    results = generate_greedy(servers["pcr"], rag_prompt_ids)
    assert [ids for ids, _ in results] == baseline_outputs
    cached = [c for _, c in results]
    assert all(c % CHUNK_SIZE == 0 for c in cached), cached
    assert sum(1 for c in cached if c > 0) >= 10, cached  # the workload shares documents
    state = servers["pcr"].pcr_state(check_invariants=True)
    assert state["invariants"]["ok"], state
    assert state["tree"]["locked_chunks"] == 0


def test_server_info_checks_the_tree_only_when_asked(servers):
    server = servers["pcr"]
    plain = server.pcr_state()["invariants"]
    assert plain["checked"] is False and plain["ok"] is None  # counters only: O(1) per call
    asked = server.pcr_state(check_invariants=True)["invariants"]
    assert asked == {"checked": True, "ok": True, "error": None}
    info = server.server_info(check_invariants=True)  # PCR's route still serves SGLang's fields
    assert info["version"] and info["internal_states"] and "model_path" in info


def test_the_tree_check_needs_the_debug_flag_or_the_admin_key(servers):
    """Any client could ask for the O(tree) walk in the scheduler thread (``/server_info`` has
    no authentication): without ``--pcr-debug-checks`` only the admin key may."""
    import requests

    server = servers["pcr_dram_off"]
    url = f"{server.base_url}/server_info"
    refused = requests.get(url, params={"pcr_check_invariants": "1"}, timeout=30)
    assert refused.status_code == 403 and "--pcr-debug-checks" in refused.json()["error"]
    wrong = requests.get(
        url, params={"pcr_check_invariants": "1"}, headers={"Authorization": "Bearer nope"}, timeout=30
    )
    assert wrong.status_code == 403
    assert requests.get(url, timeout=30).status_code == 200  # the counters stay open to all
    asked = server.pcr_state(check_invariants=True)["invariants"]  # sends the admin key
    assert asked == {"checked": True, "ok": True, "error": None}


# GET routes that act rather than read (profiling, GC, sessions, memory): not called here.
# Each is admin-only or harmless without the key, but none answers with configuration.
_ACTING_GET = (
    "start_",
    "stop_",
    "dump_",
    "freeze_",
    "slow_down",
    "release_",
    "resume_",
    "open_session",
    "close_session",
    "configure_logging",
    "set_trace_level",
    "flush_cache",
    "health_generate",
    "weights_checker",
    "get_weights_by_name",
)


def test_no_route_answers_with_the_admin_key_and_admin_routes_still_need_it(servers):
    """SGLang 0.5.23's ``/server_info`` needs no key and returns the admin key in clear
    three times (fields, ``launch_command``, every scheduler's ``internal_states``), which
    voids every admin route (red before PCR's redaction: the key was in /server_info and
    /get_server_info). Every read-only GET route in the server's own OpenAPI spec is asked,
    without credentials; the key is on no process's command line either (the launcher
    passes it in a private ``--config`` file), and SGLang still read it from there."""
    import psutil
    import requests

    server = servers["pcr_dram_off"]
    assert server.admin_api_key == ADMIN_KEY
    spec = requests.get(f"{server.base_url}/openapi.json", timeout=30).json()
    routes = [
        path
        for path, ops in spec["paths"].items()
        if "get" in ops and "{" not in path and not any(path.lstrip("/").startswith(verb) for verb in _ACTING_GET)
    ]
    assert {"/server_info", "/get_server_info", "/model_info", "/v1/models"} <= set(routes), routes
    for path in [*routes, "/metrics"]:
        for params in ({}, {"pcr_check_invariants": "1"}):
            answer = requests.get(f"{server.base_url}{path}", params=params, timeout=60)
            assert ADMIN_KEY not in answer.text, path
    info = requests.get(f"{server.base_url}/server_info", timeout=30).json()
    assert info["admin_api_key"] == "<redacted>" and "--admin-api-key <redacted>" in info["launch_command"]
    assert info["model_path"]  # the rest of SGLang's answer as it was
    for process in [psutil.Process(server._proc.pid), *psutil.Process(server._proc.pid).children(recursive=True)]:
        assert ADMIN_KEY not in " ".join(process.cmdline())
    refused = requests.post(f"{server.base_url}/flush_cache", timeout=60)
    assert refused.status_code in (401, 403), refused.text
    allowed = requests.post(
        f"{server.base_url}/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
    )
    assert allowed.status_code == 200, allowed.text


def test_a_session_id_that_is_not_a_string_gets_400_and_the_server_serves_on(servers, rag_prompt_ids, baseline_outputs):
    """SGLang 0.5.23's scheduler died on ``session_params.id`` = a JSON object (``TypeError:
    unhashable type: 'dict'`` in its session lookup), taking every request with it; the
    request is now refused at the door, and the server answers the next one."""
    import requests

    server = servers["pcr"]
    bad = requests.post(
        f"{server.base_url}/generate",
        timeout=60,
        json={"input_ids": rag_prompt_ids[0], "sampling_params": GREEDY, "session_params": {"id": {"error": "x"}}},
    )
    assert bad.status_code == 400 and "session_params.id" in bad.text, bad.text
    assert generate_greedy(server, rag_prompt_ids[:1])[0][0] == baseline_outputs[0]


def test_concurrent_requests_keep_outputs_and_locks(servers, rag_prompt_ids, baseline_outputs):
    # Same prompts, 8 at a time: batching changes scheduling, never tokens or lock counts.
    results = generate_greedy(servers["pcr"], rag_prompt_ids, concurrency=8)
    assert [ids for ids, _ in results] == baseline_outputs
    state = servers["pcr"].pcr_state(check_invariants=True)
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0


def test_reuse_is_exactly_the_shared_whole_chunks(servers, tokenizer):
    server = servers["pcr"]
    rng = random.Random(1)
    vocab = len(tokenizer)
    prompt = [rng.randrange(10, vocab) for _ in range(10 * CHUNK_SIZE + 5)]

    def cached(ids):
        return server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})["meta_info"][
            "cached_tokens"
        ]

    assert cached(prompt) == 0
    first_differs = [prompt[0] + 1 if prompt[0] + 1 < vocab else 10] + prompt[1:]
    assert cached(first_differs) == 0
    for k in (1, 4, 9):
        probe = list(prompt)
        probe[k * CHUNK_SIZE + 3] = (probe[k * CHUNK_SIZE + 3] + 1 - 10) % (vocab - 10) + 10
        assert cached(probe) == k * CHUNK_SIZE
    # The whole prompt: every whole chunk, but not the 5-token tail.
    assert cached(prompt) == 10 * CHUNK_SIZE


def test_small_pool_evicts_serves_correctly_and_balances(servers, rag_prompt_ids, baseline_outputs):
    server = servers["pcr_small"]
    results = generate_greedy(server, rag_prompt_ids, concurrency=4)
    assert [ids for ids, _ in results] == baseline_outputs
    state = server.pcr_state(check_invariants=True)
    assert state["counters"]["evicted_chunks"] > 0, state
    assert state["invariants"]["ok"], state
    assert state["tree"]["locked_chunks"] == 0
    # Every device slot is either free or owned by exactly one cached chunk.
    assert state["device_pool_free_tokens"] + state["cached_tokens"] == state["device_pool_tokens"], state


def test_frontend_dsl_program_runs_against_pcr(servers):
    import sglang as sgl

    @sgl.function
    def rag_qa(s, document, question):
        s += "Document: " + document + "\n"
        s += "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)

    document = " ".join(["The river Lune flows through Lancaster."] * 12)
    answers = {}
    for name in ("baseline", "pcr"):
        backend = sgl.RuntimeEndpoint(servers[name].base_url)
        states, answers[name] = [], []
        for question in ("Where does it flow?", "What is the river?"):
            # run() executes in the background; reading the answer waits for it, so the
            # second program starts after the first has cached the shared document.
            states.append(rag_qa.run(document=document, question=question, backend=backend))
            answers[name].append(states[-1]["answer"])
    assert answers["pcr"] == answers["baseline"]
    assert all(isinstance(a, str) for a in answers["pcr"])
    meta = states[1].get_meta_info("answer")
    assert meta["cached_tokens"] > 0 and meta["cached_tokens"] % CHUNK_SIZE == 0


def test_hicache_host_tier_works_on_cpu(servers, rag_prompt_ids, baseline_outputs):
    results = generate_greedy(servers["hicache"], rag_prompt_ids, concurrency=4)
    assert [ids for ids, _ in results] == baseline_outputs
    # Replaying the first prompts: their KV was evicted from the small device pool long
    # ago, so hits can only come back from HiCache's host tier.
    replay = [
        servers["hicache"].generate({"input_ids": p, "sampling_params": {"max_new_tokens": 1}})["meta_info"]
        for p in rag_prompt_ids[:5]
    ]
    assert any((m.get("cached_tokens_details") or {}).get("host", 0) > 0 for m in replay), replay


def test_host_tier_serves_evicted_chunks_back_without_recomputing(servers, rag_prompt_ids, baseline_outputs):
    server = servers["pcr_dram"]
    results = generate_greedy(server, rag_prompt_ids, concurrency=4)
    assert [ids for ids, _ in results] == baseline_outputs
    before = server.pcr_state()["counters"]
    # The first prompts' chunks left the small device pool long ago, to host memory.
    replay_meta = [server.generate({"input_ids": p, "sampling_params": GREEDY}) for p in rag_prompt_ids[:10]]
    replay = [(m["output_ids"], m["meta_info"]["cached_tokens"]) for m in replay_meta]
    assert [ids for ids, _ in replay] == baseline_outputs[:10]
    # Responses say which tier the reused tokens came from.
    details = [m["meta_info"].get("cached_tokens_details") or {} for m in replay_meta]
    assert any(d.get("host", 0) > 0 for d in details), details
    for (_, cached), d in zip(replay, details):
        assert d.get("device", 0) + d.get("host", 0) == cached
    state = server.pcr_state(check_invariants=True)
    assert state["counters"]["host_hit_chunks"] > before["host_hit_chunks"], state["counters"]
    assert state["counters"]["offloaded_chunks"] > 0  # written through during prefill (default both)
    assert all(c % CHUNK_SIZE == 0 for _, c in replay)
    assert sum(c for _, c in replay) > sum(c for _, c in results[:10])
    # Slot accounting in both tiers, and no lock left behind.
    assert state["invariants"]["ok"], state
    assert state["tree"]["locked_chunks"] == 0
    assert state["device_pool_free_tokens"] + state["cached_tokens"] == state["device_pool_tokens"]
    assert state["host_pool_slots"] - state["host_pool_free_slots"] == state["tree"]["host_chunks"]
    # And Prometheus has them, per tier (--enable-metrics).
    hits = prometheus_counts(server, "sglang:pcr_hit_chunks_total", "tier")
    assert hits.get("host", 0.0) > 0, hits


def test_lpm_with_a_host_tier_under_24_concurrent_requests(servers, rag_prompt_ids, baseline_outputs):
    """LPM matches every waiting request in every pass: matching must move no KV, hits
    count once per admitted request, and the Prometheus counters add up to what the
    responses report, tier by tier."""
    server = servers["pcr_lpm"]
    outs = []
    for _ in range(2):  # the second round finds the first's chunks on the device and in host memory
        with ThreadPoolExecutor(24) as pool:
            outs += list(
                pool.map(lambda p: server.generate({"input_ids": p, "sampling_params": GREEDY}), rag_prompt_ids)
            )
    assert [o["output_ids"] for o in outs] == baseline_outputs * 2
    details = [o["meta_info"].get("cached_tokens_details") or {} for o in outs]
    reported = {tier: sum(d.get(tier, 0) for d in details) for tier in ("device", "host")}
    assert reported["host"] > 0 and reported["device"] > 0, reported
    for d, o in zip(details, outs):
        assert d.get("device", 0) + d.get("host", 0) == o["meta_info"]["cached_tokens"]
    deadline = time.monotonic() + 30
    while True:  # Prometheus is published once per scheduler step
        state = server.pcr_state(check_invariants=True)
        hits = prometheus_counts(server, "sglang:pcr_hit_chunks_total", "tier")
        exported = {tier: hits.get(tier, 0.0) * CHUNK_SIZE for tier in ("device", "host")}
        if exported == reported or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert exported == reported, (exported, reported)
    counters = state["counters"]
    assert (counters["device_hit_chunks"] * CHUNK_SIZE, counters["host_hit_chunks"] * CHUNK_SIZE) == (
        reported["device"],
        reported["host"],
    )
    assert state["invariants"]["ok"] and state["tree"]["locked_chunks"] == 0
    assert state["device_pool_free_tokens"] + state["cached_tokens"] == state["device_pool_tokens"]
    assert state["host_pool_slots"] - state["host_pool_free_slots"] == state["tree"]["host_chunks"]


def test_workload_is_five_to_ten_times_the_small_pool(rag_prompt_ids):
    """The host-tier tests below run on a working set 5-10x the device pool."""
    from pcr_tools.workload import working_set_tokens

    pool = int(SMALL_POOL_ARGS[SMALL_POOL_ARGS.index("--max-total-tokens") + 1])
    assert 5 * pool <= working_set_tokens(rag_prompt_ids, CHUNK_SIZE) <= 10 * pool


@pytest.mark.parametrize("mode", ["off", "load", "offload", "both"])
def test_every_layerwise_setting_serves_host_hits_token_for_token(servers, rag_prompt_ids, baseline_outputs, mode):
    server = servers["pcr_dram" if mode == "both" else f"pcr_dram_{mode}"]
    results = generate_greedy(server, rag_prompt_ids, concurrency=4)
    replay = generate_greedy(server, rag_prompt_ids[:10])
    assert [ids for ids, _ in results] == baseline_outputs
    assert [ids for ids, _ in replay] == baseline_outputs[:10]
    state = server.pcr_state(check_invariants=True)
    counters = state["counters"]
    assert state["layerwise"] == mode
    assert counters["host_hit_chunks"] > 0, counters
    if mode in ("offload", "both"):
        # New chunks reach the host during their prefill: eviction has nothing to copy.
        assert counters["offloaded_chunks"] > 0 and counters["demoted_chunks"] == 0, counters
    else:
        assert counters["offloaded_chunks"] == 0 and counters["demoted_chunks"] > 0, counters
    assert state["invariants"]["ok"], state
    assert state["tree"]["locked_chunks"] == 0
    assert state["device_pool_free_tokens"] + state["cached_tokens"] == state["device_pool_tokens"]
    assert state["host_pool_offload_slots"] == 0
    assert state["host_pool_slots"] - state["host_pool_free_slots"] == state["tree"]["host_chunks"]


def _flip_signs(buf: memoryview, element_bytes: int) -> None:
    """Negate every K and V value of a host slot (the sign bit is the top bit of each
    little-endian element): finite, plausible KV, just the wrong one."""
    raw = np.frombuffer(buf, dtype=np.uint8).reshape(-1, element_bytes)
    raw[:, -1] ^= 0x80


def _served_into_new_host_slots(server, shm, slot_bytes: int, ids: list[int]) -> tuple[list[int], list[int]]:
    """Serve ``ids`` (nothing else runs meanwhile); its output and the host slots whose
    bytes it changed (its chunks' offloads during the prefill)."""
    before = np.frombuffer(shm.buf, dtype=np.uint8).reshape(-1, slot_bytes).copy()
    output = server.generate({"input_ids": ids, "sampling_params": GREEDY})["output_ids"]
    after = np.frombuffer(shm.buf, dtype=np.uint8).reshape(-1, slot_bytes)
    return output, [int(s) for s in np.nonzero((before != after).any(axis=1))[0]]


def test_token_for_token_check_detects_one_corrupted_host_chunk(servers, baseline_outputs):
    """Negative control for every token-for-token test: the same procedure with one host
    chunk's KV negated must change the output, and without it must not."""
    from multiprocessing import resource_tracker, shared_memory

    server, baseline = servers["pcr_dram"], servers["baseline"]
    state = server.pcr_state()
    slot_bytes = state["host_pool_bytes"] // state["host_pool_slots"]
    element_bytes = torch.empty(0, dtype=getattr(torch, state["namespace"]["kv_dtype"].split(".")[-1])).element_size()
    shm = shared_memory.SharedMemory(name=state["host_pool_shm"], create=False)
    resource_tracker.unregister(shm._name, "shared_memory")  # the server owns the segment
    rng = random.Random(5)
    try:
        results = {}
        for name in ("control", "corrupted"):
            ids = [rng.randrange(10, 4000) for _ in range(4 * CHUNK_SIZE + 1)]  # four whole chunks
            expected = baseline.generate({"input_ids": ids, "sampling_params": GREEDY})["output_ids"]
            first, slots = _served_into_new_host_slots(server, shm, slot_bytes, ids)
            assert first == expected and len(slots) == 4, slots
            if name == "corrupted":
                _flip_signs(shm.buf[slots[1] * slot_bytes : (slots[1] + 1) * slot_bytes], element_bytes)
            # Unrelated prompts push it out of the device pool; its chunks stay in host memory.
            for k in range(4):
                server.generate(
                    {
                        "input_ids": [rng.randrange(10, 4000) for _ in range(1500)],
                        "sampling_params": {"max_new_tokens": 1},
                    }
                )
            out = server.generate({"input_ids": ids, "sampling_params": GREEDY})
            assert out["meta_info"]["cached_tokens_details"]["host"] == 4 * CHUNK_SIZE, out["meta_info"]
            results[name] = (out["output_ids"], expected)
    finally:
        shm.close()
    assert results["control"][0] == results["control"][1]
    assert results["corrupted"][0] != results["corrupted"][1], "a corrupted chunk went unnoticed"
