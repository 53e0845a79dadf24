"""Build the PCR tree cache from SGLang's tree-cache build context: the tiers (built by
``tier_builders``), the cache state, the I/O process, the scheduler and worker sides, and
(with tensor parallelism) the startup agreement between ranks on host-tier size, SSD
capacity and restored chunks."""

from __future__ import annotations

import atexit
import logging
from typing import TYPE_CHECKING, Any, Optional

import msgspec

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.core import CacheNamespace, CacheState, CacheStateConfig, PersistedChunk
from pcr_sglang.flags import flag_value
from pcr_sglang.io.protocol import IoProcessConfig
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.reuse import settings as reuse_settings
from pcr_sglang.reuse.setup import attach_doc_reuse
from pcr_sglang.sglang_adapter.fingerprint import IN_MEMORY_UPDATE_TAG, adapters_text, cache_namespace
from pcr_sglang.sglang_adapter.kv_events import PCRKvEvents
from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache
from pcr_sglang.sglang_adapter.refusals import collect_inputs, permuted_row_flags, unsupported_reasons
from pcr_sglang.sglang_adapter.remote_follow import RemoteFollower, io_config_under
from pcr_sglang.sglang_adapter.scheduler_side import SchedulerSide
from pcr_sglang.sglang_adapter.tier_builders import build_host_pool as build_host_pool
from pcr_sglang.sglang_adapter.tier_builders import build_ssd_store as build_ssd_store
from pcr_sglang.sglang_adapter.tp_group import TpGroup, min_max
from pcr_sglang.sglang_adapter.weight_updates import WeightsIdentity
from pcr_sglang.sglang_adapter.worker_side import attach_worker_side
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.kept_namespaces import KeptNamespaces
from pcr_sglang.tiers.ssd_store import ChunkFileStore

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)


def _kv_dtype_name(ctx: TreeCacheBuildContext) -> str:
    allocator = ctx.params.token_to_kv_pool_allocator
    get_kvcache = getattr(allocator, "get_kvcache", None)
    dtype = getattr(get_kvcache(), "dtype", None) if get_kvcache else None
    return str(dtype if dtype is not None else ctx.server_args.kv_cache_dtype)


def build_pcr_prefix_cache(ctx: TreeCacheBuildContext) -> PCRPrefixCache:
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:  # refused at resolution already (refusals)
        raise ValueError(
            "--enable-pcr supports models whose layers all use full attention; this model "
            "has sliding-window, state-space or sparse layers. Run it without --enable-pcr."
        )
    config = PCRConfig.from_server_args(ctx.server_args)
    config.validate(ctx.params.page_size)
    reuse_settings.validate(config)
    # Second line behind the refusals at flag resolution, on the model config and flags
    # this process builds the cache for.
    from sglang.srt.arg_groups.overrides import resolving_view

    resolved = resolving_view(ctx.server_args)
    reasons = unsupported_reasons(collect_inputs(resolved, config, ctx.model_config, weights_loaded=True))
    if reasons:
        raise PCRConfigError("; ".join(reasons))
    namespace = cache_namespace(
        ctx.server_args, ctx.model_config, _kv_dtype_name(ctx), config.chunk_size, ctx.tp_rank, ctx.tp_size
    )
    cache = assemble_pcr_cache(ctx.params, config, namespace, TpGroup.from_cache_params(ctx.params), ctx.tp_rank)
    if cache.scheduler.engine is not None:  # --pcr-debug-checks: transfer slots checked on the device too
        cache.scheduler.engine.debug_checks = bool(flag_value(ctx.server_args, "pcr_debug_checks"))
    cache.weights_identity = WeightsIdentity(
        ctx.model_config,
        ctx.server_args.model_path,
        getattr(ctx.server_args, "revision", None),
        getattr(ctx.server_args, "download_dir", None),
        adapters_text(ctx.server_args),
    )
    try:
        cache.scheduler.docs = attach_doc_reuse(
            config,
            cache.state,
            cache.scheduler,
            ctx.params.token_to_kv_pool_allocator,
            ctx.tp_worker,
            ctx.model_config.hf_config,
            tp_size=ctx.tp_size,
            row_flags_problem=permuted_row_flags(resolved),
            model_fingerprint=namespace.model_fingerprint,
        )
    except BaseException:
        cache.scheduler.close()
        raise
    return cache


def assemble_pcr_cache(
    params: Any, config: PCRConfig, namespace: CacheNamespace, tp: Optional[TpGroup] = None, tp_rank: int = 0
) -> PCRPrefixCache:
    """The tiers, the cache state, the I/O process and both sides, over SGLang's pools."""
    # Chunk keys (and so restore, eviction ties and every prefix length) derive from the
    # namespace: each rank fingerprints the weights it reads, and they must agree.
    _check_same_on_every_rank(
        tp, "the model fingerprint (the weights each rank reads)", int.from_bytes(namespace.chain_digest()[:7], "big")
    )
    allocator = params.token_to_kv_pool_allocator
    host_pool = store = worker = io = None
    if config.dram_bytes > 0:
        host_pool = _on_every_rank(tp, lambda: build_host_pool(config, allocator))
        _check_same_on_every_rank(tp, "host-tier slots (--pcr-dram-gb)", host_pool.layout.num_slots)
        worker = attach_worker_side(allocator, host_pool.buffer, host_pool.layout, config.layerwise)
    capacity = 0
    if config.ssd_bytes > 0:
        assert host_pool is not None  # validate() requires the host tier
        store = _on_every_rank(tp, lambda: build_ssd_store(config, namespace, host_pool))
        capacity = _agreed_capacity(store, tp)
    state = CacheState(
        CacheStateConfig(
            chunk_size=config.chunk_size,
            lookahead_window=config.lookahead_window,
            host_slots=host_pool.layout.num_slots if host_pool is not None else 0,
            chunk_bytes=host_pool.layout.slot_bytes if host_pool is not None else 0,
            ssd_capacity_chunks=capacity,
            write_through=config.ssd_write == "through",
            prefetch_budget_chunks=max((config.prefetch_budget_mb << 20) // store.record_bytes, 1) if store else 0,
            hint_budget_chunks=max((config.hint_budget_mb << 20) // store.record_bytes, 1)
            if store and config.hint_budget_mb > 0
            else 0,
        )
    )
    # Attached before the restore: chunks found on SSD are announced once their tokens are known.
    kv_events = PCRKvEvents(state.tree, config.chunk_size) if getattr(params, "enable_kv_cache_events", False) else None
    remote = None
    if store is not None:
        assert host_pool is not None  # the SSD tier needs the host tier (above)
        _restore(state, store, tp)
        remote = config.remote_settings()
        io = start_io_process(
            store,
            host_pool,
            tp_rank,
            remote.to_json() if remote is not None else "",
            read_threads=config.ssd_read_threads,
        )
    scheduler = SchedulerSide(
        state, config, namespace.chain_digest(), allocator, worker=worker, io=io, tp=tp, remote=remote
    )
    cache = PCRPrefixCache(
        params, state, scheduler, namespace=namespace, host_pool=host_pool, store=store, kv_events=kv_events
    )
    cache.namespace_mover = move_namespace
    cache.remote_follower = RemoteFollower.of(scheduler)  # no remote tier under an in-memory update's namespace
    if store is not None:
        cache.ssd_namespaces = KeptNamespaces(store.root)
    if io is not None:
        # Registered after the host pool's close, so it runs first: the I/O process is
        # gone before the slots it reads and writes are unmapped.
        atexit.register(scheduler.close)
    logger.info(
        "Tree cache initialized: source=pcr impl=%s, chunk_size=%d, lookahead_window=%d, namespace=%s%s",
        type(cache).__name__,
        config.chunk_size,
        config.lookahead_window,
        namespace,
        f", TP group of {tp.size}" if tp is not None else "",
    )
    return cache


def _on_every_rank(tp: Optional[TpGroup], build: Any) -> Any:
    """``build()``, agreed: if it fails on any rank, every rank raises (none is left waiting
    in the next startup collective)."""
    try:
        built, error = build(), None
    except PCRConfigError as e:
        built, error = None, e
    if tp is not None and tp.reduce_min([0 if error else 1])[0] == 0 and error is None:
        error = PCRConfigError("PCR: another TP rank failed to set up its tiers (see its log)")
    if error is not None:
        raise error
    return built


def _check_same_on_every_rank(tp: Optional[TpGroup], what: str, value: int) -> None:
    if tp is None:
        return
    low, high = min_max(tp, value)
    if low != high:
        raise PCRConfigError(f"PCR: the TP ranks disagree on {what}: {low} to {high}; they must be equal")


def _agreed_capacity(store: ChunkFileStore, tp: Optional[TpGroup]) -> int:
    """The SSD tier's capacity in chunks, the smallest rank's (free disk space may differ
    between the ranks' disks)."""
    return tp.reduce_min([store.capacity_chunks])[0] if tp is not None else store.capacity_chunks


def _store_fields(store: ChunkFileStore) -> dict[str, Any]:
    """What the I/O process's config says about the store it serves."""
    return dict(
        store_root=str(store.root),
        namespace_hex=store.namespace.hex(),
        dtype=store.dtype,
        reserve_bytes=store.low_watermark_bytes,
        writer_slot=store.slot or "",
        lease_fd=store.lease_fd,
        durability=store.durability,
    )


def _restore(state: CacheState, store: ChunkFileStore, tp: Optional[TpGroup]) -> None:
    """Rebuild the tree's SSD level from the store (ours, adopted and live peers'
    records): with TP, only chunks every rank has. Deletes touch only our own slot."""
    records = store.scan()
    keys = {r.key for r in records}
    common = tp.intersect(keys) if tp is not None else keys
    unreachable = state.restore(PersistedChunk(r.key, r.parent_key, r.depth) for r in records if r.key in common)
    for key in unreachable + [k for k in keys if k not in common]:
        store.delete(key)  # at startup or a namespace move: the scheduler's only own disk work besides the scan
    restored = state.ssd_stats.restored_chunks
    if restored or unreachable or len(common) < len(keys):
        logger.info(
            "PCR SSD tier: restored %d chunks from %s (%d unreachable records and %d not on every TP rank deleted)",
            restored,
            store.dir,
            len(unreachable),
            len(keys) - len(common),
        )


def start_io_process(
    store: ChunkFileStore, host_pool: HostChunkPool, tp_rank: int, remote_config: str, read_threads: int
) -> IOSupervisor:
    layout = host_pool.layout
    io = IOSupervisor(
        IoProcessConfig(
            **_store_fields(store),
            num_slots=layout.num_slots,
            num_layers=layout.num_layers,
            chunk_size=layout.chunk_size,
            row_bytes=layout.row_bytes,
            shm_name=host_pool.info().shm_name,
            orders_endpoint="",
            replies_endpoint="",
            parent_pid=0,
            tp_rank=tp_rank,
            remote_config=remote_config,
            read_threads=read_threads,
        )
    )
    if not io.wait_ready():
        logger.warning("PCR I/O process did not start; the SSD tier waits for its restart")
    return io


def move_namespace(cache: PCRPrefixCache, namespace: CacheNamespace) -> None:
    """Serve under ``namespace`` from now on: the weights changed in place
    (``/update_weights_from_*``). Called from the cache's reset, on every TP rank in the
    same order, with SGLang's scheduler idle.

    Every chunk is forgotten, persisted ones too (they hold the old weights' KV), chunk
    keys are derived from the new namespace (so the remote tier, whose object names fold
    the key in, never answers with the old weights' objects either), and the SSD tier moves
    to the new namespace's directory: the records found there (the same checkpoint served
    before: a rollback) are restored, the old directory is kept for a later rollback, unless
    it belonged to an in-memory update, whose weights no server can ever have again (it is
    purged). At most ``--pcr-ssd-keep-namespaces`` left namespaces are kept, within half of
    ``--pcr-ssd-gb``, oldest purged first, and the new store gets the budget they leave
    (:mod:`pcr_sglang.tiers.kept_namespaces`). If the new store cannot be opened the server
    keeps running with the SSD tier's writes off (``/server_info``'s ``ssd.tier``, the
    ``sglang:pcr_ssd_tier_up`` gauge); nothing of the old namespace is read again either way."""
    scheduler, old_store, old = cache.scheduler, cache.store, cache.namespace
    tp = scheduler.tp
    scheduler.rekey(namespace.chain_digest())
    scheduler.reset(keep_persisted=False)
    cache.namespace = namespace
    if old_store is None:
        logger.info("PCR: the weights changed; chunk keys now derive from namespace %s", namespace)
        return
    assert cache.host_pool is not None and scheduler.io is not None
    config, kept = scheduler.config, cache.ssd_namespaces
    assert kept is not None  # built with the store
    in_memory = old is not None and old.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)
    room = kept.make_room(
        None if in_memory else old_store.namespace.hex(),
        namespace.digest().hex(),
        keep=config.ssd_keep_namespaces,
        budget_bytes=config.ssd_bytes,
    )
    try:
        store = _on_every_rank(tp, lambda: build_ssd_store(config, namespace, cache.host_pool, room.charged_bytes))
    except PCRConfigError as e:
        logger.error(
            "PCR: the weights changed, but the SSD store of the new namespace cannot be opened (%s); "
            "serving on with SSD writes off (nothing of the old weights is read)",
            e,
        )
        kept.writes_off_reason = f"the SSD store of namespace {namespace.digest().hex()} cannot be opened: {e}"
        scheduler.state.stop_writes()
        return
    scheduler.state.resize_ssd(_agreed_capacity(store, tp))
    _restore(scheduler.state, store, tp)
    if not scheduler.io.restart(
        io_config_under(cache, namespace, msgspec.structs.replace(scheduler.io.config, **_store_fields(store)))
    ):
        logger.warning("PCR I/O process did not start on the new namespace; the SSD tier waits for its restart")
    cache.store = store
    old_store.close()
    left = old_store.namespace.hex()
    if in_memory:  # a peer server that uses it after all keeps it (a warning)
        kept.purge_left(left, "(the previous in-memory weights', which no server can have again)")
    elif room.purge_leaving:
        kept.purge_left(left, "(the namespace just left) to stay within --pcr-ssd-keep-namespaces and --pcr-ssd-gb")
    elif left != store.namespace.hex():
        kept.left(left)
    logger.info(
        "PCR: the weights changed; the cache now serves namespace %s (SSD tier %s, %d chunks restored)",
        namespace,
        store.dir,
        scheduler.state.ssd_stats.restored_chunks,
    )
