"""The I/O process's configuration as the unit tests build it by hand: over a host pool and
a store root, with no reserve and, unless given, no ZMQ endpoints and no parent to watch
(the supervisor fills those in); ``extra`` sets any other field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from pcr_sglang.io.protocol import IoProcessConfig
from pcr_sglang.tiers.host_pool import HostChunkPool


def io_config(
    pool: HostChunkPool, store_root: Union[str, Path], namespace_hex: str, dtype: str, **extra: Any
) -> IoProcessConfig:
    layout = pool.layout
    fields: dict[str, Any] = dict(
        store_root=str(store_root),
        namespace_hex=namespace_hex,
        dtype=dtype,
        num_slots=layout.num_slots,
        num_layers=layout.num_layers,
        chunk_size=layout.chunk_size,
        row_bytes=layout.row_bytes,
        reserve_bytes=0,
        shm_name=pool.info().shm_name,
        orders_endpoint="",
        replies_endpoint="",
        parent_pid=0,
    )
    return IoProcessConfig(**{**fields, **extra})
