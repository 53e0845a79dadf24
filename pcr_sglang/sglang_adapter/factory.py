"""Build the PCR tree cache from SGLang's tree-cache build context."""

from __future__ import annotations

import atexit
import logging
from typing import TYPE_CHECKING, Any

import torch

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.core import CacheNamespace
from pcr_sglang.sglang_adapter.fingerprint import model_fingerprint
from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache
from pcr_sglang.tiers.host_pool import HostChunkPool, HostPoolError
from pcr_sglang.tiers.ssd_store import ChunkFileStore, SSDStoreError, describe_namespace
from pcr_sglang.transfer.layout import HostChunkLayout

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)


def _kv_dtype_name(ctx: TreeCacheBuildContext) -> str:
    allocator = ctx.params.token_to_kv_pool_allocator
    get_kvcache = getattr(allocator, "get_kvcache", None)
    dtype = getattr(get_kvcache(), "dtype", None) if get_kvcache else None
    return str(dtype if dtype is not None else ctx.server_args.kv_cache_dtype)


def _row_bytes(buffers: Any) -> int:
    """Bytes of one token's row in a token-major, contiguous per-layer KV buffer."""
    if not isinstance(buffers, (list, tuple)) or not buffers:
        raise PCRConfigError("--pcr-dram-gb needs a KV pool with one buffer per layer")
    first: torch.Tensor = buffers[0]
    if any(not b.is_contiguous() or b.shape != first.shape for b in buffers):
        raise PCRConfigError("--pcr-dram-gb needs contiguous, equally shaped per-layer KV buffers")
    return first[0].numel() * first.element_size()


def build_host_pool(config: PCRConfig, allocator: Any) -> HostChunkPool:
    kvcache = allocator.get_kvcache()
    k_buffers = getattr(kvcache, "k_buffer", None)
    v_buffers = getattr(kvcache, "v_buffer", None)
    if k_buffers is None or v_buffers is None:
        raise PCRConfigError(
            f"--pcr-dram-gb supports separate K and V pools (MHA/GQA); {type(kvcache).__name__} has not"
        )
    row_bytes = _row_bytes(k_buffers)
    if _row_bytes(v_buffers) != row_bytes or len(v_buffers) != len(k_buffers):
        raise PCRConfigError("--pcr-dram-gb needs K and V rows of the same size")
    per_slot = HostChunkLayout(1, len(k_buffers), config.chunk_size, row_bytes).slot_bytes
    num_slots = config.dram_bytes // per_slot
    if num_slots == 0:
        raise PCRConfigError(
            f"--pcr-dram-gb {config.dram_gb} holds no chunk: one chunk of this model needs "
            f"{per_slot / 2**20:.1f} MiB"
        )
    layout = HostChunkLayout(num_slots, len(k_buffers), config.chunk_size, row_bytes)
    try:
        pool = HostChunkPool(layout)
    except HostPoolError as e:
        raise PCRConfigError(f"--pcr-dram-gb {config.dram_gb}: {e}") from e
    atexit.register(pool.close)
    logger.info(
        "PCR host tier: %d chunk slots, %.2f GiB in shared memory %s%s",
        num_slots, layout.total_bytes / 2**30, pool.info().shm_name, " (pinned)" if pool.pinned else "",
    )
    return pool


def build_ssd_store(config: PCRConfig, namespace: CacheNamespace, host_pool: HostChunkPool) -> ChunkFileStore:
    assert config.ssd_path is not None
    layout = host_pool.layout
    try:
        store = ChunkFileStore(
            config.ssd_path, namespace.digest(), layout, namespace.kv_dtype, config.ssd_bytes,
            namespace_description=describe_namespace(namespace, layout),
            low_watermark_bytes=int(config.ssd_reserve_gb * (1 << 30)),
        )
    except SSDStoreError as e:
        raise PCRConfigError(str(e)) from e
    if store.capacity_chunks == 0:
        raise PCRConfigError(
            f"--pcr-ssd-gb {config.ssd_gb} under {config.ssd_path} holds no chunk (one needs "
            f"{store.record_bytes / 2**20:.1f} MiB, and the disk must keep its free-space reserve)"
        )
    logger.info("PCR SSD tier: up to %d chunks (%.2f GiB) in %s", store.capacity_chunks,
                store.capacity_bytes / 2**30, store.dir)
    return store


def build_pcr_prefix_cache(ctx: TreeCacheBuildContext) -> PCRPrefixCache:
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        raise ValueError(
            "--enable-pcr supports models whose layers all use full attention; this model "
            "has sliding-window, state-space or sparse layers. Run it without --enable-pcr."
        )
    config = PCRConfig.from_server_args(ctx.server_args)
    namespace = CacheNamespace(
        model_fingerprint=model_fingerprint(
            ctx.model_config, ctx.server_args.model_path, ctx.server_args.revision
        ),
        kv_dtype=_kv_dtype_name(ctx),
        chunk_size=config.chunk_size,
        layout="token-major",
        tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size,
    )
    config.validate(ctx.params.page_size)
    host_pool = ssd_store = None
    if config.dram_bytes > 0:
        host_pool = build_host_pool(config, ctx.params.token_to_kv_pool_allocator)
    if config.ssd_bytes > 0:
        assert host_pool is not None  # validate() requires the host tier
        ssd_store = build_ssd_store(config, namespace, host_pool)
    cache = PCRPrefixCache(ctx.params, config, namespace, host_pool=host_pool, ssd_store=ssd_store)
    if cache.ssd is not None:
        # Registered after the host pool's close, so it runs first: writes finish while
        # the slots they read still exist.
        atexit.register(cache.ssd.close)
    logger.info("Tree cache initialized: source=pcr impl=%s", type(cache).__name__)
    return cache
