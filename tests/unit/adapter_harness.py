"""PCR's cache over SGLang's real CPU KV pool and allocator, driven the way SGLang's
scheduler drives a tree cache (match, admission with load-back, insert), without a server."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
from sglang.srt.managers.schedule_batch import split_cached_prefix_by_tier
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from pcr_sglang.config import PCRConfig
from pcr_sglang.core import CacheNamespace
from pcr_sglang.sglang_adapter.factory import assemble_pcr_cache

CHUNK = 4
POOL = 64
LAYERS, HEADS, DIM = 2, 2, 8
SLOT_BYTES = LAYERS * 2 * CHUNK * HEADS * DIM * 4


@dataclass
class FakeReq:
    """The fields of SGLang's ``Req`` that the cache and PCR's admission hooks read."""

    rid: str
    origin_input_ids: array
    output_ids: array = field(default_factory=lambda: array("q"))
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
    prefix_len: int = 0
    last_node: object = None
    storage_hit_length: int = 0
    storage_hit_start: Optional[int] = None
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_storage: int = 0


class Harness:
    def __init__(
        self,
        *,
        host_slots: int = 0,
        ssd_path=None,
        layerwise: str = "both",
        ssd_write: str = "through",
        lookahead_window: int = 0,
        prefetch_window: int = 0,
        pool: int = POOL,
        tp=None,
        tp_rank: int = 0,
        model_fingerprint: str = "m",
        hint_to_device: str = "auto",
        remote_config: Optional[str] = None,
    ):
        self.kvcache = MHATokenToKVPool(pool, 1, torch.float32, HEADS, DIM, LAYERS, "cpu", False)
        self.allocator = TokenToKVPoolAllocator(pool, torch.float32, "cpu", self.kvcache, need_sort=False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator, page_size=1
        )
        config = PCRConfig(
            enabled=True,
            chunk_size=CHUNK,
            lookahead_window=lookahead_window,
            dram_gb=(host_slots + 0.5) * SLOT_BYTES / 2**30 if host_slots else 0.0,
            layerwise=layerwise,
            ssd_path=str(ssd_path) if ssd_path else None,
            ssd_gb=0.01 if ssd_path else 0.0,
            ssd_reserve_gb=0.0,
            ssd_write=ssd_write,
            prefetch_window=prefetch_window,
            hint_to_device=hint_to_device,
            remote="mooncake" if remote_config else "off",
            remote_config=remote_config,
        )
        self.pool = pool
        namespace = CacheNamespace(model_fingerprint, "float32", CHUNK, tp_rank=tp_rank, tp_size=tp.size if tp else 1)
        self.cache = assemble_pcr_cache(params, config, namespace, tp, tp_rank)
        self.state = self.cache.state
        self.scheduler = self.cache.scheduler
        self.kv: dict[tuple, tuple] = {}  # token prefix -> (k, v) per layer of its last token

    # ------------------------------------------------------------------ SGLang's flow
    def match(self, tokens: list[int], req: Optional[FakeReq] = None):
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))

    def request(self, tokens: list[int], rid: str = "r") -> FakeReq:
        return FakeReq(rid, array("q", tokens))

    def admit(self, req: FakeReq) -> tuple[int, Optional[int]]:
        """Match, then admit as ``PrefillAdder.add_one_req`` does; returns (device, host) tokens
        reused (host None: the load asked SGLang to retry admission at a later pass)."""
        tokens = list(req.origin_input_ids)
        match = self.match(tokens, req)
        req.prefix_len, req.last_node = match.device_prefix_len, match.last_device_node
        device, loaded = match.device_prefix_len, 0
        self.cache.inc_lock_ref(req.last_node)  # the adder's temporary pin
        try:
            if match.host_hit_length:
                result = self.cache.init_load_back(
                    InitLoadBackParams(
                        best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=req
                    )
                )
                if result is None:
                    return device, None
                loaded, node = result
                if loaded:
                    req.last_node = node
        finally:
            self.cache.dec_lock_ref(match.last_device_node)
        req.cached_tokens_device, req.cached_tokens_host, req.cached_tokens_storage = split_cached_prefix_by_tier(
            device + loaded, min(match.host_hit_length, loaded), req.storage_hit_length, req.storage_hit_start
        )
        req.prefix_len = device + loaded
        return device, loaded

    def serve(self, tokens: list[int], rid: str = "r") -> tuple[FakeReq, torch.Tensor]:
        """One whole request: admit, compute the uncached rest (distinct KV), insert.
        Returns the request and the device slots of its whole chunks."""
        req = self.request(tokens, rid)
        self.admit(req)
        self.scheduler.admitted(req)
        self.cache.inc_lock_ref(req.last_node)
        cached = req.prefix_len
        need = len(tokens) - cached
        if self.allocator.available_size() < need:
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            self.cache.evict(EvictParams(num_tokens=need - self.allocator.available_size()))
        new = self.allocator.alloc(need)
        assert new is not None, "the device pool cannot hold the request"
        self.write_kv(new, tokens[cached:])
        prefix = self.cache.path_device_indices(req.last_node)[:cached]
        slots = torch.cat([prefix, new.to(torch.int64)])
        result = self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots))
        self.allocator.free(new[result.total_len - cached :])  # the partial last chunk
        if result.prefix_len > cached:  # chunks another request cached meanwhile
            self.allocator.free(new[: result.prefix_len - cached])
        self.cache.dec_lock_ref(req.last_node)
        self.cache.on_release(req, checkpointed=True)
        return req, slots[: result.total_len]

    def serve_offloaded(self, tokens: list[int], rid: str = "r", run_in_batch_of=None) -> FakeReq:
        """One request the way SGLang drives offloads: admit, allocate its row, plan the
        offload of its new whole chunks, run its batch (the forward writes each layer
        through the KV pool's ``set_kv_buffer``), then checkpoint (insert and adopt).
        ``run_in_batch_of``: the request ids of the batch that actually runs (default: it)."""
        from types import SimpleNamespace

        req = self.request(tokens, rid)
        self.admit(req)
        self.cache.inc_lock_ref(req.last_node)
        cached = req.prefix_len
        new = self.allocator.alloc(len(tokens) - cached)
        assert new is not None
        row = torch.cat([self.cache.path_device_indices(req.last_node)[:cached], new.to(torch.int64)])
        req_to_token = row.view(1, -1)
        req.kv = SimpleNamespace(cache_protected_len=cached, req_pool_idx=0)
        self.scheduler.plan_offloads([req], [len(tokens)], req_to_token, decode=False)

        def forward():
            for layer in range(LAYERS):
                values = torch.tensor(tokens[cached:], dtype=torch.float32).view(-1, 1, 1) * (1 + layer)
                k = values.expand(-1, HEADS, DIM) + torch.arange(DIM)
                self.kvcache.set_kv_buffer(SimpleNamespace(layer_id=layer), new, k, k + 1)

        self.scheduler.worker.run_batch(forward, run_in_batch_of or [rid])
        result = self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=row))
        node = self.cache.state.tree.match(iter(self.scheduler.keys.of_tokens(tokens)), touch=False).last_node
        self.scheduler.adopt_offloads(
            rid, node.path_from_root(), cached // CHUNK, result.prefix_len // CHUNK, result.total_len // CHUNK
        )
        self.allocator.free(new[result.total_len - cached :])
        self.cache.dec_lock_ref(req.last_node)
        self.cache.on_release(req, checkpointed=True)
        return req

    def write_kv(self, slots: torch.Tensor, tokens: list[int]) -> None:
        """KV that is a function of the token (so cached KV can be checked wherever it lives)."""
        for layer in range(LAYERS):
            for kv, buf in ((0, self.kvcache.k_buffer[layer]), (1, self.kvcache.v_buffer[layer])):
                values = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1) * (1 + layer) + kv
                buf[slots.to(torch.int64)] = values.expand(-1, HEADS, DIM) + torch.arange(DIM)

    def assert_kv(self, tokens: list[int], slots: torch.Tensor) -> None:
        expected = torch.tensor(tokens[: len(slots)], dtype=torch.float32).view(-1, 1, 1)
        for layer in range(LAYERS):
            for kv, read in ((0, self.kvcache.get_key_buffer), (1, self.kvcache.get_value_buffer)):
                want = (expected * (1 + layer) + kv).expand(-1, HEADS, DIM) + torch.arange(DIM)
                assert torch.equal(read(layer)[slots], want), f"layer {layer} {'KV'[kv]} differs"

    def step(self, waiting=()) -> None:
        self.cache.on_scheduler_step(list(waiting))

    def drain_io(self, waiting=(), timeout_s: float = 30.0) -> None:
        """Step (with ``waiting`` as the queue) until the I/O process has nothing
        outstanding and its completions are applied."""
        import time

        deadline = time.monotonic() + timeout_s
        while self.state.outstanding() or self.scheduler.executor.deferred:
            assert time.monotonic() < deadline, "I/O did not finish"
            self.step(waiting)
            time.sleep(0.01)

    def check(self) -> None:
        self.state.check()
        device = self.cache.all_values_flatten().tolist()
        assert len(device) == len(set(device)) == self.cache.total_size()
        assert self.allocator.available_size() + self.cache.total_size() == self.pool

    def close(self) -> None:
        """What a server's exit does: the I/O process goes, the writer lease is released."""
        self.scheduler.close()
        if self.cache.store is not None:
            self.cache.store.close()
        if self.cache.host_pool is not None:
            self.cache.host_pool.close()


@pytest.fixture
def make():
    """Harnesses a test builds, closed after it (I/O processes, host pools, writer leases)."""
    made = []

    def _make(**kwargs):
        harness = Harness(**kwargs)
        made.append(harness)
        return harness

    yield _make
    for harness in made:
        harness.close()
