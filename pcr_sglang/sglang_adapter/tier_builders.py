"""The two persistent tiers' builders, over the KV pool SGLang built: the host pool
(``--pcr-dram-gb``: one slot per chunk, laid out from the pool's per-layer K and V rows) and
the SSD store (``--pcr-ssd-gb`` under ``--pcr-ssd-path``). Each refuses, with a
:class:`~pcr_sglang.config.PCRConfigError` naming the flag, a pool or a disk it cannot
serve; the factory builds them on every rank and agrees on the outcome."""

from __future__ import annotations

import atexit
import logging
from typing import Any

import torch

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.core import CacheNamespace
from pcr_sglang.tiers.host_pool import HostChunkPool, HostPoolError
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.ssd_store import ChunkFileStore, describe_namespace
from pcr_sglang.tiers.store_dir import SSDStoreError

logger = logging.getLogger(__name__)


def _row_bytes(buffers: Any) -> int:
    """Bytes of one token's row in a token-major, contiguous per-layer KV buffer."""
    if not isinstance(buffers, (list, tuple)) or not buffers:
        raise PCRConfigError("--pcr-dram-gb needs a KV pool with one buffer per layer")
    first: torch.Tensor = buffers[0]
    if any(not b.is_contiguous() or b.shape != first.shape for b in buffers):
        raise PCRConfigError("--pcr-dram-gb needs contiguous, equally shaped per-layer KV buffers")
    return first[0].numel() * first.element_size()


_SCALE_BUFFERS = ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer")


def build_host_pool(config: PCRConfig, allocator: Any) -> HostChunkPool:
    # The user-facing refusals happen at flag resolution (refusals); these are the
    # second line, on the pool SGLang actually built.
    kvcache = allocator.get_kvcache()
    k_buffers = getattr(kvcache, "k_buffer", None)
    v_buffers = getattr(kvcache, "v_buffer", None)
    if k_buffers is None or v_buffers is None:
        raise PCRConfigError(
            f"--pcr-dram-gb supports separate K and V pools (MHA/GQA); {type(kvcache).__name__} has not"
        )
    scales = [name for name in _SCALE_BUFFERS if getattr(kvcache, name, None) is not None]
    if scales:
        raise PCRConfigError(
            f"--pcr-dram-gb copies only k_buffer and v_buffer; this KV pool also keeps {', '.join(scales)} "
            f"(--kv-cache-dtype {getattr(kvcache, 'dtype', '?')}): drop --pcr-dram-gb or use an unscaled KV dtype"
        )
    layout = getattr(kvcache, "kv_cache_layout", "nhd")
    if layout != "nhd":
        raise PCRConfigError(f"--pcr-dram-gb copies token-major (NHD) KV rows; this KV pool's layout is {layout}")
    row_bytes = _row_bytes(k_buffers)
    if _row_bytes(v_buffers) != row_bytes or len(v_buffers) != len(k_buffers):
        raise PCRConfigError("--pcr-dram-gb needs K and V rows of the same size")
    per_slot = HostChunkLayout(1, len(k_buffers), config.chunk_size, row_bytes).slot_bytes
    num_slots = config.dram_bytes // per_slot
    if num_slots == 0:
        raise PCRConfigError(
            f"--pcr-dram-gb {config.dram_gb} holds no chunk: one chunk of this model needs {per_slot / 2**20:.1f} MiB"
        )
    layout = HostChunkLayout(num_slots, len(k_buffers), config.chunk_size, row_bytes)
    try:
        pool = HostChunkPool(layout)
    except HostPoolError as e:
        raise PCRConfigError(f"--pcr-dram-gb {config.dram_gb}: {e}") from e
    atexit.register(pool.close)
    logger.info(
        "PCR host tier: %d chunk slots, %.2f GiB in shared memory %s%s",
        num_slots,
        layout.total_bytes / 2**30,
        pool.info().shm_name,
        " (pinned)" if pool.pinned else "",
    )
    return pool


def build_ssd_store(
    config: PCRConfig, namespace: CacheNamespace, host_pool: HostChunkPool, kept_bytes: int = 0
) -> ChunkFileStore:
    """The SSD store of ``namespace``, within ``--pcr-ssd-gb`` less ``kept_bytes`` (the
    namespaces kept for a rollback, charged to the same budget) and the disk's free space."""
    assert config.ssd_path is not None
    layout = host_pool.layout
    try:
        store = ChunkFileStore(
            # mutant: ssd-kept-namespaces-not-charged
            config.ssd_path,
            namespace.digest(),
            layout,
            namespace.kv_dtype,
            max(config.ssd_bytes - kept_bytes, 0),
            namespace_description=describe_namespace(namespace, layout),
            low_watermark_bytes=int(config.ssd_reserve_gb * (1 << 30)),
            durability=config.ssd_durability,
        )
    except SSDStoreError as e:
        raise PCRConfigError(str(e)) from e
    if store.capacity_chunks == 0:
        store.close()
        raise PCRConfigError(
            f"--pcr-ssd-gb {config.ssd_gb} under {config.ssd_path} holds no chunk (one needs "
            f"{store.record_bytes / 2**20:.1f} MiB, and the disk must keep its free-space reserve"
            + (f"; {kept_bytes / 2**30:.2f} GiB go to namespaces kept for a rollback" if kept_bytes else "")
            + ")"
        )
    atexit.register(store.close)  # the writer lease (the I/O process holds it too)
    logger.info(
        "PCR SSD tier: up to %d chunks (%.2f GiB) in %s, writer slot %s, durability %s",
        store.capacity_chunks,
        store.capacity_bytes / 2**30,
        store.dir,
        store.slot,
        store.durability,
    )
    return store
