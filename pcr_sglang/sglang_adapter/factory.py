"""Build the PCR tree cache from SGLang's tree-cache build context."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pcr_sglang.config import PCRConfig
from pcr_sglang.core import CacheNamespace
from pcr_sglang.sglang_adapter.fingerprint import model_fingerprint
from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)


def _kv_dtype_name(ctx: TreeCacheBuildContext) -> str:
    allocator = ctx.params.token_to_kv_pool_allocator
    get_kvcache = getattr(allocator, "get_kvcache", None)
    dtype = getattr(get_kvcache(), "dtype", None) if get_kvcache else None
    return str(dtype if dtype is not None else ctx.server_args.kv_cache_dtype)


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
    cache = PCRPrefixCache(ctx.params, config, namespace)
    logger.info("Tree cache initialized: source=pcr impl=%s", type(cache).__name__)
    return cache
