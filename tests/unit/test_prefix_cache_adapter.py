"""PCRPrefixCache against SGLang's real CPU token allocator, without a server."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from pcr_sglang.config import PCRConfig  # noqa: E402
from pcr_sglang.core import CacheNamespace  # noqa: E402
from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache  # noqa: E402

CHUNK = 4
POOL = 64


def make_cache(lookahead_window=8):
    allocator = TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=1)
    config = PCRConfig(enabled=True, chunk_size=CHUNK, lookahead_window=lookahead_window)
    return PCRPrefixCache(params, config, CacheNamespace("m", "float16", CHUNK)), allocator


def cache_prompt(cache, allocator, tokens):
    slots = allocator.alloc(len(tokens))
    result = cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    # The caller frees its copies of what was already cached, and its partial tail.
    allocator.free(slots[: result.prefix_len])
    allocator.free(slots[result.total_len :])
    return result


def test_match_reports_whole_chunks_and_slots():
    cache, allocator = make_cache()
    tokens = list(range(10))
    cache_prompt(cache, allocator, tokens)
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens + [99]))))
    assert match.device_prefix_len == 8
    assert len(cache.path_device_indices(match.last_device_node)) == 8
    other_tenant = RadixKey(array("q", tokens), cache_salt="b")
    assert cache.match_prefix(MatchPrefixParams(key=other_tenant)).device_prefix_len == 0


def test_every_slot_is_free_or_owned_once():
    cache, allocator = make_cache()
    for start in range(0, 30, 5):
        cache_prompt(cache, allocator, list(range(start, start + 9)))
    owned = cache.all_values_flatten().tolist()
    assert len(owned) == len(set(owned)) == cache.total_size()
    assert allocator.available_size() + cache.total_size() == POOL
    cache.evict(EvictParams(num_tokens=10**6))
    assert cache.total_size() == 0 and allocator.available_size() == POOL


def test_lookahead_protects_waiting_requests_chunks():
    cache, allocator = make_cache(lookahead_window=1)
    old = list(range(100, 108))
    young = list(range(200, 208))
    cache_prompt(cache, allocator, old)
    cache_prompt(cache, allocator, young)
    waiting = [SimpleNamespace(rid="r1", origin_input_ids=old + [1, 2], extra_key=None, cache_salt=None)]
    cache.update_lookahead(waiting)
    assert cache.report()["lookahead_protected_chunks"] == 2
    free_before = allocator.available_size()
    result = cache.evict(EvictParams(num_tokens=CHUNK * 2))
    assert result.num_tokens_evicted == 8
    assert allocator.available_size() == free_before + 8
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", old))))
    assert match.device_prefix_len == 8  # the older chain survived: it is needed next
    assert cache.stats.evicted_protected_chunks == 0


def test_lookahead_window_zero_is_plain_lru():
    cache, allocator = make_cache(lookahead_window=0)
    old, young = list(range(100, 108)), list(range(200, 208))
    cache_prompt(cache, allocator, old)
    cache_prompt(cache, allocator, young)
    cache.update_lookahead([SimpleNamespace(rid="r1", origin_input_ids=old, extra_key=None, cache_salt=None)])
    cache.evict(EvictParams(num_tokens=8))
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", old)))).device_prefix_len == 0


# ---------------------------------------------------------------- host tier, layer-wise
LAYERS, HEADS, DIM = 2, 2, 8


def make_tiered_cache(layerwise="both", dram_gb=0.001, ssd_path=None, ssd_write="through", ssd_reserve_bytes=0,
                      prefetch_window=0):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from pcr_sglang.sglang_adapter.factory import build_host_pool, build_ssd_store

    kvcache = MHATokenToKVPool(POOL, 1, torch.float32, HEADS, DIM, LAYERS, "cpu", False)
    allocator = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=1)
    config = PCRConfig(enabled=True, chunk_size=CHUNK, lookahead_window=0, dram_gb=dram_gb,
                       layerwise=layerwise, ssd_path=str(ssd_path) if ssd_path else None,
                       ssd_gb=0.01 if ssd_path else 0.0, ssd_write=ssd_write, prefetch_window=prefetch_window)
    host_pool = build_host_pool(config, allocator)
    namespace = CacheNamespace("m", "float32", CHUNK)
    store = None
    if ssd_path is not None:
        store = build_ssd_store(config, namespace, host_pool)
        store.low_watermark_bytes = ssd_reserve_bytes  # the I/O process takes it at spawn
    cache = PCRPrefixCache(params, config, namespace, host_pool=host_pool, ssd_store=store)
    return cache, allocator, kvcache, host_pool


def cache_prompt_with_kv(cache, allocator, kvcache, tokens):
    """Cache ``tokens`` with distinct KV values; returns those values per layer."""
    slots = allocator.alloc(len(tokens))
    values = []
    for layer in range(LAYERS):
        k = torch.randn(len(tokens), HEADS, DIM)
        v = torch.randn(len(tokens), HEADS, DIM)
        kvcache.k_buffer[layer][slots] = k
        kvcache.v_buffer[layer][slots] = v
        values.append((k, v))
    result = cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
    allocator.free(slots[result.total_len:])
    return values


def match_for_request(cache, tokens):
    req = SimpleNamespace()
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
    return match, req


@pytest.mark.parametrize("layerwise", ["off", "load", "offload", "both"])
def test_host_hits_come_back_with_their_kv_in_every_layerwise_mode(layerwise):
    cache, allocator, kvcache, host_pool = make_tiered_cache(layerwise)
    tokens = list(range(12))
    values = cache_prompt_with_kv(cache, allocator, kvcache, tokens)
    cache.evict(EvictParams(num_tokens=10**6))  # demoted to the host
    assert cache.total_size() == 0 and cache.tree.host_chunks == 3
    match, req = match_for_request(cache, tokens)
    assert match.device_prefix_len == 12 and req.pcr_host_loaded_tokens == 12
    # Loaded chunks count as evictable at once, as with synchronous copies: the scheduler
    # budgets prefills from evictable_size() and would overcommit the pool otherwise.
    assert cache.evictable_size() == 12 and cache.protected_size() == 0
    slots = cache.path_device_indices(match.last_device_node)
    for layer in range(LAYERS):  # what attention reads, through the pool's per-layer hook
        k, v = values[layer]
        assert torch.equal(kvcache.get_key_buffer(layer)[slots], k)
        assert torch.equal(kvcache.get_value_buffer(layer)[slots], v)
    cache.on_scheduler_step([])
    assert cache.tree.check_invariants().locked_chunks == 0


def test_freeing_a_chunk_whose_load_has_not_landed_finishes_the_load_first():
    cache, allocator, kvcache, host_pool = make_tiered_cache("load")
    tokens = list(range(8))
    values = cache_prompt_with_kv(cache, allocator, kvcache, tokens)
    cache.evict(EvictParams(num_tokens=10**6))
    match, _ = match_for_request(cache, tokens)
    slots = cache.path_device_indices(match.last_device_node).clone()
    assert cache._transfers.busy  # no forward has read the layers yet
    cache.evict(EvictParams(num_tokens=10**6))  # frees those device slots
    assert not cache._transfers.busy
    # The copy landed before the slots were freed, so a new owner's writes cannot be
    # overwritten by it later.
    assert torch.equal(kvcache.k_buffer[LAYERS - 1][slots], values[LAYERS - 1][0])
    assert allocator.available_size() == POOL
    assert host_pool.num_free + cache.tree.host_chunks == host_pool.layout.num_slots
    assert cache.tree.check_invariants().locked_chunks == 0


def test_500_requests_with_eviction_in_both_tiers_leave_every_slot_owned_once():
    """The adapter's books over a long run: device slots (SGLang's allocator) and host
    slots are each free or owned by exactly one node, and no lock is left."""
    import random

    slot_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 4
    cache, allocator, kvcache, host_pool = make_tiered_cache("both", dram_gb=24 * slot_bytes / 2**30)
    assert host_pool.layout.num_slots == 24  # far below the working set: host evictions too
    rng = random.Random(0)
    docs = [[rng.randrange(1000) for _ in range(rng.randrange(3, 14))] for _ in range(30)]
    waiting = []
    for i in range(500):
        tokens = [t for d in rng.sample(docs, rng.randrange(1, 4)) for t in d][: POOL // 2]
        match, _ = match_for_request(cache, tokens)
        cache.inc_lock_ref(match.last_device_node)
        cached = match.device_prefix_len
        need = len(tokens) - cached
        if allocator.available_size() < need:
            cache.evict(EvictParams(num_tokens=need - allocator.available_size()))
        new = allocator.alloc(need)
        assert new is not None
        prefix = cache.path_device_indices(match.last_device_node)
        result = cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=torch.cat([prefix, new])))
        allocator.free(new[result.total_len - cached:])  # the partial last chunk
        cache.dec_lock_ref(match.last_device_node)
        waiting = [SimpleNamespace(rid=f"w{i}", origin_input_ids=tokens, extra_key=None, cache_salt=None)]
        if i % 7 == 0:
            cache.on_scheduler_step(waiting)
    cache.on_scheduler_step([])
    stats = cache.tree.check_invariants()
    counters = cache.stats
    assert counters.demoted_chunks > 0 and counters.host_evicted_chunks > 0 and counters.host_hit_chunks > 0
    assert stats.locked_chunks == 0 and cache.protected_size() == 0
    device = cache.all_values_flatten().tolist()
    assert len(device) == len(set(device)) == cache.total_size()
    assert allocator.available_size() + cache.total_size() == POOL
    host = [n.host_slot for n in cache.tree.iter_nodes() if n.on_host]
    assert len(host) == len(set(host)) == stats.host_chunks
    assert host_pool.num_free + len(host) == host_pool.layout.num_slots


# ---------------------------------------------------------------- SSD tier
def persisted_prompts(cache, allocator, kvcache, prompts):
    """Cache each prompt, push everything out of device and host memory, let the
    write-back finish; returns each prompt's KV values."""
    values = [cache_prompt_with_kv(cache, allocator, kvcache, p) for p in prompts]
    cache.evict(EvictParams(num_tokens=10**6))
    assert cache.ssd.io.wait_idle(timeout_s=30)
    cache.on_scheduler_step([])  # claims completed writes
    return values


def assert_kv(kvcache, slots, values):
    for layer in range(LAYERS):
        k, v = values[layer]
        assert torch.equal(kvcache.get_key_buffer(layer)[slots], k[: len(slots)])
        assert torch.equal(kvcache.get_value_buffer(layer)[slots], v[: len(slots)])


@pytest.mark.parametrize("ssd_write", ["through", "on-evict"])
def test_chunks_come_back_from_ssd_and_survive_a_restart(tmp_path, ssd_write):
    slot_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 4
    dram = 3 * slot_bytes / 2**30  # three host slots for six chunks: the rest only on SSD
    prompts = [list(range(100, 112)), list(range(200, 212))]
    cache, allocator, kvcache, host_pool = make_tiered_cache(dram_gb=dram, ssd_path=tmp_path / "ssd",
                                                             ssd_write=ssd_write)
    values = persisted_prompts(cache, allocator, kvcache, prompts)
    if ssd_write == "on-evict":  # the three still on the host are not written yet
        cache.evict(EvictParams(num_tokens=10**6))
        for node in [n for n in cache.tree.iter_nodes() if n.on_host and not n.on_ssd]:
            cache.tree.evict_host(1, on_evict=cache._free_host_slot)
    assert cache.tree.ssd_chunks >= 3 and cache.tree.host_chunks <= 3
    match, req = match_for_request(cache, prompts[0])
    assert match.device_prefix_len == 12
    assert req.pcr_ssd_loaded_tokens + req.pcr_host_loaded_tokens == 12 and req.pcr_ssd_loaded_tokens > 0
    assert_kv(kvcache, cache.path_device_indices(match.last_device_node), values[0])
    cache.on_scheduler_step([])
    cache.tree.check_invariants()
    cache.ssd.close()
    if ssd_write == "through":
        # A new server on the same directory: every persisted chain is found again.
        cache2, allocator2, kvcache2, _ = make_tiered_cache(dram_gb=dram, ssd_path=tmp_path / "ssd")
        assert cache2.ssd.stats.restored_chunks == 6
        for prompt, value in zip(prompts, values):
            match, req = match_for_request(cache2, prompt)
            assert match.device_prefix_len == 12 and req.pcr_ssd_loaded_tokens == 12
            assert_kv(kvcache2, cache2.path_device_indices(match.last_device_node), value)
        cache2.ssd.close()


def test_a_corrupt_record_is_recomputed_not_used(tmp_path):
    prompts = [list(range(100, 112))]
    cache, allocator, kvcache, _ = make_tiered_cache(ssd_path=tmp_path / "ssd")
    persisted_prompts(cache, allocator, kvcache, prompts)
    cache.ssd.close()
    store_files = sorted((tmp_path / "ssd").rglob("*.chunk"))
    assert len(store_files) == 3
    # Corrupt the second chunk's payload: the restart still lists it (header intact).
    node_keys = [n.key for n in cache.tree.match(iter(cache_keys(cache, prompts[0]))).nodes]
    second = next(p for p in store_files if p.name.startswith(node_keys[1].hex()))
    data = bytearray(second.read_bytes())
    data[-1] ^= 0x55
    second.write_bytes(bytes(data))
    cache2, _, _, _ = make_tiered_cache(ssd_path=tmp_path / "ssd")
    match, req = match_for_request(cache2, prompts[0])
    assert match.device_prefix_len == CHUNK  # the first chunk only; the rest is recomputed
    assert cache2.ssd.stats.read_failures == 1  # found by the I/O process's checksum
    assert cache2.tree.ssd_chunks == 1 and not second.exists()
    cache2.tree.check_invariants()
    cache2.ssd.close()


def test_a_full_disk_stops_write_back_and_serving_goes_on(tmp_path, caplog):
    prompts = [list(range(100, 112)), list(range(300, 312))]
    # A free-space reserve larger than any disk: every write fails like a full disk.
    cache, allocator, kvcache, host_pool = make_tiered_cache(ssd_path=tmp_path / "ssd", ssd_reserve_bytes=1 << 60)
    with caplog.at_level("WARNING"):
        values = persisted_prompts(cache, allocator, kvcache, prompts)
    assert not cache.ssd.writes_enabled and cache.ssd.stats.write_errors >= 1
    assert "write-back is stopped" in caplog.text and cache.tree.ssd_chunks == 0
    match, req = match_for_request(cache, prompts[1])  # still served from host memory
    assert match.device_prefix_len == 12
    assert_kv(kvcache, cache.path_device_indices(match.last_device_node), values[1])
    cache.tree.check_invariants()
    cache.ssd.close()


def cache_keys(cache, tokens):
    from pcr_sglang.core.keys import chunk_keys

    return chunk_keys(cache._root_key(None, None), tokens, CHUNK)


def test_prefetch_brings_waiting_requests_ssd_chunks_to_host_memory_in_time(tmp_path):
    slot_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 4
    prompts = [list(range(100, 112)), list(range(200, 212)), list(range(300, 312))]
    # Six host slots for nine chunks: prefetch may fill half of them, one request's worth.
    cache, allocator, kvcache, host_pool = make_tiered_cache(
        dram_gb=6 * slot_bytes / 2**30, ssd_path=tmp_path / "ssd", prefetch_window=1)
    values = persisted_prompts(cache, allocator, kvcache, prompts)
    # The first prompt's chunks left host memory long ago: SSD only.
    first = cache.tree.match(iter(cache_keys(cache, prompts[0])), touch=False).nodes
    assert all(n.on_ssd and not n.on_host for n in first)
    waiting = [SimpleNamespace(rid=f"r{i}", origin_input_ids=p, extra_key=None, cache_salt=None)
               for i, p in enumerate(prompts)]
    cache.on_scheduler_step(waiting)  # window 1: orders reads for the first request only
    assert cache.ssd.stats.prefetch_issued == 3
    assert cache.ssd.io.wait_idle(timeout_s=30)
    cache.on_scheduler_step(waiting)  # completions land the chunks in host memory
    assert all(n.on_host for n in first) and cache.ssd.io_slots == 0
    match, req = match_for_request(cache, prompts[0])  # the request is scheduled
    assert match.device_prefix_len == 12 and req.pcr_ssd_loaded_tokens == 12
    assert cache.ssd.stats.prefetch_in_time == 3 and cache.ssd.timeliness() == 1.0
    assert cache.ssd.stats.on_demand_reads == 0
    assert_kv(kvcache, cache.path_device_indices(match.last_device_node), values[0])
    # Scheduled without prefetch: read on demand, counted against timeliness.
    match, req = match_for_request(cache, prompts[1])
    assert match.device_prefix_len == 12 and cache.ssd.stats.on_demand_reads > 0
    assert cache.ssd.timeliness() < 1.0
    cache.on_scheduler_step([])
    cache.tree.check_invariants()
    assert host_pool.num_free + cache.tree.host_chunks == host_pool.layout.num_slots
    cache.ssd.close()


def test_prefetch_fills_at_most_half_the_host_tier(tmp_path):
    """A window needing more host slots than the tier holds must not evict its own earlier
    prefetches to make room for later ones (each read would be wasted)."""
    slot_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 4
    prompts = [list(range(100 * i, 100 * i + 12)) for i in range(1, 5)]  # 12 chunks, 6 host slots
    cache, allocator, kvcache, host_pool = make_tiered_cache(
        dram_gb=6 * slot_bytes / 2**30, ssd_path=tmp_path / "ssd", prefetch_window=4)
    persisted_prompts(cache, allocator, kvcache, prompts)
    waiting = [SimpleNamespace(rid=f"r{i}", origin_input_ids=p, extra_key=None, cache_salt=None)
               for i, p in enumerate(prompts)]
    for _ in range(4):  # the requests wait several steps
        cache.on_scheduler_step(waiting)
        assert cache.ssd.io.wait_idle(timeout_s=30)
    cache.on_scheduler_step(waiting)
    assert cache.ssd.stats.prefetch_issued == 3  # half the host tier, earliest request first
    first = cache.tree.match(iter(cache_keys(cache, prompts[0])), touch=False).nodes
    assert all(n.on_host for n in first) and cache.ssd.stats.prefetch_wasted == 0
    match, _ = match_for_request(cache, prompts[0])  # used: room for the next request's reads
    assert cache.ssd.stats.prefetch_in_time == 3
    cache.on_scheduler_step(waiting[1:])
    assert cache.ssd.stats.prefetch_issued == 6
    cache.tree.check_invariants()
    cache.ssd.close()


def _stalled_prefetch(tmp_path):
    """A cache whose three SSD chunks of one prompt are ordered by prefetch, with the I/O
    process stopped (SIGSTOP) so that the reads stay queued."""
    import os
    import signal

    slot_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 4
    prompts = [list(range(100, 112)), list(range(200, 212)), list(range(300, 312))]
    cache, allocator, kvcache, host_pool = make_tiered_cache(
        dram_gb=6 * slot_bytes / 2**30, ssd_path=tmp_path / "ssd", prefetch_window=1)
    values = persisted_prompts(cache, allocator, kvcache, prompts)
    cache.ssd.wait_budget_s = 0.05  # how long a match waits for a chunk in flight
    waiting = [SimpleNamespace(rid="r0", origin_input_ids=prompts[0], extra_key=None, cache_salt=None)]
    os.kill(cache.ssd.io.pid, signal.SIGSTOP)
    cache.on_scheduler_step(waiting)
    assert cache.ssd.stats.prefetch_issued == 3
    resume = lambda: os.kill(cache.ssd.io.pid, signal.SIGCONT)  # noqa: E731
    return cache, kvcache, waiting, RadixKey(array("q", prompts[0])), values[0], resume


def test_a_request_matched_in_several_passes_counts_a_late_chunk_once(tmp_path):
    """SGLang matches the head of the waiting queue in every pass, also in passes that do
    not admit it. A prefetch found in flight counts late once, when its request is admitted."""
    cache, _, _, key, _, resume = _stalled_prefetch(tmp_path)
    req = SimpleNamespace()
    try:
        for _ in range(2):  # two passes match the request with its first chunk in flight
            match = cache.match_prefix(MatchPrefixParams(key=key, req=req))
            assert match.device_prefix_len == 0
        assert cache.ssd.stats.prefetch_late == 0  # not admitted yet
        cache.count_admitted([req])  # admitted after the second pass: it recomputes
        cache.count_admitted([req])  # a later extend of the same request counts nothing
    finally:
        resume()
    assert cache.ssd.stats.prefetch_late == 1
    assert cache.ssd.io.wait_idle(timeout_s=30)
    cache.ssd.close()


def test_a_prefetch_that_lands_before_its_request_is_admitted_counts_in_time(tmp_path):
    """A read found in flight by a pass that does not admit the request, and landed before
    the pass that does, counts in time, and was never counted late (the Prometheus counter
    of late chunks only grows)."""
    cache, kvcache, waiting, key, values, resume = _stalled_prefetch(tmp_path)
    req = SimpleNamespace()
    try:
        match = cache.match_prefix(MatchPrefixParams(key=key, req=req))
        assert match.device_prefix_len == 0
    finally:
        resume()
    assert cache.ssd.io.wait_idle(timeout_s=30)
    cache.on_scheduler_step(waiting)  # the reads land before the pass that admits it
    match = cache.match_prefix(MatchPrefixParams(key=key, req=req))
    assert match.device_prefix_len == 12 and req.pcr_ssd_loaded_tokens == 12
    cache.count_admitted([req])
    assert cache.ssd.stats.prefetch_late == 0 and cache.ssd.stats.prefetch_in_time == 3
    assert cache.ssd.timeliness() == 1.0 and cache.ssd.stats.on_demand_reads == 0
    assert_kv(kvcache, cache.path_device_indices(match.last_device_node), values)
    cache.tree.check_invariants()
    cache.ssd.close()


def test_io_process_cancels_and_expedites_queued_reads(tmp_path):
    """Reorder orders act on reads still queued in the I/O process: a cancelled read comes
    back cancelled and leaves its slot untouched; an expedited one runs next."""
    import os
    import signal

    slot_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 4
    prompts = [list(range(100 * i, 100 * i + 12)) for i in range(1, 5)]  # 12 chunks, 6 host slots
    cache, allocator, kvcache, host_pool = make_tiered_cache(
        dram_gb=6 * slot_bytes / 2**30, ssd_path=tmp_path / "ssd")
    persisted_prompts(cache, allocator, kvcache, prompts)
    nodes = [n for p in prompts for n in cache.tree.match(iter(cache_keys(cache, p)), touch=False).nodes
             if not n.on_host][:6]
    assert len(nodes) == 6 and all(n.on_ssd for n in nodes)
    io = cache.ssd.io
    slots = [cache._alloc_host_slot() for _ in nodes]  # evicts other chunks' host copies
    for slot in slots:
        host_pool.slot_view(slot).fill_(0x5A)
    os.kill(io.pid, signal.SIGSTOP)  # every order below waits in the process's queue
    try:
        seqs = [io.submit_read(n.key, s) for n, s in zip(nodes, slots)]
        io.cancel(seqs[4])
        io.expedite(seqs[5])
    finally:
        os.kill(io.pid, signal.SIGCONT)
    assert io.wait_idle(timeout_s=30)
    done = io.poll()
    order = [c.order.seq for c in done]
    assert sorted(order) == sorted(seqs)
    by_seq = {c.order.seq: c for c in done}
    assert by_seq[seqs[4]].done.cancelled and not by_seq[seqs[4]].ok
    assert bool((host_pool.slot_view(slots[4]) == 0x5A).all())  # never written
    assert all(by_seq[q].ok for i, q in enumerate(seqs) if i != 4)
    # The expedited read overtook the reads queued before it (the first may have started).
    assert order.index(seqs[5]) <= 1
    host_pool.free(slots)
    cache.tree.check_invariants()
    cache.ssd.close()


def test_a_dead_io_process_costs_ssd_hits_until_it_is_restarted(tmp_path):
    import os
    import signal
    import time

    prompts = [list(range(100, 112)), list(range(200, 212))]  # six chunks, three host slots
    cache, allocator, kvcache, host_pool = make_tiered_cache(
        dram_gb=3 * LAYERS * 2 * CHUNK * HEADS * DIM * 4 / 2**30, ssd_path=tmp_path / "ssd")
    values = persisted_prompts(cache, allocator, kvcache, prompts)
    os.kill(cache.ssd.io.pid, signal.SIGKILL)
    cache.ssd.io._proc.wait()
    match, _ = match_for_request(cache, prompts[0])  # SSD unavailable: recompute past host memory
    assert match.device_prefix_len < 12
    cache.on_scheduler_step([])
    assert cache.ssd.stats.io_failures == 1 and not cache.ssd.io.healthy
    deadline = time.monotonic() + 30
    while not cache.ssd.io.healthy and time.monotonic() < deadline:
        time.sleep(0.2)
        cache.on_scheduler_step([])
        cache.ssd.io.wait_ready(timeout_s=1)
    assert cache.ssd.io.healthy and cache.ssd.stats.io_restarts == 1
    cache.evict(EvictParams(num_tokens=10**6))
    match, req = match_for_request(cache, prompts[0])
    assert match.device_prefix_len == 12  # SSD hits are back
    assert_kv(kvcache, cache.path_device_indices(match.last_device_node), values[0])
    cache.ssd.close()
