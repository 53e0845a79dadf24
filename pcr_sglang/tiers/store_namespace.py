"""Opening a namespace's directory of the SSD store, and what its ``namespace.json`` says.

:class:`~pcr_sglang.tiers.ssd_store.ChunkFileStore` opens its namespace here: the store
root and the namespace directory are created if missing (each new entry fsynced into its
parent) and checked against the access rules of :mod:`.store_dir`; the namespace's MAC key
is loaded or made; ``namespace.json`` is written once, durably, so the command-line tools
can tell what a namespace holds; and a writer slot is leased, or the one the caller's
parent leased is checked. Kept apart from the store's record reads and writes: this runs
once, when the store opens.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

from pcr_sglang.tiers.fileops import FileOps
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import FORMAT_VERSION
from pcr_sglang.tiers.store_dir import (
    NAMESPACE_FILE,
    SLOT_RE,
    TMP_SUFFIX,
    SSDStoreError,
    check_store_root,
    load_key,
    owned_private_dir,
    take_slot,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def open_namespace(
    root: Path,
    ns_dir: Path,
    ops: FileOps,
    *,
    dtype: str,
    description: dict[str, Any],
    slot: Optional[str],
    read_only: bool,
) -> tuple[bytes, Optional[str], int]:
    """Prepare ``ns_dir`` (the namespace's directory under ``root``) for a store; returns
    its MAC key, the writer slot (None when ``read_only``) and the slot's lease descriptor
    (-1 when the lease is not ours to hold: read-only, or ``slot`` given by the caller).
    Raises :class:`SSDStoreError` when the directory cannot be used as configured."""
    parent = root.parent
    if not root.exists() and not parent.is_dir():
        raise SSDStoreError(f"--pcr-ssd-path {root}: parent directory {parent} does not exist")
    lease_fd = -1
    try:
        if not read_only and ops.mkdir(str(root), 0o700):
            ops.fsync_dir(str(parent))
        check_store_root(root)
        if not read_only and ops.mkdir(str(ns_dir), 0o700):
            ops.fsync_dir(str(root))
        owned_private_dir(ns_dir, "namespace directory")
        key = load_key(ns_dir, ops, create=not read_only)
        meta = ns_dir / NAMESPACE_FILE
        if not read_only and not meta.exists():
            write_durably(
                ops,
                meta,
                json.dumps({"format_version": FORMAT_VERSION, "dtype": dtype, **description}, indent=1).encode(),
            )
        if not read_only:
            if slot is None:
                slot, lease_fd = take_slot(ns_dir, ops)
            else:
                if not SLOT_RE.fullmatch(slot):
                    raise SSDStoreError(f"not a writer slot: {slot!r}")
                owned_private_dir(ns_dir / slot, "writer slot")
        else:
            slot = None
    except SSDStoreError:
        raise
    except OSError as e:
        raise SSDStoreError(f"--pcr-ssd-path {root} is not a writable directory: {e}") from e
    return key, slot, lease_fd


def write_durably(ops: FileOps, path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all, and durably: a temp file, fsynced, renamed into
    place, the directory fsynced."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}{TMP_SUFFIX}")
    fd = ops.create(str(tmp))
    try:
        ops.write_all(fd, data)
        ops.fsync(fd)
    finally:
        ops.close(fd)
    ops.rename(str(tmp), str(path))
    ops.fsync_dir(str(path.parent))


def describe_namespace(namespace: object, layout: HostChunkLayout) -> dict[str, Any]:
    """What ``namespace.json`` records: the namespace's fields and the record layout."""
    fields = asdict(cast("DataclassInstance", namespace)) if hasattr(namespace, "__dataclass_fields__") else {}
    return {**fields, "num_layers": layout.num_layers, "chunk_size": layout.chunk_size, "row_bytes": layout.row_bytes}
