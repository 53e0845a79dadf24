"""Decode-time offloads over SGLang's real CPU KV pool, allocator and request-to-token
pool, driven the way SGLang's scheduler drives a running batch: prefill (planned
offloads, then the checkpoint SGLang makes after a prefill), decode steps (a token per
request per step, ``prepare_for_decode`` planning the chunks each step completes), and
the final checkpoint when a request finishes (``release_kv_cache``).

A chunk a decode step completes can only reach the tree when its request finishes, so
its host slot stays reserved (outside the tree, not evictable) for the rest of the
generation: decode offloads take at most a bounded share of the host tier, and only
free slots, never a tree chunk's."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402

from tests.unit.adapter_harness import CHUNK, DIM, HEADS, LAYERS, Harness, make  # noqa: E402,F401

MAX_LEN = 256


@dataclass
class RunningReq:
    """The fields of SGLang's ``Req`` that admission, offload planning and the checkpoint read."""

    rid: str
    origin_input_ids: array
    kv: Any = None
    lock: Any = None
    last_node: Any = None
    prefix_len: int = 0
    output_ids: array = field(default_factory=lambda: array("q"))
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
    storage_hit_length: int = 0
    storage_hit_start: Optional[int] = None
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_storage: int = 0
    tokens: list = field(default_factory=list)  # every token whose KV is in the row

    @property
    def full_untruncated_fill_ids(self) -> array:
        return array("q", self.tokens)


class Batch:
    """Running requests, their rows in a real ``ReqToTokenPool``, KV written through the
    KV pool's ``set_kv_buffer`` inside ``run_batch`` (so planned offloads copy it)."""

    def __init__(self, h: Harness, max_reqs: int = 16):
        self.h = h
        self.rows = ReqToTokenPool(max_reqs, MAX_LEN, "cpu", False)
        h.cache.req_to_token_pool = self.rows  # what SGLang's CacheInitParams would give it
        self.running: list[RunningReq] = []
        self.max_reserved = 0
        self.max_decode_reserved = 0

    def _alloc(self, n: int) -> torch.Tensor:
        h = self.h
        if h.allocator.available_size() < n:
            h.cache.evict(EvictParams(num_tokens=n - h.allocator.available_size()))
        slots = h.allocator.alloc(n)
        assert slots is not None, "the device pool cannot hold the batch"
        return slots.to(torch.int64)

    def _forward(self, reqs: list[RunningReq], locs: torch.Tensor, tokens: list[int]) -> None:
        values = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1)

        def forward():
            for layer in range(LAYERS):
                k = (values * (1 + layer)).expand(-1, HEADS, DIM) + torch.arange(DIM)
                self.h.kvcache.set_kv_buffer(SimpleNamespace(layer_id=layer), locs, k, k + 1)

        self.h.scheduler.worker.run_batch(forward, [r.rid for r in reqs])
        self._observe()

    def _observe(self) -> None:
        self.max_reserved = max(self.max_reserved, self.h.state.slots.counts()["reserved"])
        self.max_decode_reserved = max(self.max_decode_reserved, self.h.state.decode_reserved_slots)

    def start(self, rid: str, prompt: list[int], req: Optional[RunningReq] = None) -> RunningReq:
        """Admission and prefill, then the checkpoint SGLang makes after a prefill (of
        ``req`` when given: a request with its own namespace fields)."""
        h = self.h
        req = req if req is not None else RunningReq(rid, array("q", prompt))
        h.admit(req)
        h.scheduler.admitted(req)
        req.lock = h.cache.lock(req.last_node)
        cached = req.prefix_len
        new = self._alloc(len(prompt) - cached)
        index = self.rows.free_slots.pop(0)
        row = torch.cat([h.cache.path_device_indices(req.last_node)[:cached], new])
        self.rows.req_to_token[index, : len(prompt)] = row.to(torch.int32)
        req.kv = SimpleNamespace(cache_protected_len=cached, cache_inserted_len=0, req_pool_idx=index)
        req.tokens = list(prompt)
        h.scheduler.plan_offloads([req], [len(prompt)], self.rows.req_to_token, decode=False)
        self._forward([req], new, prompt[cached:])
        h.cache.checkpoint(req, up_to=len(prompt))
        self.running.append(req)
        return req

    def decode(self, next_token) -> None:
        """One decode step: every running request writes one token's KV."""
        reqs = list(self.running)
        locs = self._alloc(len(reqs))
        tokens = []
        for req, loc in zip(reqs, locs):
            self.rows.req_to_token[req.kv.req_pool_idx, len(req.tokens)] = int(loc)
            token = next_token(req)
            req.tokens.append(token)
            tokens.append(token)
        self.h.scheduler.plan_offloads(reqs, [len(r.tokens) for r in reqs], self.rows.req_to_token, decode=True)
        self._forward(reqs, locs, tokens)

    def finish(self, req: RunningReq) -> None:
        """``release_kv_cache``: the final checkpoint, then the row's own part is freed."""
        h = self.h
        h.cache.checkpoint(req, up_to=len(req.tokens))
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        h.scheduler.engine.fence_before_reuse()
        h.allocator.free(row[req.kv.cache_protected_len : len(req.tokens)].to(torch.int64))
        h.cache.unlock(req.lock)
        req.lock = None
        h.cache.on_release(req, checkpointed=True)
        self.rows.free_slots.append(req.kv.req_pool_idx)
        self.running.remove(req)


def host_chunk(h: Harness, node) -> torch.Tensor:
    """``[layer][K|V][token][values]`` of the chunk in host memory."""
    return h.cache.host_pool.slot_view(node.host_slot).view(torch.float32).view(LAYERS, 2, CHUNK, HEADS * DIM)


def expected_chunk(tokens: list[int]) -> torch.Tensor:
    values = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    layer = torch.arange(1, LAYERS + 1, dtype=torch.float32).view(-1, 1, 1, 1)
    k = (values * layer).expand(LAYERS, 1, CHUNK, HEADS * DIM) + torch.arange(DIM).repeat(HEADS)
    return torch.cat([k, k + 1], dim=1)


def chain(h: Harness, tokens: list[int]):
    return h.state.tree.match(iter(h.scheduler.keys.of_tokens(tokens)), touch=False).nodes


def token_of(req: RunningReq) -> int:
    """A deterministic output token, distinct per request and position."""
    return 10_000 + 1_000 * int(req.rid[1:]) + len(req.tokens)


def test_long_generations_of_many_requests_never_take_more_than_the_decode_share(make):
    h = make(host_slots=16, pool=1024)
    share = h.state.decode_offload_limit
    assert share == 4  # a quarter of the host tier
    batch = Batch(h)
    prompts = [list(range(100 * i, 100 * i + CHUNK + 2)) for i in range(8)]  # 1 chunk and 2 tokens each
    for i, tokens in enumerate(prompts):
        batch.start(f"r{i}", tokens)
    assert h.state.stats.offloaded_chunks == 8  # the prompts' chunks, adopted after prefill
    assert h.state.slots.num_free == 8
    evicted = h.state.stats.host_evicted_chunks
    for _ in range(10 * CHUNK):  # ten output chunks per request
        batch.decode(token_of)
        assert h.state.decode_reserved_slots <= share
        assert h.state.slots.counts()["reserved"] <= share
        h.state.check()
    assert batch.max_decode_reserved == share  # the share was used, not more
    assert h.state.stats.host_evicted_chunks == evicted
    finished = [list(r.tokens) for r in batch.running]
    for req in list(batch.running):
        batch.finish(req)
    assert h.state.decode_reserved_slots == 0 and h.state.slots.counts()["reserved"] == 0
    assert h.state.stats.offloaded_chunks == 8 + share
    h.check()
    # The decode-offloaded chunks hold what the forward wrote; the others stayed on the
    # device only (as with the radix cache) and still serve their prefix.
    on_host = 0
    for tokens in finished:
        nodes = chain(h, tokens)
        assert len(nodes) == len(tokens) // CHUNK and all(n.on_device for n in nodes)
        for index, node in enumerate(nodes[1:], start=1):
            if node.on_host:
                on_host += 1
                assert torch.equal(host_chunk(h, node), expected_chunk(tokens[index * CHUNK : (index + 1) * CHUNK]))
    assert on_host == share
    # Everything off the device (copied to host where it fits), then served again.
    h.cache.evict(EvictParams(num_tokens=10**6))
    for i, tokens in enumerate(finished):
        req, slots = h.serve(tokens, f"again{i}")
        h.assert_kv(tokens, slots)
    h.check()
    assert h.state.slots.num_free + h.state.tree.host_chunks == h.state.slots.num_slots


def test_a_decode_offload_never_evicts_a_tree_chunk_from_host_memory(make):
    h = make(host_slots=16, pool=1024)
    # 14 one-chunk documents pushed into host memory: 2 host slots stay free.
    for i in range(14):
        h.serve(list(range(1000 + 10 * i, 1000 + 10 * i + CHUNK)), f"doc{i}")
    h.cache.evict(EvictParams(num_tokens=10**6))
    resident = {n for n in h.state.tree.iter_nodes() if n.on_host}
    assert len(resident) == 14 and h.state.slots.num_free == 2
    batch = Batch(h)
    for i in range(4):
        batch.start(f"r{i}", list(range(100 * i, 100 * i + 3)))  # under a chunk: no prefill offload
    assert h.state.slots.num_free == 2
    for _ in range(6 * CHUNK):
        batch.decode(token_of)
        assert {n for n in h.state.tree.iter_nodes() if n.on_host} == resident
    assert h.state.stats.host_evicted_chunks == 0
    assert batch.max_decode_reserved == 2  # the free slots, no more (the share is 4)
    finished = [list(r.tokens) for r in batch.running]
    for req in list(batch.running):
        batch.finish(req)
    h.check()
    for i, tokens in enumerate(finished):
        req, slots = h.serve(tokens, f"again{i}")
        h.assert_kv(tokens, slots)
    h.check()


def test_requests_finishing_give_their_decode_share_to_the_next_ones(make):
    """The share counts reservations held now: as requests finish, their slots are
    adopted (tree chunks, evictable) and newer requests' chunks get offloaded."""
    h = make(host_slots=8, pool=1024)
    assert h.state.decode_offload_limit == 2
    batch = Batch(h)
    for wave in range(3):
        for i in range(3):
            batch.start(f"r{wave * 3 + i}", list(range(100 * (wave * 3 + i), 100 * (wave * 3 + i) + 2)))
        for _ in range(2 * CHUNK):
            batch.decode(token_of)
            assert h.state.decode_reserved_slots <= 2
        for req in list(batch.running):
            batch.finish(req)
        assert h.state.decode_reserved_slots == 0
        h.check()
    assert h.state.stats.offloaded_chunks == 3 * 2  # two per wave, each wave
    assert batch.max_reserved == 2


def test_a_batch_without_host_sequence_lengths_plans_no_offload_and_never_reads_the_device(make, monkeypatch, caplog):
    """SGLang may leave ``seq_lens_cpu`` unset (its speculative path without verify sync):
    the plugin's prepare hooks then plan no offload for that forward (its chunks reach
    host memory when evicted) instead of failing or reading the device tensor."""
    from pcr_sglang import plugin
    from pcr_sglang.sglang_adapter import offloads

    h = make(host_slots=16, pool=1024)
    batch = Batch(h)
    req = batch.start("r1", list(range(CHUNK + 2)))
    planned: list[tuple[list[int], bool]] = []
    monkeypatch.setattr(
        h.scheduler, "plan_offloads", lambda reqs, seq_lens, rows, decode: planned.append((list(seq_lens), decode))
    )

    class DeviceOnly:
        def tolist(self):
            raise AssertionError("the device's sequence lengths were read in the scheduler step")

    prepared = SimpleNamespace(tree_cache=h.cache, reqs=[req], seq_lens_cpu=None, seq_lens=DeviceOnly())
    monkeypatch.setattr(offloads, "_warned_no_host_seq_lens", False)
    with caplog.at_level("WARNING", logger="pcr_sglang.sglang_adapter.offloads"):
        assert plugin._plan_decode_offloads("result", prepared) == "result"
    assert planned == []
    assert "without seq_lens_cpu" in caplog.text
    prepared.seq_lens_cpu = torch.tensor([CHUNK + 3])
    plugin._plan_decode_offloads("result", prepared)
    assert planned == [([CHUNK + 3], True)]
