"""PCRPrefixCache: SGLang's tree-cache interface (``BasePrefixCache``) over PCR's cache state.

SGLang hands a tree cache the request's token ids and its row of KV slot indices; this
class cuts them into chunks and keeps the allocator's books: a device slot belongs
either to the tree (a whole chunk) or to a request (its uncached tail and the partial
last chunk), never to both, and is freed exactly once. The request-side protocol
(``checkpoint``, locks, ``cache_protected_len``) mirrors SGLang's ``RadixCache``, and host
hits follow HiCache's: :meth:`match_prefix` only looks (it reports the device prefix and
the host-resident continuation as ``host_hit_length``), and the continuation is copied
to the device in :meth:`init_load_back`, which SGLang calls for an admitted request
under its memory budget. Residency lives in :class:`~pcr_sglang.core.CacheState`; the
scheduler loop's work in :class:`~pcr_sglang.sglang_adapter.scheduler_side.SchedulerSide`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    CacheRequestHandle,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.keys import CacheNamespace, RequestTenant
from pcr_sglang.core.residency import CacheState
from pcr_sglang.req import request_tenant
from pcr_sglang.sglang_adapter.kv_events import PCRKvEvents
from pcr_sglang.sglang_adapter.metrics import PCRMetrics
from pcr_sglang.sglang_adapter.report import build_report
from pcr_sglang.sglang_adapter.scheduler_side import SchedulerSide
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.kept_namespaces import KeptNamespaces
from pcr_sglang.tiers.ssd_store import ChunkFileStore

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

logger = logging.getLogger(__name__)


def radix_key_tenant(key: RadixKey) -> RequestTenant:
    """The tenant of a key SGLang passes without its request: its ``extra_key`` whole."""
    return RequestTenant(extra_key=key.extra_key, cache_salt=key.cache_salt)


class PCRPrefixCache(BasePrefixCache):  # type: ignore[misc]  # SGLang ships no types: its base is Any
    """A chunk-granular prefix cache on SGLang's device KV pool, with host and SSD tiers."""

    def __init__(
        self,
        params: CacheInitParams,
        state: CacheState,
        scheduler: SchedulerSide,
        *,
        namespace: Optional[CacheNamespace] = None,
        host_pool: Optional[HostChunkPool] = None,
        store: Optional[ChunkFileStore] = None,
        kv_events: Optional[PCRKvEvents] = None,
    ):
        if params.is_eagle:
            raise ValueError("--enable-pcr does not support speculative decoding yet")
        self.disable = False
        self.is_eagle = False
        self.state = state
        self.scheduler = scheduler
        self.namespace = namespace
        self.host_pool = host_pool  # kept for its lifetime and /server_info
        self.store = store
        self.chunk_size = state.chunk_size
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        device = getattr(self.token_to_kv_pool_allocator, "device", "cpu")
        self.device = torch.device(device) if isinstance(device, (str, torch.device)) else torch.device("cpu")
        self._empty_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.metrics: Optional[PCRMetrics] = None
        # SGLang's KV cache events (--kv-events-config), on the publishing rank only.
        self.kv_events: Optional[PCRKvEvents] = kv_events
        # The weights changed in place: the namespace the next reset moves the cache to
        # (``sglang_adapter/weight_updates``), and the factory's function that moves it.
        self.pending_namespace: Optional[CacheNamespace] = None
        self.namespace_mover: Optional[Callable[[PCRPrefixCache, CacheNamespace], None]] = None
        self.weights_identity: Any = None  # what a new checkpoint's fingerprint is computed from
        # The SSD tier's namespaces left at weight updates and kept for a rollback (factory).
        self.ssd_namespaces: Optional[KeptNamespaces] = None
        if params.enable_metrics:
            self.init_metrics_collector()
            self.metrics = PCRMetrics(self.metrics_collector.labels)

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        pending, self.pending_namespace = self.pending_namespace, None
        # mutant: weight-update-flush-restores-the-old-weights-records
        if pending is not None and self.namespace_mover is not None:
            self.namespace_mover(self, pending)  # resets too, keeping nothing of the old weights
        else:
            self.scheduler.reset()

    @property
    def root_node(self) -> ChunkNode:
        return self.state.tree.root

    def supports_prefix_sharing(self) -> bool:
        return True

    def on_scheduler_step(self, waiting_queue: Sequence[Req], busy: bool = True) -> None:
        """Before each scheduling pass (the plugin's hook on ``get_next_batch_to_run``)."""
        self.scheduler.step(waiting_queue, busy)
        if self.metrics is not None:
            scheduler = self.scheduler
            docs = scheduler.doc_status  # None without document reuse
            gate = docs.server.gate if docs is not None else None  # --pcr-doc-reuse-calibration
            self.metrics.sync(
                self.state,
                docs.stats if docs is not None else None,
                scheduler.hints.stats,
                scheduler.probes.stats if scheduler.probes.enabled else None,
                scheduler.io.remote_status if scheduler.probes.enabled and scheduler.io is not None else None,
                calibration_overrides=gate.overrides if gate is not None else None,
            )

    def supports_fast_match_prefix(self) -> bool:
        # A match hashes the prompt chunk by chunk (BLAKE2b) up to its first miss: cheap,
        # but not free enough to match the whole waiting queue every pass under FCFS.
        return False

    # ------------------------------------------------------------------ match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """What is cached for ``params.key``, without moving anything: the device prefix,
        and the host-resident continuation (loaded only if the request is admitted)."""
        key: RadixKey = params.key
        tokens = key.raw_token_ids()
        device_node = host_node = self.root_node
        host_chunks = 0
        if len(tokens) >= self.chunk_size:
            tenant = request_tenant(params.req) if params.req is not None else radix_key_tenant(key)
            match = self.state.match(self.scheduler.keyer.iter_request_keys(tokens, tenant))
            if self.kv_events is not None:
                self.kv_events.learn(match.nodes, tokens, key.cache_salt)
            device_node = match.nodes[match.device - 1] if match.device else self.root_node
            host_node = match.nodes[match.device + match.host - 1] if match.host else device_node
            host_chunks = match.host
        doc_tokens = 0
        if params.req is not None:
            # Documents reused past the exact prefix come in through init_load_back too.
            plan = self.scheduler.docs.plan(params.req, tokens, host_node.depth * self.chunk_size)
            doc_tokens = plan.prefix_tokens if plan is not None else 0
        return self._result(device_node, host_node, host_chunks, doc_tokens)

    def _result(
        self, device_node: ChunkNode, host_node: ChunkNode, host_chunks: int, doc_tokens: int = 0
    ) -> MatchResult:
        return MatchResult(
            device_prefix_len=device_node.depth * self.chunk_size,
            last_device_node=device_node,
            last_host_node=host_node,
            best_match_node=host_node,
            host_hit_length=host_chunks * self.chunk_size + doc_tokens,
            full_kv_hit_length=host_node.depth * self.chunk_size + doc_tokens,
        )

    def touch_prefix(self, key: RadixKey) -> None:
        """LRU order only. The key comes without its request, so a LoRA request's adapter
        is not apart from its ``extra_key`` here: such a touch finds nothing of the
        adapter's chains (the look-ahead window, fed the requests, keeps them warm)."""
        self.state.tree.match(self.scheduler.keyer.iter_request_keys(key.raw_token_ids(), radix_key_tenant(key)))

    def init_load_back(self, params: InitLoadBackParams) -> Optional[tuple[int, Any]]:
        """Admission: copy the host hit to the device (all of it, or none: then 0)."""
        return self.scheduler.admission.load_back(params.req, params.best_match_node, params.host_hit_length)

    def load_back_is_cache_owned(self) -> bool:
        """Asked right after :meth:`init_load_back`: a host hit is the tree's, but reused
        documents' slots are the request's (the load set ``cache_protected_len`` itself)."""
        return not self.scheduler.admission.last_load_private

    def path_device_indices(self, node: ChunkNode) -> torch.Tensor:
        values = [n.device_value for n in node.path_from_root()]
        return torch.cat(values) if values else self._empty_indices

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        """The tree path of the request's match, then the private slots its reused
        documents were copied into (as SGLang's LMCache integration appends its loads)."""
        path = self.path_device_indices(req.last_node)
        private = self.scheduler.docs.private_slots(req.rid)
        if private is not None and len(path) < req.prefix_len:
            path = torch.cat([path, private.to(path.device)])
        assert len(path) >= req.prefix_len, (req.rid, len(path), req.prefix_len)
        return path[: req.prefix_len]

    # ------------------------------------------------------------------ insert
    def insert(self, params: InsertParams) -> InsertResult:
        """Insert whole chunks of ``params.key`` with slots ``params.value``.

        Returns the length that was already cached: the caller still owns (and must
        free) its slots for that part, as with SGLang's ``RadixCache.insert``. A key comes
        without its request, so its ``extra_key`` is keyed whole (PCR's own inserts go
        through :meth:`checkpoint`, which keys the request's adapter apart).
        """
        return self._insert(params.key.raw_token_ids(), params.value, radix_key_tenant(params.key))

    def _insert(self, tokens: Any, value: Optional[torch.Tensor], tenant: RequestTenant) -> InsertResult:
        num_chunks = len(tokens) // self.chunk_size
        if num_chunks == 0:
            return InsertResult(prefix_len=0, last_device_node=self.root_node)
        if value is None:
            raise ValueError("PCRPrefixCache.insert needs the KV slot indices (params.value)")
        values = value[: num_chunks * self.chunk_size].to(dtype=torch.int64, copy=True)
        keys = self.scheduler.keyer.request_keys(tokens[: num_chunks * self.chunk_size], tenant)
        outcome = self.state.insert(keys, list(torch.split(values, self.chunk_size)))
        if self.kv_events is not None:
            self.kv_events.learn(outcome.nodes, tokens, tenant.cache_salt)
        return InsertResult(
            prefix_len=outcome.num_existing * self.chunk_size,
            total_len=num_chunks * self.chunk_size,
            last_device_node=outcome.last_node,
        )

    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        """Hand the request's whole chunks in ``[0, up_to)`` to the tree.

        Chunks another request cached meanwhile are deduplicated: the request's own
        copies are freed and its row is repointed at the tree's slots. A request admitted
        before the weights last changed in place (``flush_cache: false``) inserts nothing. The partial last
        chunk stays the request's; ``cache_protected_len`` marks where the tree's part
        ends, so SGLang's ``release_kv_cache`` frees the rest. Chunks offloaded to host
        memory during their forward become host-resident too.
        """
        # mutant: update-without-flush-keys-old-kv-anew
        if self.scheduler.computed_before_an_update(req.rid):
            return  # its KV is partly the old weights' (an update without flush): it stays its own
        kv = req.kv
        exact_end = self.scheduler.docs.exact_end(req.rid)
        if exact_end is not None:  # blended KV (reused documents and all after them) stays out
            up_to = min(up_to, exact_end)
        token_ids = req.full_untruncated_fill_ids[:up_to]
        aligned_len = len(token_ids) // self.chunk_size * self.chunk_size
        if aligned_len <= kv.cache_protected_len:
            return
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :aligned_len]
        result = self._insert(token_ids[:aligned_len], row, request_tenant(req))
        kv.cache_inserted_len = max(kv.cache_inserted_len, aligned_len)
        if result.prefix_len > kv.cache_protected_len:  # our duplicates of chunks the tree had
            self.state.note_duplicates((result.prefix_len - kv.cache_protected_len) // self.chunk_size)
            self._free_device(row[kv.cache_protected_len : result.prefix_len].clone(), kv.cache_protected_len)
        new_last_node: ChunkNode = result.last_device_node
        tree_indices = self.path_device_indices(new_last_node)
        assert len(tree_indices) == aligned_len, (len(tree_indices), aligned_len)
        self.req_to_token_pool.write(
            (kv.req_pool_idx, slice(kv.cache_protected_len, aligned_len)),
            tree_indices[kv.cache_protected_len :].to(row.dtype),
        )
        self.scheduler.adopt_offloads(
            req.rid,
            new_last_node.path_from_root(),
            kv.cache_protected_len // self.chunk_size,
            result.prefix_len // self.chunk_size,
            aligned_len // self.chunk_size,
        )
        kv.cache_protected_len = aligned_len
        self.unlock(req.lock)
        req.lock = self.lock(new_last_node)
        req.last_node = new_last_node

    def _free_device(self, slots: torch.Tensor, start_pos: int) -> None:
        self.scheduler.executor.fence_before_reuse()  # no copy may still touch them
        self.token_to_kv_pool_allocator.free_segment(slots, start_pos=start_pos)

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        self.scheduler.executor.fence_before_reuse()
        super().free_kv_row(kv, ranges)

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        self.scheduler.release(req.rid)

    def release_aborted_request(self, handle: CacheRequestHandle) -> None:
        self.scheduler.release(handle.rid, row_released=False)

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: ChunkNode) -> IncLockRefResult:
        return IncLockRefResult(delta=-self.state.lock(node) * self.chunk_size)

    def dec_lock_ref(self, node: ChunkNode, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        return DecLockRefResult(delta=self.state.unlock(node) * self.chunk_size)

    # ------------------------------------------------------------------ eviction and sizes
    def evict(self, params: EvictParams) -> EvictResult:
        if params.num_tokens <= 0:
            return EvictResult()
        start = time.perf_counter()
        evicted = self.scheduler.executor.evict(params.num_tokens)
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    def evictable_size(self) -> int:
        return self.state.tree.evictable_chunks * self.chunk_size

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def protected_size(self) -> int:
        """Device tokens locked by running requests (host- and SSD-only locked chunks hold
        no device slot)."""
        return self.state.tree.locked_device_chunks * self.chunk_size

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        """Device tokens the tree holds (host and SSD copies are reported separately)."""
        return self.state.tree.device_chunks * self.chunk_size

    def all_values_flatten(self) -> torch.Tensor:
        values = [n.device_value for n in self.state.tree.iter_nodes() if n.on_device]
        return torch.cat(values) if values else self._empty_indices

    def report(self, check_invariants: bool = False) -> dict[str, Any]:
        """PCR's state for ``/server_info`` (see :func:`~pcr_sglang.sglang_adapter.report.build_report`)."""
        return build_report(self, check_invariants)

    def pretty_print(self) -> None:
        stats = self.state.tree.stats()
        print(
            f"PCR chunk tree: {stats.num_chunks} chunks of {self.chunk_size} tokens, "
            f"{stats.locked_chunks} locked, {stats.evictable_leaves} evictable leaves"
        )


def pcr_cache_of(owner: Any) -> Optional[PCRPrefixCache]:
    """``owner``'s tree cache if it is PCR's (a scheduler, batch or adder), else None."""
    cache = getattr(owner, "tree_cache", None)
    return cache if isinstance(cache, PCRPrefixCache) else None
