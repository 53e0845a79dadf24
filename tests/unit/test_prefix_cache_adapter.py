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


def make_tiered_cache(layerwise="both"):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from pcr_sglang.sglang_adapter.factory import build_host_pool

    kvcache = MHATokenToKVPool(POOL, 1, torch.float32, HEADS, DIM, LAYERS, "cpu", False)
    allocator = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=1)
    config = PCRConfig(enabled=True, chunk_size=CHUNK, lookahead_window=0, dram_gb=0.001,
                       layerwise=layerwise)
    host_pool = build_host_pool(config, allocator)
    cache = PCRPrefixCache(params, config, CacheNamespace("m", "float32", CHUNK), host_pool=host_pool)
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
