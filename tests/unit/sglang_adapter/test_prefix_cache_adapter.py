"""PCRPrefixCache over SGLang's real CPU KV pool and allocator, without a server."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

pytest.importorskip("sglang")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402

from pcr_sglang.core.admission import AdmissionPhase  # noqa: E402
from tests.unit.adapter_harness import CHUNK, POOL, SLOT_BYTES, Harness, make  # noqa: E402,F401


def prompt(start: int, chunks: int = 3, tail: int = 0) -> list[int]:
    return list(range(start, start + chunks * CHUNK + tail))


def in_host_memory(h: Harness, tokens: list[int]) -> None:
    """Serve ``tokens``, then push every chunk off the device into host memory."""
    h.serve(tokens)
    h.cache.evict(EvictParams(num_tokens=10**6))


# ---------------------------------------------------------------- device tier
def test_match_reports_whole_chunks_and_other_tenants_miss(make):
    h = make()
    tokens = prompt(0, 2, tail=2)
    h.serve(tokens)
    match = h.match(tokens + [99])
    assert match.device_prefix_len == 8 and match.host_hit_length == 0
    assert len(h.cache.path_device_indices(match.last_device_node)) == 8
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    other = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), cache_salt="b")))
    assert other.device_prefix_len == 0
    h.check()


def test_every_device_slot_is_free_or_owned_once(make):
    h = make()
    for start in range(0, 30, 5):
        h.serve(prompt(100 + start, 2, tail=1), rid=f"r{start}")
    h.check()
    h.cache.evict(EvictParams(num_tokens=10**6))
    assert h.cache.total_size() == 0 and h.allocator.available_size() == POOL


def test_lookahead_protects_the_waiting_requests_chunks(make):
    h = make(lookahead_window=1)
    old, young = prompt(100, 2), prompt(200, 2)
    h.serve(old, "old")
    h.serve(young, "young")
    h.step([h.request(old + [1, 2], "waiting")])
    assert h.cache.report()["lookahead_protected_chunks"] == 2
    assert h.cache.evict(EvictParams(num_tokens=2 * CHUNK)).num_tokens_evicted == 8
    assert h.match(old).device_prefix_len == 8  # the older chain survived: it is needed next
    assert h.state.stats.evicted_protected_chunks == 0


# ---------------------------------------------------------------- side-effect-free match
@pytest.mark.parametrize("layerwise", ["off", "both"])
def test_matching_a_host_only_prefix_allocates_and_moves_nothing(make, layerwise):
    """SGLang matches every waiting request in cache-aware passes (up to 128 of them): a
    match must not take device slots, copy KV or count a hit; only admission loads."""
    h = make(host_slots=16, layerwise=layerwise)
    tokens = prompt(0, 3)
    in_host_memory(h, tokens)  # demoted to host memory
    assert h.cache.total_size() == 0 and h.state.tree.host_chunks == 3
    free, counters = h.allocator.available_size(), dict(vars(h.state.stats))
    for _ in range(3):
        req = h.request(tokens + [7])
        match = h.match(tokens + [7], req)
        assert match.device_prefix_len == 0 and match.host_hit_length == 12
    assert h.allocator.available_size() == free
    assert vars(h.state.stats) == counters  # no copy, no hit counted
    assert h.scheduler.engine.pending_loads == 0
    h.check()


def test_admission_loads_the_host_hit_and_counts_it_once(make):
    h = make(host_slots=16, layerwise="load")
    tokens = prompt(0, 3)
    in_host_memory(h, tokens)
    req = h.request(tokens + [7])
    for _ in range(3):  # matched in three passes before one admits it
        h.match(tokens + [7], req)
    device, loaded = h.admit(req)
    assert (device, loaded) == (0, 12)
    assert h.cache.total_size() == 12 and h.state.stats.bytes_host_to_device == 3 * SLOT_BYTES
    slots = h.cache.path_device_indices(req.last_node)
    h.assert_kv(tokens, slots)  # read through the pool's per-layer hook: the layer-wise load lands
    h.scheduler.admitted(req)
    assert (h.state.stats.host_hit_chunks, h.state.stats.device_hit_chunks) == (3, 0)
    h.check()


def test_a_load_that_cannot_get_device_slots_loads_nothing(make):
    h = make(host_slots=16, pool=16)
    tokens = prompt(0, 3)
    in_host_memory(h, tokens)
    hog = h.allocator.alloc(12)  # another request's KV: only 4 slots left
    req = h.request(tokens + [7])
    assert h.admit(req) == (0, 0)  # all or nothing: the request recomputes
    assert h.cache.total_size() == 0 and h.allocator.available_size() == 4
    h.allocator.free(hog)
    h.check()


def test_freeing_a_chunk_whose_load_has_not_landed_finishes_the_load_first(make):
    h = make(host_slots=16, layerwise="load")
    tokens = prompt(0, 2)
    in_host_memory(h, tokens)
    req = h.request(tokens + [1])
    h.admit(req)
    slots = h.cache.path_device_indices(req.last_node).clone()
    assert h.scheduler.engine.pending_loads == 1  # no forward has read the layers yet
    h.cache.evict(EvictParams(num_tokens=10**6))  # frees those device slots
    assert h.scheduler.engine.pending_loads == 0
    h.assert_kv(tokens, slots)  # landed before the slots were freed: no later write races it
    h.check()


@pytest.mark.parametrize("layerwise", ["off", "load", "offload", "both"])
def test_host_hits_come_back_with_their_kv_in_every_layerwise_mode(make, layerwise):
    h = make(host_slots=16, layerwise=layerwise)
    tokens = prompt(0, 3, tail=1)
    in_host_memory(h, tokens)
    req, slots = h.serve(tokens, "again")
    assert req.cached_tokens_host == 12
    h.assert_kv(tokens, slots)
    h.step()
    assert h.state.tree.check_invariants().locked_chunks == 0
    h.check()


def test_a_slot_reused_within_one_eviction_holds_its_last_owners_kv(make):
    """Evicting a 4-chunk chain into 2 host slots demotes chunk 4 into slot A and 3 into
    B, then evicts 4 from host memory to give A to chunk 2, and 3 to give B to chunk 1.
    The copy engine must see each slot once, with its last owner (a batched copy naming a
    slot twice races: the server once kept chunk 4's bytes for chunk 2); the chunks that
    left host memory within the same eviction are not copied at all."""
    h = make(host_slots=2, layerwise="off")
    tokens = prompt(0, 4)
    h.serve(tokens)
    seen = []
    engine = h.scheduler.engine
    copy = engine.copy_to_host

    def spy(device_slots, host_slots):
        seen.append(list(host_slots))
        return copy(device_slots, host_slots)

    engine.copy_to_host = spy
    h.cache.evict(EvictParams(num_tokens=10**6))
    assert seen and all(len(s) == len(set(s)) for s in seen), seen
    assert seen == [[seen[0][0], seen[0][1]]] and h.state.tree.host_chunks == 2
    assert h.state.stats.demoted_chunks == 2 and h.state.stats.host_evicted_chunks == 2
    req, slots = h.serve(tokens[: 2 * CHUNK] + [7], "again")  # chunks 1 and 2 come back from host memory
    assert req.cached_tokens_host == 2 * CHUNK
    h.assert_kv(tokens, slots)
    h.check()


@pytest.mark.parametrize("layerwise", ["offload", "both"])
def test_new_chunks_are_offloaded_during_their_own_batch_and_adopted_at_the_checkpoint(make, layerwise):
    h = make(host_slots=16, layerwise=layerwise)
    tokens = prompt(0, 3, tail=1)
    h.serve_offloaded(tokens)
    stats = h.state.stats
    assert stats.offloaded_chunks == 3 and h.state.tree.host_chunks == 3
    assert h.state.slots.counts()["reserved"] == 0
    h.cache.evict(EvictParams(num_tokens=10**6))  # already in host memory: nothing to copy
    assert stats.demoted_chunks == 0 and h.state.tree.host_chunks == 3
    req, slots = h.serve(tokens, "again")
    assert req.cached_tokens_host == 12
    h.assert_kv(tokens, slots)  # the offloaded bytes are the forward's
    h.check()


def test_an_offload_whose_batch_did_not_run_is_not_adopted(make):
    """A planned offload runs only in a batch containing its request: if another batch
    ran, the chunk is not marked host-resident (its slot held nothing of it)."""
    h = make(host_slots=16, layerwise="offload")
    tokens = prompt(0, 2, tail=1)
    h.serve_offloaded(tokens, run_in_batch_of=["someone-else"])
    assert h.state.stats.offloaded_chunks == 0 and h.state.tree.host_chunks == 0
    assert h.state.slots.num_free == h.state.slots.num_slots  # the reserved slots came back
    assert h.scheduler.engine.planned_offloads == 0
    h.check()


def test_500_requests_with_eviction_in_both_tiers_leave_every_slot_owned_once(make):
    h = make(host_slots=24)  # far below the working set: host evictions too
    rng = random.Random(0)
    docs = [[rng.randrange(1000) for _ in range(rng.randrange(3, 14))] for _ in range(30)]
    for i in range(500):
        tokens = [t for d in rng.sample(docs, rng.randrange(1, 4)) for t in d][: POOL // 2]
        _, slots = h.serve(tokens, f"r{i}")
        h.assert_kv(tokens, slots)
        if i % 7 == 0:
            h.step([h.request(tokens, f"w{i}")])
    h.step()
    stats = h.state.stats
    assert stats.demoted_chunks > 0 and stats.host_evicted_chunks > 0 and stats.host_hit_chunks > 0
    assert h.state.tree.locked_chunks == 0 and h.cache.protected_size() == 0
    h.check()
    assert h.state.slots.num_free + h.state.tree.host_chunks == h.state.slots.num_slots


# ---------------------------------------------------------------- SSD tier
def persisted(h: Harness, prompts: list[list[int]]) -> None:
    """Serve each prompt and push it out of device memory, letting write-back finish each
    time (a chunk being written stays in host memory until it is on SSD)."""
    for i, tokens in enumerate(prompts):
        h.serve(tokens, f"p{i}")
        h.cache.evict(EvictParams(num_tokens=10**6))
        h.drain_io()


def read_through_hold(h: Harness, tokens: list[int], rid: str = "r"):
    """A request whose chunks are on SSD is held in the queue until its reads land, then admitted."""
    req = h.request(tokens, rid)
    passes = 0
    while not h.scheduler.admission.admit_now(req):
        passes += 1
        assert passes < 3000, "the request was never released"
        time.sleep(0.005)
        h.step([req])
    return req, passes


@pytest.mark.parametrize("ssd_write", ["through", "on-evict"])
def test_chunks_come_back_from_ssd_and_survive_a_restart(make, tmp_path, ssd_write):
    prompts = [prompt(100), prompt(200)]
    h = make(host_slots=3, ssd_path=tmp_path / "ssd", ssd_write=ssd_write)
    persisted(h, prompts)
    if ssd_write == "on-evict":
        # The first prompt was written when the second's eviction picked it, and the
        # second found no host slot meanwhile (eviction never waits for the disk): served
        # again, it takes the first's place in host memory.
        assert h.state.ssd_stats.written_chunks == 3 and h.state.stats.dropped_chunks == 3
        h.serve(prompts[1], "p1-again")
        h.cache.evict(EvictParams(num_tokens=10**6))
        # Reading the first prompt back needs host slots: eviction picks the second's
        # chunks, which are written first, so this first try finds no slot.
        assert h.scheduler.admission.admit_now(h.request(prompts[0] + [0], "first-try"))
        assert h.state.writes_in_flight == 3 and h.state.reads_in_flight == 0
        h.drain_io()
    assert h.state.tree.ssd_chunks >= 3 and h.state.tree.host_chunks <= 3
    held = h.state.ssd_stats.held_requests
    req, passes = read_through_hold(h, prompts[0] + [0])
    h.admit(req)
    h.scheduler.admitted(req)
    assert req.prefix_len == 12 and req.cached_tokens_storage > 0
    # The hold is counted once, as a wait that ended when the reads landed.
    assert h.state.ssd_stats.held_requests == held + (passes > 0) and h.state.ssd_stats.held_expired == 0
    assert req.cached_tokens_storage + req.cached_tokens_host == 12
    h.assert_kv(prompts[0], h.cache.path_device_indices(req.last_node))
    h.step()
    h.check()
    h.drain_io()
    assert h.state.tree.ssd_chunks == 6  # both prompts, written through or when evicted
    h2 = make(host_slots=3, ssd_path=tmp_path / "ssd")  # a new server on the same directory
    assert h2.state.ssd_stats.restored_chunks == 6
    for i, tokens in enumerate(prompts):
        req, _ = read_through_hold(h2, tokens + [0], f"again{i}")
        h2.admit(req)
        assert req.prefix_len == 12 and req.storage_hit_length == 12
        h2.assert_kv(tokens, h2.cache.path_device_indices(req.last_node))
        h2.cache.evict(EvictParams(num_tokens=10**6))
        h2.drain_io()


def _hint(h: Harness, tokens: list[int], rid: str = "hint") -> None:
    from pcr_sglang.core.hints import HintPayload

    assert h.scheduler.kv_hints.add(h.request(tokens, rid), HintPayload(hint_only=True, ttl_s=60))


@pytest.mark.parametrize("to_device", ["on", "off"])
def test_a_hinted_chain_read_from_ssd_goes_on_into_free_device_slots(make, tmp_path, to_device):
    """--pcr-hint-to-device: after a restart (every chunk on SSD only), a hint's chain is
    read into host memory and, with 'on', loaded on into free device slots before its
    request comes: the request finds it all on the device with the right KV. Either way
    the hint's reads count as in time."""
    tokens = prompt(100)
    persisted(make(host_slots=3, ssd_path=tmp_path / "ssd"), [tokens])
    h = make(host_slots=12, ssd_path=tmp_path / "ssd", hint_to_device=to_device)  # hints take a quarter
    assert h.state.tree.ssd_chunks == 3 and h.state.tree.host_chunks == 0
    _hint(h, tokens + [0])
    h.step()  # orders the hinted reads
    h.drain_io()  # applies them as they land (and promotes, in the same step)
    req = h.request(tokens + [0], "final")
    assert h.scheduler.admission.admit_now(req)  # nothing left to wait for
    device, loaded = h.admit(req)
    h.scheduler.admitted(req)
    assert (device, loaded) == ((12, 0) if to_device == "on" else (0, 12))
    assert h.state.ssd_stats.hint_promoted == (3 if to_device == "on" else 0)
    assert h.state.ssd_stats.hint_in_time == 3 and h.state.ssd_stats.hint_wasted == 0
    h.assert_kv(tokens, h.cache.path_device_indices(req.last_node))
    h.step()
    h.check()


def test_hints_go_to_the_device_only_while_half_the_pool_stays_free(make, tmp_path):
    """Promotion never evicts and leaves at least half the device pool free: with most of
    it taken, the hinted chain stays in host memory; once room is back it goes on, and a
    promoted chain whose hint ends unused counts as wasted."""
    tokens = prompt(300)
    persisted(make(host_slots=3, ssd_path=tmp_path / "ssd"), [tokens])
    h = make(host_slots=12, ssd_path=tmp_path / "ssd", hint_to_device="on")
    taken = h.allocator.alloc(POOL // 2)  # 12 more would leave less than half free
    _hint(h, tokens + [0])
    h.step()  # orders the hinted reads
    h.drain_io()  # applies them as they land (and promotes, in the same step)
    assert h.state.ssd_stats.hint_promoted == 0 and h.state.tree.host_chunks == 3
    assert h.state.tree.device_chunks == 0
    h.allocator.free(taken)
    h.step()
    assert h.state.ssd_stats.hint_promoted == 3 and h.state.tree.device_chunks == 3
    h.check()
    h.scheduler.hints.expire(float("inf"))  # the hint ends: nothing needs the chain any more
    h.step()
    assert h.state.ssd_stats.hint_wasted == 3 and h.state.ssd_stats.hint_in_time == 0
    h.check()


def test_a_flush_ends_the_live_hints_so_nothing_is_read_back(make, tmp_path):
    """``/flush_cache`` empties the cache; a hint registered before it must not read its
    chain back from the SSD into the emptied cache afterwards."""
    tokens = prompt(100)
    persisted(make(host_slots=3, ssd_path=tmp_path / "ssd"), [tokens])
    h = make(host_slots=12, ssd_path=tmp_path / "ssd")
    _hint(h, tokens + [0])
    h.cache.reset()
    h.step()
    h.drain_io()
    assert len(h.scheduler.hints) == 0 and h.scheduler.hints.stats.expired == 1
    assert h.state.tree.host_chunks == 0 and h.state.ssd_stats.hint_issued == 0
    h.check()


def test_on_evict_writes_a_chunk_when_host_eviction_picks_it(make, tmp_path):
    """With --pcr-ssd-write on-evict nothing is written while host memory has room; the
    chunk host eviction picks is written first and leaves host memory once written."""
    h = make(host_slots=3, ssd_path=tmp_path / "ssd", ssd_write="on-evict")
    h.serve(prompt(100), "a")
    h.cache.evict(EvictParams(num_tokens=10**6))  # three chunks fill host memory
    h.drain_io()
    assert h.state.ssd_stats.written_chunks == 0 and h.state.tree.host_chunks == 3
    h.serve(prompt(200), "b")
    h.cache.evict(EvictParams(num_tokens=10**6))  # needs host slots: the LRU chain is written
    assert h.state.writes_in_flight == 3 and h.state.stats.dropped_chunks == 3  # nothing waited
    h.drain_io()
    assert h.state.ssd_stats.written_chunks == 3
    h.serve(prompt(200), "b-again")
    h.cache.evict(EvictParams(num_tokens=10**6))  # the written chunks leave host memory now
    assert h.state.stats.dropped_chunks == 3 and h.state.stats.host_evicted_chunks == 3
    assert all(n.on_ssd for n in h.state.tree.iter_nodes() if not n.on_host)
    h.drain_io()
    h.check()


def test_a_corrupt_record_is_recomputed_not_used(make, tmp_path):
    tokens = prompt(100)
    h = make(host_slots=16, ssd_path=tmp_path / "ssd")
    persisted(h, [tokens])
    h.close()
    files = sorted((tmp_path / "ssd").rglob("*.chunk"))
    assert len(files) == 3
    keys = [n.key for n in h.state.tree.match(iter(h.scheduler.keys.own(h.request(tokens + [0]))), touch=False).nodes]
    second = next(p for p in files if p.name.startswith(keys[1].hex()))
    data = bytearray(second.read_bytes())
    data[-1] ^= 0x55  # the payload: the restart still lists the record
    second.write_bytes(bytes(data))
    h2 = make(host_slots=16, ssd_path=tmp_path / "ssd")
    req, _ = read_through_hold(h2, tokens + [0])
    h2.step()
    assert h2.admit(req) == (0, CHUNK)  # the first chunk only; the rest is recomputed
    assert h2.state.ssd_stats.read_failures == 1  # found by the I/O process's checksum
    assert h2.state.tree.ssd_chunks == 1 and not second.exists()
    h2.check()


def test_a_full_disk_stops_write_back_and_serving_goes_on(make, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PCR_IO_TEST_FAULTS", '{"fail_writes": true}')
    prompts = [prompt(100), prompt(300)]
    h = make(host_slots=16, ssd_path=tmp_path / "ssd")
    with caplog.at_level("WARNING"):
        persisted(h, prompts)
        h.step()  # the failure is agreed (and write-back stopped) at the next step
    assert not h.state.writes_enabled and h.state.ssd_stats.write_errors >= 1
    assert "write-back is stopped" in caplog.text and h.state.tree.ssd_chunks == 0
    req, slots = h.serve(prompts[1], "again")  # still served from host memory
    assert req.cached_tokens_host == 12
    h.assert_kv(prompts[1], slots)
    h.check()


def test_prefetch_brings_waiting_requests_chunks_to_host_memory_in_time(make, tmp_path):
    prompts = [prompt(100), prompt(200), prompt(300)]
    # Six host slots for nine chunks: prefetch may fill half of them, one request's worth.
    h = make(host_slots=6, ssd_path=tmp_path / "ssd", prefetch_window=1)
    persisted(h, prompts)
    waiting = [h.request(p + [0], f"w{i}") for i, p in enumerate(prompts)]
    first = h.state.match(iter(h.scheduler.keys.own(waiting[0])), touch=False)
    assert first.ssd == 3  # left host memory long ago
    h.step(waiting)  # window 1: orders reads for the first request only
    assert h.state.ssd_stats.prefetch_issued == 3
    h.drain_io(waiting)
    assert h.state.match(iter(h.scheduler.keys.own(waiting[0])), touch=False).host == 3
    assert h.scheduler.admission.admit_now(waiting[0])  # nothing to wait for
    assert h.admit(waiting[0]) == (0, 12)
    h.scheduler.admitted(waiting[0])
    assert waiting[0].cached_tokens_storage == 12
    ssd = h.state.ssd_stats
    assert (ssd.prefetch_in_time, ssd.on_demand_reads, ssd.hit_chunks) == (3, 0, 3)
    assert h.state.timeliness() == 1.0
    # Not prefetched: read on demand while the request waits, counted against timeliness.
    req, passes = read_through_hold(h, prompts[1] + [0], "w1")
    h.admit(req)
    h.scheduler.admitted(req)
    assert ssd.on_demand_reads > 0 and h.state.timeliness() < 1.0
    h.step()
    h.check()


def test_prefetch_fills_at_most_half_the_host_tier(make, tmp_path):
    """A window needing more host slots than the tier holds must not evict its own earlier
    prefetches to make room for later ones (each read would be wasted)."""
    prompts = [prompt(100 * i) for i in range(1, 5)]  # 12 chunks, 6 host slots
    h = make(host_slots=6, ssd_path=tmp_path / "ssd", prefetch_window=4)
    persisted(h, prompts)
    waiting = [h.request(p + [0], f"w{i}") for i, p in enumerate(prompts)]
    for _ in range(4):  # the requests wait several steps
        h.step(waiting)
        h.drain_io(waiting)
    assert h.state.ssd_stats.prefetch_issued == 3  # half the host tier, earliest request first
    assert h.state.match(iter(h.scheduler.keys.own(waiting[0])), touch=False).host == 3
    assert h.state.ssd_stats.prefetch_unused == 0
    assert h.scheduler.admission.admit_now(waiting[0]) and h.admit(waiting[0]) == (0, 12)  # used: room for more
    h.step(waiting[1:])
    assert h.state.ssd_stats.prefetch_issued == 6
    h.drain_io(waiting[1:])
    h.check()


def test_a_request_waits_for_its_reads_in_the_queue_not_in_the_scheduler(make, tmp_path):
    """With the I/O process stopped, a request whose chunks are on SSD is held back each
    pass (no scheduler step waits) until its deadline, then admitted to recompute."""
    tokens = prompt(100)
    h = make(host_slots=6, ssd_path=tmp_path / "ssd")
    persisted(h, [tokens, prompt(200), prompt(300)])  # the first left host memory
    req = h.request(tokens + [0])
    os.kill(h.scheduler.io.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert not h.scheduler.admission.admit_now(req)  # reads ordered together, urgently
        entry = h.scheduler.requests.peek(req.rid)
        assert entry.phase is AdmissionPhase.HOLDING and h.state.reads_in_flight == 3
        worst, phases = 0.0, []
        while not h.scheduler.admission.admit_now(req):
            t = time.perf_counter()
            h.step([req])
            worst = max(worst, time.perf_counter() - t)
            phases.append(entry.phase)
        waited = time.monotonic() - start
        assert phases[-1] is AdmissionPhase.EXPIRED and entry.phase is AdmissionPhase.WAITED  # never held again
        assert waited >= entry.deadline - start - 0.05
        # Counted once, as a wait that ran out, and for about as long as it lasted.
        stats = h.state.ssd_stats
        assert (stats.held_requests, stats.held_expired) == (1, 1)
        assert 0 < stats.held_ms <= 1000 * waited + 1
        assert worst < 0.5  # each step returned at once (generous: a loaded CI machine)
        assert h.admit(req) == (0, 0)  # recomputed: the reads have not landed
    finally:
        os.kill(h.scheduler.io.pid, signal.SIGCONT)
    h.drain_io()  # they land later; nothing leaks
    h.check()
    assert h.state.slots.num_free + h.state.tree.host_chunks == h.state.slots.num_slots


def test_a_dead_io_process_costs_ssd_hits_until_it_is_restarted(make, tmp_path):
    prompts = [prompt(100), prompt(200)]  # six chunks, three host slots
    h = make(host_slots=3, ssd_path=tmp_path / "ssd")
    persisted(h, prompts)
    pid = h.scheduler.io.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while h.scheduler.io.healthy and time.monotonic() < deadline:
        h.step()
    assert h.state.ssd_stats.io_failures == 1 and not h.state.io_healthy
    req = h.request(prompts[0] + [0])
    assert h.scheduler.admission.admit_now(req)  # SSD unavailable: not held, recomputes past host memory
    assert h.admit(req)[1] < 12
    deadline = time.monotonic() + 30
    while not h.scheduler.io.healthy and time.monotonic() < deadline:
        time.sleep(0.1)
        h.step()
    h.step()
    assert h.scheduler.io.pid != pid and h.state.ssd_stats.io_restarts == 1 and h.state.io_healthy
    h.cache.evict(EvictParams(num_tokens=10**6))
    h.drain_io()
    req, _ = read_through_hold(h, prompts[1] + [0], "again")
    assert h.admit(req) == (0, 12)  # SSD hits are back
    h.assert_kv(prompts[1], h.cache.path_device_indices(req.last_node))
    h.check()


def test_reads_and_writes_of_a_reset_tree_release_their_slots_when_they_complete(make, tmp_path):
    tokens = prompt(100)
    h = make(host_slots=6, ssd_path=tmp_path / "ssd")
    persisted(h, [tokens, prompt(200), prompt(300)])
    os.kill(h.scheduler.io.pid, signal.SIGSTOP)
    try:
        assert not h.scheduler.admission.admit_now(h.request(tokens + [0]))
        assert h.state.reads_in_flight == 3
        h.cache.reset()  # /flush_cache with reads in flight: their slots stay reserved
        assert h.state.slots.counts()["releasing"] == 3 and h.state.tree.ssd_chunks == 9
    finally:
        os.kill(h.scheduler.io.pid, signal.SIGCONT)
    h.drain_io()
    assert h.state.slots.num_free == h.state.slots.num_slots
    h.check()


def test_when_the_ranks_disagree_waiting_requests_are_admitted_and_nothing_more_is_read(make, tmp_path, monkeypatch):
    """An agreement that finds the ranks inconsistent stops the SSD tier on every rank:
    requests waiting for reads must be admitted (to recompute), not held forever."""
    from pcr_sglang.core.agreement import Agreed
    from pcr_sglang.sglang_adapter import step_agreement

    tokens = prompt(100)
    h = make(host_slots=6, ssd_path=tmp_path / "ssd")
    persisted(h, [tokens, prompt(200), prompt(300)])
    req = h.request(tokens + [0])
    os.kill(h.scheduler.io.pid, signal.SIGSTOP)
    try:
        assert not h.scheduler.admission.admit_now(req)  # held for its reads
        monkeypatch.setattr(
            step_agreement, "agree", lambda view, reduce_min: Agreed(False, False, consistent=False, error="test")
        )
        h.step([req])
        assert h.scheduler.agreement.broken == "test" and not h.state.io_healthy
        assert h.scheduler.admission.admit_now(req)  # admitted now, to recompute
        assert h.scheduler.admission.admit_now(h.request(prompt(200) + [0], "other"))  # and nobody else waits
    finally:
        os.kill(h.scheduler.io.pid, signal.SIGCONT)


def test_report_walks_the_tree_only_when_asked(make, monkeypatch):
    """/server_info's default report must not run the O(tree) check; asked, it reports
    what the check found instead of raising into the scheduler."""
    h = make()
    h.serve(prompt(100, 2), "r")
    walks = []

    def broken_check():
        walks.append(1)
        raise AssertionError("bookkeeping broken")

    monkeypatch.setattr(h.state, "check", broken_check)
    plain = h.cache.report()["invariants"]
    assert walks == [] and plain == {"checked": False, "ok": None, "error": None}
    asked = h.cache.report(check_invariants=True)["invariants"]
    assert walks == [1] and asked["checked"] is True and asked["ok"] is False
    assert "bookkeeping broken" in asked["error"]


def test_lookahead_protects_a_waiting_requests_document_chains(make):
    """With document reuse, a waiting request that marks documents needs their canonical
    chains as it needs its own prefix: the look-ahead window protects them (one window
    entry per request, its documents included), so eviction takes an unrelated chain."""
    from types import SimpleNamespace

    from pcr_sglang.reuse.bounds import Recompute, parse_doc_bounds
    from pcr_sglang.reuse.placement import DocReuse
    from pcr_sglang.reuse.plan import canonical_tokens
    from pcr_sglang.transfer.rope_shift import RopeSpec

    h = make(lookahead_window=1)
    kv = h.allocator.get_kvcache()
    h.scheduler.docs = DocReuse(
        h.state,
        Recompute("concat"),
        CHUNK,
        0,
        RopeSpec(8, 8, True, (1.0, 0.1, 0.01, 0.001)),
        list(zip(kv.k_buffer, kv.v_buffer)),
        h.allocator,
        h.scheduler.keyer,
        h.scheduler.executor.free_private,
    )
    leading, doc = [7, 7], prompt(300, 2)[:6]
    tokens = leading + prompt(400, 1) + doc + [5, 5, 5]  # S, another document, doc, the question
    bounds = [2, 2 + CHUNK, 2 + CHUNK, 2 + CHUNK + 6]
    canonical = canonical_tokens(tokens, parse_doc_bounds(bounds, len(tokens))[1], 2, CHUNK, 0)
    h.serve(canonical, "warm-up")  # doc's canonical chain S ‖ doc ‖ pad: 2 chunks
    h.serve(prompt(500, 2), "unrelated")
    waiting = h.request(tokens, "marked")
    waiting.sampling_params = SimpleNamespace(custom_params={"pcr_doc_bounds": bounds})
    h.step([waiting])
    assert h.cache.report()["lookahead_protected_chunks"] == 2  # the canonical chain (its own prefix is not cached)
    assert h.cache.evict(EvictParams(num_tokens=2 * CHUNK)).num_tokens_evicted == 8
    assert h.match(canonical).device_prefix_len == 2 * CHUNK  # the documents' chain survived
    assert h.state.stats.evicted_protected_chunks == 0


def test_prefetch_reads_a_waiting_requests_document_chains_from_ssd(make, tmp_path):
    """With document reuse, the queue prefetcher reads the canonical chains of a waiting
    request's documents (only on SSD) into host memory, as it reads the request's own
    prefix, so the request finds them resident when it is admitted."""
    from types import SimpleNamespace

    from pcr_sglang.reuse.bounds import Recompute, parse_doc_bounds
    from pcr_sglang.reuse.placement import DocReuse
    from pcr_sglang.reuse.plan import canonical_tokens
    from pcr_sglang.transfer.rope_shift import RopeSpec

    h = make(host_slots=6, ssd_path=tmp_path / "ssd", prefetch_window=1)
    kv = h.allocator.get_kvcache()
    h.scheduler.docs = DocReuse(
        h.state,
        Recompute("concat"),
        CHUNK,
        0,
        RopeSpec(8, 8, True, (1.0, 0.1, 0.01, 0.001)),
        list(zip(kv.k_buffer, kv.v_buffer)),
        h.allocator,
        h.scheduler.keyer,
        h.scheduler.executor.free_private,
    )
    leading, doc = [7, 7], prompt(300, 2)[:6]
    tokens = leading + prompt(400, 1) + doc + [5, 5, 5]
    bounds = [2, 2 + CHUNK, 2 + CHUNK, 2 + CHUNK + 6]
    canonical = canonical_tokens(tokens, parse_doc_bounds(bounds, len(tokens))[1], 2, CHUNK, 0)
    persisted(h, [canonical, prompt(500), prompt(600)])  # the canonical chain left host memory long ago
    assert h.state.match(iter(h.scheduler.keys.of_tokens(canonical)), touch=False).ssd == 2
    waiting = h.request(tokens, "marked")
    waiting.sampling_params = SimpleNamespace(custom_params={"pcr_doc_bounds": bounds})
    h.step([waiting])
    assert h.state.ssd_stats.prefetch_issued == 2
    h.drain_io([waiting])
    assert h.state.match(iter(h.scheduler.keys.of_tokens(canonical)), touch=False).host == 2
    h.step()
    h.check()
