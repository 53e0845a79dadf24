"""ChunkFileStore: PCR's SSD tier, one file per chunk, authenticated, crash-safe, shareable.

Each chunk is a file in this server's writer slot of the namespace's directory: a header
with keyed MACs (:mod:`.records`), then the chunk's host-slot bytes. A record is written
to a temp name and renamed, fsynced as ``--pcr-ssd-durability`` asks, so it is visible
only once complete; it is served only if it verifies (owner, MACs, key, namespace,
layout, length), so a crash, another user or another deployment can cost a recompute,
never wrong KV. Several servers may share a directory: each writes and deletes only in
its own slot, and reads its peers'. The start-up scan (adopting dead writers' slots) is
in :mod:`.store_scan`, the checks a record passes before it is served in :mod:`.store_verify`,
the directory's access rules and leases in :mod:`.store_dir`, opening a namespace's
directory (its key, ``namespace.json``, the writer slot) in :mod:`.store_namespace`. The
file layout, the rules and why: docs/ssd-store.md#on-disk-format.

This module knows nothing of SGLang or the tree: the cache decides what to write, read
and delete; the store moves bytes and keeps them honest.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from pcr_sglang.tiers.fileops import FileOps
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import HEADER_BYTES, ChunkRecord, RecordCodec
from pcr_sglang.tiers.store_dir import (
    NAMESPACE_FILE,
    SUFFIX,
    TMP_SUFFIX,
    SSDStoreError,
    namespace_dir,
    slot_dirs,
    subdirs,
    unlink_quiet,
)
from pcr_sglang.tiers.store_namespace import describe_namespace as describe_namespace  # importable here too
from pcr_sglang.tiers.store_namespace import open_namespace
from pcr_sglang.tiers.store_scan import scan_store
from pcr_sglang.tiers.store_verify import VerifyReport, read_record, verify_store

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

logger = logging.getLogger(__name__)

DURABILITY_CHOICES = ("record", "batch", "none")


@dataclass
class StoreStats:
    """What this process's store did since it opened (``/server_info``'s SSD ``store``)."""

    written_chunks: int = 0
    written_bytes: int = 0
    read_chunks: int = 0
    read_bytes: int = 0
    deleted_chunks: int = 0
    corrupt_chunks: int = 0  # records that failed verification (deleted, never used)
    read_errors: int = 0  # I/O errors on read (the chunk is dropped and recomputed)
    write_errors: int = 0  # ENOSPC/EIO and friends on write
    discarded_tmp_files: int = 0  # partial writes of a crashed process, deleted on open
    adopted_chunks: int = 0  # records of dead writers moved into our slot at startup
    peer_chunks: int = 0  # records of live peers found at startup (readable, never deleted)


@dataclass
class _Pending:
    """A batch-mode record written to its temp file, not yet synced and renamed."""

    key: bytes
    fd: int
    tmp: Path
    final: Path


class ChunkFileStore:
    """The chunk files of one namespace under ``root``, within ``capacity_bytes``.

    ``slot`` None and ``read_only`` False: take a writer lease (a server's scheduler).
    ``slot="w3"``: write into that slot, whose lease the caller's parent holds (the I/O
    process). ``read_only``: no slot, no writes (the ``python -m pcr_tools.store_cli`` tools).

    Threads: :meth:`read_into` may run on several threads at once (the I/O process's
    readers; its ``stats`` counts are then approximate), beside one thread that does
    everything else and never writes or deletes a key while it is being read.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace_digest: bytes,
        layout: HostChunkLayout,
        dtype: str,
        capacity_bytes: Optional[int],
        *,
        namespace_description: Optional[dict[str, Any]] = None,
        low_watermark_bytes: int = 1 << 30,
        durability: str = "record",
        slot: Optional[str] = None,
        read_only: bool = False,
        fileops: Optional[FileOps] = None,
    ) -> None:
        if len(namespace_digest) != 16:
            raise ValueError("namespace digest must be 16 bytes")
        if durability not in DURABILITY_CHOICES:
            raise SSDStoreError(
                f"--pcr-ssd-durability must be one of {', '.join(DURABILITY_CHOICES)}, got {durability!r}"
            )
        self.root = Path(root)
        self.namespace = namespace_digest
        self.layout = layout
        self.dtype = dtype
        self.durability = durability
        self.read_only = read_only
        self.ops = fileops or FileOps()
        self.low_watermark_bytes = low_watermark_bytes
        self.dir = self.root / namespace_digest.hex()
        self.record_bytes = HEADER_BYTES + layout.slot_bytes
        self.stats = StoreStats()
        self.slot: Optional[str] = None
        self.lease_fd = -1
        self._pending: list[_Pending] = []
        self._token = secrets.token_hex(4)
        self._counter = 0
        self._peers: list[Path] = []
        self._prepare(namespace_description or {}, slot)
        # None: this process only executes orders (the I/O process); the owner sizes the store.
        self.capacity_bytes = 0 if capacity_bytes is None else self._fit_capacity(capacity_bytes)

    # ------------------------------------------------------------------ setup
    def _prepare(self, description: dict[str, Any], slot: Optional[str]) -> None:
        self._key, self.slot, self.lease_fd = open_namespace(
            self.root,
            self.dir,
            self.ops,
            dtype=self.dtype,
            description=description,
            slot=slot,
            read_only=self.read_only,
        )
        self.codec = RecordCodec(self._key, self.namespace, self.layout, self.dtype)

    @property
    def own_dir(self) -> Path:
        assert self.slot is not None
        return self.dir / self.slot

    def close(self) -> None:
        """Give up the lease (the I/O process keeps it while it lives)."""
        for p in self._pending:
            self.ops.close(p.fd)
            unlink_quiet(p.tmp)
        self._pending = []
        if self.lease_fd >= 0:
            os.close(self.lease_fd)
            self.lease_fd = -1

    def _fit_capacity(self, requested: int) -> int:
        # Only our own slot's files can be freed by our eviction: a live peer's never are.
        free = self.free_disk_bytes() + self.used_bytes_on_disk(own_only=True)
        usable = max(free - self.low_watermark_bytes, 0)
        if requested > usable:
            logger.warning(
                "--pcr-ssd-gb asks for %.2f GiB but %s has %.2f GiB usable (free space above a "
                "%.2f GiB reserve, plus this store's files): using %.2f GiB",
                requested / 2**30,
                self.root,
                usable / 2**30,
                self.low_watermark_bytes / 2**30,
                usable / 2**30,
            )
            return usable
        return requested

    def free_disk_bytes(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def used_bytes_on_disk(self, *, own_only: bool = False) -> int:
        total = 0
        for p in self._chunk_files(own_only=own_only):
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total

    @property
    def capacity_chunks(self) -> int:
        return self.capacity_bytes // self.record_bytes

    def _path(self, key: bytes, slot_dir: Optional[Path] = None) -> Path:
        text = key.hex()
        return (slot_dir or self.own_dir) / text[:2] / f"{text}{SUFFIX}"

    def _chunk_files(self, *, own_only: bool = False) -> Iterator[Path]:
        dirs = ([self.own_dir] if self.slot is not None else []) if own_only else slot_dirs(self.dir)
        for slot_dir in dirs:
            for sub in subdirs(slot_dir):
                yield from (p for p in sub.iterdir() if p.suffix == SUFFIX)

    # ------------------------------------------------------------------ records
    def _check_writable(self) -> None:
        if self.slot is None:
            raise SSDStoreError(f"{self.dir} is open read-only")

    def write(self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, payload: ReadableBuffer) -> None:
        """Persist one chunk into our slot, complete before it is visible; with ``record``
        durability also durable when this returns (``batch``: after :meth:`flush`).
        Raises OSError (ENOSPC when the store would cross the disk's low watermark)."""
        self._check_writable()
        payload = memoryview(payload).cast("B")
        if len(payload) != self.layout.slot_bytes:
            raise ValueError(f"payload is {len(payload)} bytes, a chunk is {self.layout.slot_bytes}")
        if self.free_disk_bytes() - self.record_bytes < self.low_watermark_bytes:
            self.stats.write_errors += 1
            raise OSError(errno.ENOSPC, "free space below the store's low watermark", str(self.dir))
        final = self._path(key)
        self._counter += 1
        tmp = final.with_name(f"{key.hex()}.{self.slot}-{self._token}-{self._counter}{TMP_SUFFIX}")
        fd = -1
        try:
            if self.ops.mkdir(str(final.parent), 0o700) and self.durability != "none":
                self.ops.fsync_dir(str(self.own_dir))  # the new <key[:2]>/ entry itself
            self._drop_pending(key)
            fd = self.ops.create(str(tmp))
            self.ops.write_all(fd, self.codec.header(key, parent_key, depth, num_tokens, payload))
            self.ops.write_all(fd, payload)
            if self.durability == "batch":
                self._pending.append(_Pending(key, fd, tmp, final))
                return
            # mutant: store-record-write-without-fsync
            if self.durability == "record":
                self.ops.fsync(fd)
            self.ops.close(fd)
            fd = -1
            self.ops.rename(str(tmp), str(final))
            if self.durability == "record":
                self.ops.fsync_dir(str(final.parent))
        except OSError:
            self.stats.write_errors += 1
            if fd >= 0:
                self.ops.close(fd)
            unlink_quiet(tmp)
            raise
        self.stats.written_chunks += 1
        self.stats.written_bytes += self.record_bytes

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    def flush(self) -> list[bytes]:
        """``batch`` durability: fsync every pending record, rename them into place, fsync
        each directory once; returns their keys, durable now. Raises OSError after
        discarding the whole batch (the caller reports every write of it failed)."""
        pending, self._pending = self._pending, []
        dirs: set[str] = set()
        try:
            for i, p in enumerate(pending):
                self.ops.fsync(p.fd)
                self.ops.close(p.fd)
                p.fd = -1
                self.ops.rename(str(p.tmp), str(p.final))
                dirs.add(str(p.final.parent))
            for d in sorted(dirs):
                self.ops.fsync_dir(d)
        except OSError:
            self.stats.write_errors += len(pending)
            for p in pending:
                if p.fd >= 0:
                    self.ops.close(p.fd)
                unlink_quiet(p.tmp)
            raise
        self.stats.written_chunks += len(pending)
        self.stats.written_bytes += len(pending) * self.record_bytes
        return [p.key for p in pending]

    def _drop_pending(self, key: bytes) -> None:
        for p in [p for p in self._pending if p.key == key]:
            self._pending.remove(p)
            self.ops.close(p.fd)
            unlink_quiet(p.tmp)

    def read_into(self, key: bytes, out: WriteableBuffer) -> bool:
        """Read chunk ``key``'s payload into ``out`` (a writable buffer of one host slot),
        from our slot or a peer's.

        Returns False when it is missing, unreadable, or fails verification (owner, MAC,
        key, namespace, layout, length); a record that fails verification is deleted. The
        caller then recomputes the chunk. ``out`` may hold partial bytes after a failure.
        """
        out = memoryview(out).cast("B")
        tried: set[Path] = set()
        for refresh in (False, True):
            if refresh:
                self._peers = [d for d in slot_dirs(self.dir) if d != self._own_or_none()]
            dirs = ([self.own_dir] if self.slot is not None else []) + self._peers
            for slot_dir in dirs:
                if slot_dir in tried:
                    continue
                tried.add(slot_dir)
                if read_record(self, self._path(key, slot_dir), key, out):
                    self.stats.read_chunks += 1
                    self.stats.read_bytes += self.record_bytes
                    return True
        return False

    def _own_or_none(self) -> Optional[Path]:
        return self.own_dir if self.slot is not None else None

    def _read_error(self, path: Path, e: OSError) -> bool:
        self.stats.read_errors += 1
        logger.warning("PCR SSD store: reading %s failed (%s); the chunk will be recomputed", path, e)
        return False

    def _drop_corrupt(self, path: Path, why: str) -> bool:
        """A record that fails verification serves no one: deleted if it is in our slot.
        In a live peer's slot it is left to the peer: the name checked may already hold
        the peer's rewrite of it (we verified an inode, an unlink goes by name)."""
        self.stats.corrupt_chunks += 1
        ours = not self.read_only and self.slot is not None and path.parent.parent == self.own_dir
        logger.warning(
            "PCR SSD store: %s: %s; %s, the chunk will be recomputed",
            path.name,
            why,
            "deleted" if ours else "left to the writer that owns it",
        )
        if ours:
            self._unlink(path)
        return False

    def _unlink(self, path: Path) -> None:
        try:
            self.ops.unlink(str(path))
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("PCR SSD store: cannot delete %s: %s", path, e)

    def delete(self, key: bytes) -> None:
        """Drop chunk ``key`` from our slot (a peer's copy is the peer's to keep)."""
        self._check_writable()
        self._drop_pending(key)
        self._unlink(self._path(key))
        self.stats.deleted_chunks += 1

    # ------------------------------------------------------------------ open / scan
    def scan(self) -> list[ChunkRecord]:
        """At startup: adopt the records of dead writers (slots whose lease nobody holds)
        after deleting their partial writes, then return every record whose header
        verifies, ours first, then live peers'. Payload MACs are checked on read."""
        self._check_writable()
        return scan_store(self)

    def verify(self) -> VerifyReport:
        """Read every record in full and check it (the CLI's ``verify``); deletes none."""
        return verify_store(self)


# ---------------------------------------------------------------------- directory tools
def namespace_store(root: str | os.PathLike[str], digest_hex: str) -> ChunkFileStore:
    """Open an existing namespace of a store directory, read-only, with its layout."""
    ns_dir = namespace_dir(root, digest_hex)
    try:
        description = json.loads((ns_dir / NAMESPACE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise SSDStoreError(f"{ns_dir} is not a PCR store namespace: {e}") from e
    layout = HostChunkLayout(1, *(int(description[k]) for k in ("num_layers", "chunk_size", "row_bytes")))
    return ChunkFileStore(
        root,
        bytes.fromhex(digest_hex),
        layout,
        description["dtype"],
        capacity_bytes=0,
        namespace_description=description,
        low_watermark_bytes=0,
        read_only=True,
    )
