"""PCRPrefixCache: SGLang's tree-cache interface on top of PCR's chunk tree.

SGLang hands a tree cache the request's token ids and its row of KV slot indices; this
class cuts them into chunks, asks :class:`~pcr_sglang.core.ChunkTree` what is cached,
and keeps the allocator's books: a slot belongs either to the tree (a whole chunk) or to
a request (its uncached tail and the partial last chunk), never to both, and is freed
exactly once. The request-side protocol (``checkpoint``, locks, ``cache_protected_len``)
mirrors SGLang's own ``RadixCache`` so the scheduler needs no change.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)

from pcr_sglang.config import PCRConfig
from pcr_sglang.core import CacheNamespace, ChunkNode, ChunkTree
from pcr_sglang.core.keys import ChunkKey, chunk_keys, iter_chunk_keys, root_key
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_sglang.metrics import PCRMetrics
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_sglang.tiers.ssd_tier import SSDTier
from pcr_sglang.transfer.copy_kv import Direction
from pcr_sglang.transfer.layerwise import LayerwiseMode, LayerwiseTransfer

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

logger = logging.getLogger(__name__)


@dataclass
class PCRCacheStats:
    """Counters since start (or the last ``reset``)."""

    match_calls: int = 0  # lookups; the scheduler may look a request up more than once
    matched_tokens: int = 0  # tokens found cached, summed over lookups
    inserted_chunks: int = 0  # chunks that became cached
    duplicate_chunks: int = 0  # chunks a request computed that another had cached meanwhile
    evicted_chunks: int = 0
    evicted_protected_chunks: int = 0  # look-ahead chunks evicted because nothing else was left
    lookahead_refreshes: int = 0
    device_hit_chunks: int = 0  # chunks found on the device by requests' matches
    host_hit_chunks: int = 0  # chunks loaded back from the host tier for requests
    demoted_chunks: int = 0  # device evictions copied to the host when evicted
    offloaded_chunks: int = 0  # new chunks copied to the host during their prefill
    host_evicted_chunks: int = 0
    dropped_chunks: int = 0  # device evictions the host tier could not keep
    bytes_host_to_device: int = 0
    bytes_device_to_host: int = 0


@dataclass(frozen=True)
class _LoadBack:
    last_node: ChunkNode  # the deepest chunk of the chain now on the device
    ssd_chunks: int  # of the chunks loaded, those read from the SSD tier


class PCRPrefixCache(BasePrefixCache):
    """A chunk-granular prefix cache on SGLang's device KV pool."""

    def __init__(self, params: CacheInitParams, config: PCRConfig, namespace: CacheNamespace,
                 host_pool: Optional[HostChunkPool] = None, ssd_store: Optional[ChunkFileStore] = None):
        config.validate(params.page_size)
        if params.is_eagle:
            raise ValueError("--enable-pcr does not support speculative decoding yet")
        self.disable = False
        self.config = config
        self.namespace = namespace
        self.chunk_size = config.chunk_size
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.is_eagle = False
        self._namespace_digest = namespace.digest()
        device = getattr(self.token_to_kv_pool_allocator, "device", "cpu")
        self.device = torch.device(device) if isinstance(device, (str, torch.device)) else torch.device("cpu")
        self.metrics: Optional[PCRMetrics] = None
        if params.enable_metrics:
            self.init_metrics_collector()
            self.metrics = PCRMetrics(self.metrics_collector.labels, config.chunk_size)
        self.host_pool = host_pool
        self.layerwise = LayerwiseMode(config.layerwise)
        self._transfers: Optional[LayerwiseTransfer] = None
        # Host slots of new chunks being offloaded during their prefill, by rid and chunk
        # index: owned by the request until its checkpoint hands them to the tree.
        self._pending_offloads: dict[str, dict[int, int]] = {}
        self._offloads_in_flight: set[int] = set()  # host slots an offload may still write
        self._orphaned_host_slots: set[int] = set()  # of those, slots no request owns any more
        self._loading: set[ChunkNode] = set()  # nodes whose load to the device has not settled
        self._prefill_timings: list[tuple[int, Any, Any]] = []  # CUDA: (tokens, begin, end) events
        if host_pool is not None:
            self._attach_transfers(host_pool)
        self.tree = ChunkTree()
        self.ssd: Optional[SSDTier] = None
        if ssd_store is not None:
            if host_pool is None:
                raise ValueError("the SSD tier needs the host tier")
            self.ssd = SSDTier(self.tree, ssd_store, host_pool, config.chunk_size,
                               write_through=config.ssd_write == "through",
                               prefetch_window=config.prefetch_window,
                               prefetch_budget_bytes=config.prefetch_budget_mb << 20)
            self.ssd.free_host_slot = self._free_host_slot
            if self._transfers is not None:
                self.ssd.host_fence = self._transfers.fence_host
        self.lookahead = LookaheadProtection(self.tree, config.lookahead_window)
        # Chunk keys of the requests in the look-ahead window, by rid: hashed once per
        # request, not once per scheduler step.
        self._lookahead_keys: dict[str, list[ChunkKey]] = {}
        self.stats = PCRCacheStats()
        self.reset()
        logger.info(
            "PCR prefix cache: chunk_size=%d, lookahead_window=%d, namespace=%s",
            self.chunk_size, config.lookahead_window, namespace,
        )

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        if self._transfers is not None:
            self._transfers.settle()
        if self.ssd is not None:
            self.ssd.forget_pending()
        self._pending_offloads = {}
        self._offloads_in_flight = set()
        self._orphaned_host_slots = set()
        self._loading = set()
        self.tree.reset()
        if self.host_pool is not None:
            self.host_pool.reset_slots()
        self.lookahead.clear()
        self._lookahead_keys = {}
        self.root_node = self.tree.root
        self.stats = PCRCacheStats()
        self._empty_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        if self.ssd is not None:
            self.ssd.restore()  # what the SSD store holds stays reusable

    def supports_prefix_sharing(self) -> bool:
        return True

    # ------------------------------------------------------------------ keys
    def _root_key(self, extra_key: Optional[str], cache_salt: Optional[str]) -> bytes:
        return root_key(self._namespace_digest, extra_key, cache_salt)

    # ------------------------------------------------------------------ match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key: RadixKey = params.key
        tokens = key.raw_token_ids()
        self.stats.match_calls += 1
        if len(tokens) < self.chunk_size:
            return self._match_result(self.root_node)
        outcome = self.tree.match(
            iter_chunk_keys(self._root_key(key.extra_key, key.cache_salt), tokens, self.chunk_size)
        )
        last = outcome.nodes[outcome.num_on_device - 1] if outcome.num_on_device else self.root_node
        if params.req is not None:
            self.stats.device_hit_chunks += outcome.num_on_device
            if outcome.num_chunks > outcome.num_on_device:
                # Only a request's own match loads: probes must not move KV.
                # A request can be matched in several passes before one admits it (SGLang
                # matches the head of the queue in every pass). Its chunks found in flight
                # are remembered on it and counted late when it is admitted (see
                # count_admitted), unless they land before then: those count in time.
                late = getattr(params.req, "pcr_late_chunks", None)
                if late is None:
                    late = params.req.pcr_late_chunks = set()
                loaded = self._load_back(outcome.nodes, outcome.num_on_device, late)
                if loaded is not None:
                    # Remembered on the request, so that its response reports these
                    # tokens by tier (see the plugin's prepare_for_extend hook).
                    req = params.req
                    from_ssd = loaded.ssd_chunks * self.chunk_size
                    req.pcr_host_loaded_tokens = getattr(req, "pcr_host_loaded_tokens", 0) + (
                        loaded.last_node.depth - outcome.num_on_device) * self.chunk_size - from_ssd
                    req.pcr_ssd_loaded_tokens = getattr(req, "pcr_ssd_loaded_tokens", 0) + from_ssd
                    last = loaded.last_node
        self.stats.matched_tokens += last.depth * self.chunk_size
        return self._match_result(last)

    def _match_result(self, node: ChunkNode) -> MatchResult:
        return MatchResult(
            device_prefix_len=node.depth * self.chunk_size,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )

    def touch_prefix(self, key: RadixKey) -> None:
        tokens = key.raw_token_ids()
        self.tree.match(
            iter_chunk_keys(self._root_key(key.extra_key, key.cache_salt), tokens, self.chunk_size)
        )

    def path_device_indices(self, node: ChunkNode) -> torch.Tensor:
        values = [n.device_value for n in node.path_from_root()]
        return torch.cat(values) if values else self._empty_indices

    # ------------------------------------------------------------------ insert
    def insert(self, params: InsertParams) -> InsertResult:
        """Insert whole chunks of ``params.key`` with slots ``params.value``.

        Returns the length that was already cached: the caller still owns (and must
        free) its slots for that part, as with SGLang's ``RadixCache.insert``.
        """
        key = params.key
        tokens = key.raw_token_ids()
        num_chunks = len(tokens) // self.chunk_size
        if num_chunks == 0:
            return InsertResult(prefix_len=0, last_device_node=self.root_node)
        values = params.value
        if values is None:
            raise ValueError("PCRPrefixCache.insert needs the KV slot indices (params.value)")
        values = values[: num_chunks * self.chunk_size].to(dtype=torch.int64, copy=True)
        keys = chunk_keys(
            self._root_key(key.extra_key, key.cache_salt),
            tokens[: num_chunks * self.chunk_size],
            self.chunk_size,
        )
        outcome = self.tree.insert(keys, list(values.split(self.chunk_size)))
        self.stats.inserted_chunks += len(outcome.new_nodes)
        return InsertResult(
            prefix_len=outcome.num_existing * self.chunk_size,
            total_len=num_chunks * self.chunk_size,
            last_device_node=outcome.last_node,
        )

    def checkpoint(self, req: Req, *, up_to: int, **kwargs) -> None:
        """Hand the request's whole chunks in ``[0, up_to)`` to the tree.

        Chunks another request cached meanwhile are deduplicated: the request's own
        copies are freed and its row is repointed at the tree's slots. The partial last
        chunk stays the request's; ``cache_protected_len`` marks where the tree's part
        ends, so SGLang's ``release_kv_cache`` frees the rest.
        """
        kv = req.kv
        token_ids = req.full_untruncated_fill_ids[:up_to]
        aligned_len = len(token_ids) // self.chunk_size * self.chunk_size
        if aligned_len <= kv.cache_protected_len:
            return
        if self._transfers is not None:
            # Offloads of these chunks complete (or are ordered) before the tree takes
            # them and before any duplicate's device slots are freed below.
            self._transfers.settle()
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :aligned_len]
        from sglang.srt.mem_cache.radix_cache import RadixKey

        result = self.insert(
            InsertParams(
                key=RadixKey(token_ids[:aligned_len], req.extra_key, cache_salt=req.cache_salt),
                value=row,
            )
        )
        kv.cache_inserted_len = max(kv.cache_inserted_len, aligned_len)
        # Our duplicates of chunks the tree already had: [protected, already_cached).
        if result.prefix_len > kv.cache_protected_len:
            self.stats.duplicate_chunks += (result.prefix_len - kv.cache_protected_len) // self.chunk_size
            self.token_to_kv_pool_allocator.free_segment(
                row[kv.cache_protected_len : result.prefix_len].clone(),
                start_pos=kv.cache_protected_len,
            )
        new_last_node: ChunkNode = result.last_device_node
        tree_indices = self.path_device_indices(new_last_node)
        assert len(tree_indices) == aligned_len, (len(tree_indices), aligned_len)
        self.req_to_token_pool.write(
            (kv.req_pool_idx, slice(kv.cache_protected_len, aligned_len)),
            tree_indices[kv.cache_protected_len :].to(row.dtype),
        )
        offloaded = self._pending_offloads.get(req.rid)
        if offloaded:
            self._adopt_offloaded(offloaded, new_last_node, kv.cache_protected_len // self.chunk_size,
                                  result.prefix_len // self.chunk_size, aligned_len // self.chunk_size)
        kv.cache_protected_len = aligned_len
        self.unlock(req.lock)
        req.lock = self.lock(new_last_node)
        req.last_node = new_last_node

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        if self._transfers is not None:
            self._transfers.settle()  # no device slot is freed under a running offload
        super().free_kv_row(kv, ranges)

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        """Give back host slots of chunks offloaded for ``req`` that the tree did not take
        (a request released without a checkpoint, or chunks past its last one)."""
        leftover = self._pending_offloads.pop(req.rid, None)
        if not leftover:
            return
        assert self._transfers is not None and self.host_pool is not None
        self._transfers.settle()
        for slot in leftover.values():
            if slot in self._offloads_in_flight:
                self._orphaned_host_slots.add(slot)  # freed when its copy has settled
            else:
                self.host_pool.free([slot])

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: ChunkNode) -> IncLockRefResult:
        newly_locked = self.tree.lock(node)
        return IncLockRefResult(delta=-newly_locked * self.chunk_size)

    def dec_lock_ref(
        self, node: ChunkNode, params: Optional[DecLockRefParams] = None
    ) -> DecLockRefResult:
        freed = self.tree.unlock(node)
        return DecLockRefResult(delta=freed * self.chunk_size)

    # ------------------------------------------------------------------ per step
    def on_scheduler_step(self, waiting_reqs: Sequence[Req]) -> None:
        """Called by the scheduler hook before each prefill scheduling pass."""
        if self._transfers is not None:
            self._transfers.settle()  # loads no forward has consumed yet
        if self.ssd is not None:
            self.ssd.poll()
            self._drop_bad_records()
            self._collect_prefill_timings()
        self.update_lookahead(waiting_reqs)
        if self.ssd is not None and self.ssd.prefetch_window:
            chains = [self.tree.match(iter(keys), touch=False).nodes
                      for keys in list(self._lookahead_keys.values())[: self.ssd.prefetch_window]]
            self.ssd.prefetch(chains, len(waiting_reqs), self._alloc_host_slot)
        if self.metrics is not None:
            self.metrics.sync(self.stats, self.ssd.stats if self.ssd is not None else None,
                              self.tree.device_chunks, self.tree.host_chunks, self.tree.ssd_chunks)

    def update_lookahead(self, waiting_reqs: Sequence[Req]) -> None:
        """Protect what the first ``--pcr-lookahead-window`` waiting requests will reuse
        (and hash the chunk keys of as many as the prefetcher looks at)."""
        window = self.lookahead.window
        depth = max(window, self.ssd.prefetch_window if self.ssd is not None else 0)
        if depth == 0:
            return
        keys_by_rid: dict[str, list[ChunkKey]] = {}
        for req in waiting_reqs[:depth]:
            keys = self._lookahead_keys.get(req.rid)
            if keys is None:
                keys = chunk_keys(
                    self._root_key(req.extra_key, req.cache_salt), req.origin_input_ids, self.chunk_size
                )
            keys_by_rid[req.rid] = keys
        self._lookahead_keys = keys_by_rid
        self.lookahead.refresh(list(keys_by_rid.values())[:window] if window else [])
        self.stats.lookahead_refreshes += 1

    # ------------------------------------------------------------------ eviction
    def evict(self, params: EvictParams) -> EvictResult:
        if params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        num_chunks = -(-params.num_tokens // self.chunk_size)
        protected = self._lookahead_predicate()
        evicted = self.tree.evict(
            num_chunks,
            on_evict=self._demote_and_free if self.host_pool is not None else self._free_device_slots,
            is_protected=protected,
            on_drop_host=self._free_host_slot,
            on_drop_ssd=self.ssd.delete_record if self.ssd is not None else None,
        )
        if protected is not None:
            self.stats.evicted_protected_chunks += sum(1 for n in evicted if protected(n))
        self.stats.evicted_chunks += len(evicted)
        num_tokens = len(evicted) * self.chunk_size
        self.update_eviction_metrics(num_tokens, start)
        return EvictResult(num_tokens_evicted=num_tokens)

    def _settle_if_loading(self, node: ChunkNode) -> None:
        """Before a slot of ``node`` is freed: if a load into or from it has not settled,
        settle now, so no later write to the reused slot races with the copy."""
        if node in self._loading:
            assert self._transfers is not None
            self._transfers.settle()

    def _free_device_slots(self, node: ChunkNode) -> None:
        self._settle_if_loading(node)
        self.token_to_kv_pool_allocator.free_segment(node.device_value, start_pos=0)

    # ------------------------------------------------------------------ host tier
    def _attach_transfers(self, host_pool: HostChunkPool) -> None:
        """Connect the layer-wise pipeline to SGLang's KV pool: its per-layer read hook
        (loads) and its per-layer write (offloads)."""
        kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        transfers = LayerwiseTransfer(list(zip(kvcache.k_buffer, kvcache.v_buffer)),
                                      host_pool.buffer, host_pool.layout)
        self._transfers = transfers
        # The plugin's forward hook finds the cache here (offloads, prefill speed).
        kvcache.pcr_cache = self
        if self.layerwise.loads:
            if getattr(kvcache, "layer_transfer_counter", None) is not None:
                raise ValueError("--pcr-layerwise load: the KV pool already has a layer-transfer counter")
            kvcache.register_layer_transfer_counter(transfers)
        if self.layerwise.offloads:
            write = kvcache.set_kv_buffer
            start_layer = getattr(kvcache, "start_layer", 0)

            def set_kv_buffer(layer: Any, loc: Any, cache_k: Any, cache_v: Any, *args: Any,
                              **kwargs: Any) -> None:
                write(layer, loc, cache_k, cache_v, *args, **kwargs)
                layer_id = kwargs.get("layer_id_override")
                transfers.on_layer_written((layer.layer_id if layer_id is None else layer_id) - start_layer)

            kvcache.set_kv_buffer = set_kv_buffer

    def _count_bytes(self, direction: Direction, num_chunks: int) -> None:
        assert self.host_pool is not None
        moved = num_chunks * self.host_pool.layout.slot_bytes
        if direction == Direction.HOST_TO_DEVICE:
            self.stats.bytes_host_to_device += moved
        else:
            self.stats.bytes_device_to_host += moved

    def _copy_chunks(self, direction: Direction, device_slots: torch.Tensor,
                     host_slots: list[int]) -> None:
        """Copy every layer of the chunks now, between their device and host slots."""
        assert self._transfers is not None
        self._transfers.copy_now(direction, device_slots, host_slots)
        self._count_bytes(direction, len(host_slots))

    # ------------------------------------------------------------------ forward
    def run_forward(self, forward: Callable[[], Any], forward_batch: Any) -> Any:
        """Around each model forward (the plugin's hook): start the offloads planned for
        it, and time prefills for the SSD tier's load-or-recompute model."""
        if self._transfers is not None:
            self._transfers.begin_forward()
        tokens = getattr(forward_batch, "extend_num_tokens", None)
        if self.ssd is None or not tokens:
            return forward()
        if self.device.type != "cuda":
            start = time.perf_counter()
            result = forward()
            self.ssd.cost_model.observe_prefill(tokens, time.perf_counter() - start)
            return result
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        result = forward()
        end.record()
        self._prefill_timings.append((tokens, begin, end))  # read once the GPU is done
        return result

    def _collect_prefill_timings(self) -> None:
        while self._prefill_timings and self._prefill_timings[0][2].query():
            tokens, begin, end = self._prefill_timings.pop(0)
            assert self.ssd is not None
            self.ssd.cost_model.observe_prefill(tokens, begin.elapsed_time(end) / 1000)

    def count_admitted(self, reqs: Sequence[Req]) -> None:
        """``reqs`` were admitted to a batch: their prefetches that were still in flight
        when a match needed them are counted late now, once per request (and never taken
        back, so Prometheus counters only grow)."""
        for req in reqs:
            late = req.__dict__.pop("pcr_late_chunks", None)
            if late and self.ssd is not None:
                self.ssd.count_late(len(late))

    # ------------------------------------------------------------------ offloads
    def plan_offloads(self, reqs: Sequence[Req], seq_lens: Sequence[int], decode: bool = False) -> None:
        """Give each whole chunk that the next forward completes a host slot, to be
        filled layer by layer during that forward (``--pcr-layerwise`` offload).

        Called after ``prepare_for_extend`` / ``prepare_for_decode``, when each request's
        row holds the slots its new tokens will be written to and ``seq_lens[i]`` is how
        many tokens of ``reqs[i]`` have KV once the forward is done. A prefill completes
        every chunk past the tree's part; a decode step completes at most the chunk its
        token ends. A chunk that finds no host slot is left out; if it is evicted later,
        eviction copies it then.
        """
        if self._transfers is None or not self.layerwise.offloads:
            return
        chunk = self.chunk_size
        device_slots: list[torch.Tensor] = []
        host_slots: list[int] = []
        for req, seq_len in zip(reqs, seq_lens):
            first, end = req.kv.cache_protected_len // chunk, int(seq_len) // chunk
            if decode:
                if seq_len % chunk:
                    continue
                first = max(first, end - 1)
            if end <= first:
                continue
            pending = self._pending_offloads.setdefault(req.rid, {})
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            for index in range(first, end):
                if index in pending:
                    continue
                slot = self._alloc_host_slot()
                if slot is None:
                    break
                pending[index] = slot
                device_slots.append(row[index * chunk:(index + 1) * chunk])
                host_slots.append(slot)
        if host_slots:
            self._offloads_in_flight.update(host_slots)
            self._transfers.plan_offload(
                torch.cat(device_slots), host_slots,
                on_settled=lambda slots=tuple(host_slots): self._offload_settled(slots),
            )
            self._count_bytes(Direction.DEVICE_TO_HOST, len(host_slots))

    def _offload_settled(self, slots: Sequence[int]) -> None:
        assert self.host_pool is not None
        for slot in slots:
            self._offloads_in_flight.discard(slot)
            if slot in self._orphaned_host_slots:
                self._orphaned_host_slots.discard(slot)
                self.host_pool.free([slot])

    def _adopt_offloaded(self, offloaded: dict[int, int], last_node: ChunkNode, first: int,
                         num_existing: int, end: int) -> None:
        """Hand chunks ``[first, end)`` of a request's offloads to the tree: a node that
        took this request's KV and has no host copy takes the slot; otherwise (the tree
        had the chunk already) the slot is freed."""
        assert self.host_pool is not None
        path = last_node.path_from_root()
        for index in range(first, end):
            slot = offloaded.pop(index, None)
            if slot is None:
                continue
            if slot in self._offloads_in_flight:
                # Its forward never wrote through set_kv_buffer; cannot happen once the
                # checkpoint's settle() ran, but never attach a copy that is not there.
                self._orphaned_host_slots.add(slot)
                continue
            node = path[index]
            if index >= num_existing and not node.on_host:
                self._on_host(node, slot)
                self.stats.offloaded_chunks += 1
            else:
                self.host_pool.free([slot])

    def _alloc_host_slot(self) -> Optional[int]:
        pool = self.host_pool
        assert pool is not None
        slots = pool.alloc(1)
        if slots is None:
            evicted = self.tree.evict_host(
                1, on_evict=self._evict_host_slot, is_protected=self._host_eviction_order(),
                on_drop_host=self._free_host_slot,
                on_drop_ssd=self.ssd.delete_record if self.ssd is not None else None,
            )
            self.stats.host_evicted_chunks += len(evicted)
            slots = pool.alloc(1)
        return slots[0] if slots else None

    def _host_eviction_order(self) -> Optional[Callable[[ChunkNode], bool]]:
        """Host leaves evicted last: the look-ahead window's, chunks whose SSD write is
        still reading their slot (evicting those would wait for the disk), and chunks
        prefetched for waiting requests."""
        protected = self._lookahead_predicate()
        ssd = self.ssd
        if ssd is None or protected is None:
            return ssd.protected if ssd is not None else protected
        return lambda node: protected(node) or ssd.protected(node)

    def _lookahead_predicate(self) -> Optional[Callable[[ChunkNode], bool]]:
        """Chunks the look-ahead window protects (None when it protects nothing)."""
        return self.lookahead.__contains__ if len(self.lookahead) else None

    def _free_host_slot(self, node: ChunkNode) -> None:
        """Release ``node``'s host slot (the node is leaving the host tier or the tree)."""
        assert self.host_pool is not None and node.host_slot is not None
        self._settle_if_loading(node)
        if self.ssd is not None:
            self.ssd.before_host_free(node)
        self.host_pool.free([node.host_slot])

    def _evict_host_slot(self, node: ChunkNode) -> None:
        """Host eviction of ``node``: with ``--pcr-ssd-write on-evict`` it is persisted
        first; then its slot is released."""
        if self.ssd is not None:
            self.ssd.before_host_evict(node)
        if node.on_host:  # not dropped by an SSD eviction that persisting needed
            self._free_host_slot(node)

    def _on_host(self, node: ChunkNode, slot: int) -> None:
        """``node``'s KV now sits in host slot ``slot``; with write-through it heads on to SSD."""
        self.tree.set_host(node, slot)
        if self.ssd is not None and self.ssd.write_through:
            self.ssd.persist(node, self._lookahead_predicate())

    def _demote_and_free(self, node: ChunkNode) -> None:
        """Device eviction with a host tier: copy the chunk to host memory first (unless
        it is already there), then free its device slots."""
        if not node.on_host:
            slot = self._alloc_host_slot()
            if slot is None:
                self.stats.dropped_chunks += 1
            else:
                self._copy_chunks(Direction.DEVICE_TO_HOST, node.device_value, [slot])
                self._on_host(node, slot)
                self.stats.demoted_chunks += 1
        self._free_device_slots(node)

    def _read_from_ssd(self, suffix: list[ChunkNode],
                       late: set[ChunkNode]) -> tuple[int, set[ChunkNode], Optional[ChunkNode]]:
        """Bring the SSD-only chunks of ``suffix`` (in chain order) into host memory.

        ``late`` holds the request's chunks found in flight by this or an earlier match;
        it gains the ones found in flight now and loses the ones that have landed since.

        Returns how many leading chunks of ``suffix`` are now host-resident, which of
        them came from SSD, and the chunk whose record failed to read (to be dropped once
        the chain is unlocked), if any.
        """
        from_ssd: set[ChunkNode] = set()
        ssd = self.ssd
        for index, node in enumerate(suffix):
            if node.on_host:
                if ssd is not None and ssd.note_used(node):
                    from_ssd.add(node)  # prefetched from SSD before this request ran
                    late.discard(node)  # an earlier match found it in flight: in time after all
                continue
            if ssd is None or not node.on_ssd:
                return index, from_ssd, None
            if ssd.prefetching(node):
                late.add(node)
            outcome = ssd.load_into_host(node, self._alloc_host_slot)
            if outcome != "ok":
                return index, from_ssd, node if outcome == "bad" else None
            from_ssd.add(node)
        return len(suffix), from_ssd, None

    def _drop_bad_records(self) -> None:
        """Forget chunks whose SSD record failed to read (the store deleted the file)."""
        assert self.ssd is not None
        for node in self.ssd.take_bad_records():
            if node.parent is None or not node.on_ssd:
                continue
            if node.lock_ref:  # in a chain being loaded: retried at the next step
                self.ssd.retry_bad_later(node)
                continue
            self.tree.drop_ssd(node, on_drop_host=self._free_host_slot, on_drop_ssd=self.ssd.delete_record)

    def _load_back(self, nodes: list[ChunkNode], num_on_device: int,
                   late: set[ChunkNode]) -> Optional[_LoadBack]:
        """Copy the tail ``nodes[num_on_device:]`` back to the device, as far as device
        slots can be had, reading SSD-only chunks into host memory first.

        The whole chain is locked meanwhile, so making room on the device or in host
        memory can evict neither its device part nor the host copies being read.
        """
        suffix = nodes[num_on_device:]
        allocator = self.token_to_kv_pool_allocator
        self.tree.lock(nodes[-1])
        failed: Optional[ChunkNode] = None
        try:
            readable, from_ssd, failed = self._read_from_ssd(suffix, late)
            suffix = suffix[:readable]
            if not suffix:
                return None
            want = len(suffix) * self.chunk_size
            shortfall = want - allocator.available_size()
            if shortfall > 0:
                self.evict(EvictParams(num_tokens=shortfall))
            fits = min(len(suffix), allocator.available_size() // self.chunk_size)
            if fits == 0:
                return None
            slots = allocator.alloc(fits * self.chunk_size)
            if slots is None:
                return None
            loading = suffix[:fits]
            host_slots = [n.host_slot for n in loading]
            if self.layerwise.loads:
                # The forward's layer i waits for layer i of this copy. Until it settles,
                # freeing these chunks' device or host slots settles it first (see
                # _settle_if_loading); locking them instead would hide them from the
                # scheduler's evictable budget, which it computed before this match.
                assert self._transfers is not None
                self._loading.update(loading)
                self._transfers.submit_load(
                    slots, host_slots,
                    on_settled=lambda nodes=tuple(loading): self._loading.difference_update(nodes))
                self._count_bytes(Direction.HOST_TO_DEVICE, fits)
            else:
                self._copy_chunks(Direction.HOST_TO_DEVICE, slots, host_slots)
            for node, chunk_slots in zip(loading, slots.to(torch.int64).split(self.chunk_size)):
                self.tree.set_device(node, chunk_slots.clone())
            ssd_chunks = sum(1 for n in loading if n in from_ssd)
            self.stats.host_hit_chunks += fits - ssd_chunks
            return _LoadBack(loading[-1], ssd_chunks)
        finally:
            self.tree.unlock(nodes[-1])
            if failed is not None:
                # Its record is gone or bad: forget it (and what only it made reachable).
                self._drop_bad_records()

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        return self.tree.evictable_chunks * self.chunk_size

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def protected_size(self) -> int:
        return self.tree.locked_chunks * self.chunk_size

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        """Device tokens the tree holds (host copies are reported separately)."""
        return self.tree.device_chunks * self.chunk_size

    def all_values_flatten(self) -> torch.Tensor:
        values = [n.device_value for n in self.tree.iter_nodes() if n.on_device]
        return torch.cat(values) if values else self._empty_indices

    def report(self, check_invariants: bool = False) -> dict[str, Any]:
        """PCR's state for ``/server_info``: tree size, locks, counters, pool occupancy.

        ``check_invariants`` walks the whole tree to verify its bookkeeping (O(tree));
        it is for tests and debugging, not for scraping at a high rate.
        """
        invariant_error: Optional[str] = None
        if check_invariants:
            try:
                self.tree.check_invariants()
            except AssertionError as e:  # reported, never raised into the scheduler
                invariant_error = f"{type(e).__name__}: {e}"
                logger.error("PCR tree invariant violated: %s", invariant_error)
        tree_stats = self.tree.stats()
        allocator = self.token_to_kv_pool_allocator
        return {
            "chunk_size": self.chunk_size,
            "lookahead_window": self.lookahead.window,
            "lookahead_protected_chunks": len(self.lookahead),
            "namespace": asdict(self.namespace),
            "tree": asdict(tree_stats),
            "cached_tokens": self.total_size(),
            "host_cached_tokens": self.tree.host_chunks * self.chunk_size,
            "device_pool_tokens": int(getattr(allocator, "size", 0)),
            "device_pool_free_tokens": int(allocator.available_size()),
            "host_pool_slots": self.host_pool.layout.num_slots if self.host_pool else 0,
            "host_pool_free_slots": self.host_pool.num_free if self.host_pool else 0,
            # Slots of new chunks being offloaded that no tree node owns yet.
            "host_pool_offload_slots": sum(map(len, self._pending_offloads.values()))
            + len(self._orphaned_host_slots),
            # Slots the I/O process is filling from SSD (owned by no node until it is done).
            "host_pool_io_slots": self.ssd.io_slots if self.ssd is not None else 0,
            "layerwise": self.layerwise.value,
            "ssd": self.ssd.report() if self.ssd is not None else None,
            "host_pool_bytes": self.host_pool.layout.total_bytes if self.host_pool else 0,
            "counters": asdict(self.stats),
            "invariants": {"checked": check_invariants, "ok": invariant_error is None,
                           "error": invariant_error},
        }

    def pretty_print(self) -> None:
        stats = self.tree.stats()
        print(
            f"PCR chunk tree: {stats.num_chunks} chunks of {self.chunk_size} tokens, "
            f"{stats.locked_chunks} locked, {stats.evictable_leaves} evictable leaves"
        )
