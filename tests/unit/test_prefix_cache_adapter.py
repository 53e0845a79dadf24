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
