"""ChunkFileStore: PCR's SSD tier, one file per chunk, crash-consistent and checksummed.

Layout of a store directory::

    DIR/                                  0700
      <namespace digest hex>/             one per cache namespace (model, dtype, layout,
        namespace.json                    chunk size, TP rank): what the digest stands for
        <key hex[:2]>/<key hex>.chunk     0600: a header, then one host slot's bytes

Why one file per chunk rather than slabs of fixed-size records: a chunk is a large record
(every layer's K and V of ``chunk_size`` tokens: ~1.5 MiB for SmolLM2 with 32-token
chunks, ~32 MiB for Llama-3-8B with 256), so each read or write is already one large
sequential I/O and per-file costs (create, rename, unlink) are small beside it
(``bench/ssd_store_bench.py`` measures both layouts). In exchange the file system does
the allocation, a deleted chunk frees its space at once with no compaction, and crash
consistency is the classic write-to-temp, fsync, rename: a record becomes visible under
its final name only once it is complete and durable. A crash leaves at worst a ``.tmp``
file, which the next open deletes.

Nothing read is trusted: the header carries a magic, the format version, the chunk's key
and parent key, its depth, token count, namespace digest, layout and dtype, the payload
length and an XXH3-128 digest of the payload, and its own digest. (XXH3 rather than
BLAKE2b: these digests catch corruption, not forgery, and XXH3 hashes ~14 GB/s on one
core against BLAKE2b's ~0.7, which would cap reads far below an NVMe drive's speed.) A
record whose header does not verify is deleted when the store opens; a payload whose
digest does not match is deleted when read, and the read reports a miss (the chunk is
recomputed). Keys already
fold in the namespace and the request's cache salt, and the header's namespace is checked
too, so two servers or tenants sharing a directory never read each other's chunks.

This module knows nothing of SGLang or the tree: the cache decides what to write, read
and delete; the store moves bytes and keeps them honest.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import xxhash

from pcr_sglang.transfer.layout import HostChunkLayout

logger = logging.getLogger(__name__)

MAGIC = b"PCRCHUNK"
FORMAT_VERSION = 1
SUFFIX = ".chunk"
TMP_SUFFIX = ".tmp"
NAMESPACE_FILE = "namespace.json"
_DIGEST_BYTES = 16
# magic, version, header bytes, flags, key, parent key, namespace digest, depth,
# num tokens, num layers, chunk size, row bytes, dtype, payload bytes, payload digest
_FIELDS = struct.Struct("<8sHHI16s16s16sIIIII16sQ16s")
HEADER_BYTES = _FIELDS.size + _DIGEST_BYTES


class SSDStoreError(RuntimeError):
    """The store cannot be used as configured (bad path, permissions)."""


def _digest(data) -> bytes:
    return xxhash.xxh3_128(data).digest()


@dataclass(frozen=True)
class ChunkRecord:
    """A verified header: what the store knows of a chunk without reading its payload."""

    key: bytes
    parent_key: bytes
    depth: int
    num_tokens: int
    payload_bytes: int
    payload_digest: bytes


@dataclass
class StoreStats:
    written_chunks: int = 0
    written_bytes: int = 0
    read_chunks: int = 0
    read_bytes: int = 0
    deleted_chunks: int = 0
    corrupt_chunks: int = 0  # records that failed verification (deleted, never used)
    read_errors: int = 0  # I/O errors on read (the chunk is dropped and recomputed)
    write_errors: int = 0  # ENOSPC/EIO and friends on write
    discarded_tmp_files: int = 0  # partial writes of a crashed process, deleted on open


@dataclass(frozen=True)
class NamespaceUsage:
    digest_hex: str
    description: dict
    chunks: int
    bytes: int
    temp_files: int = 0


@dataclass
class VerifyReport:
    ok: int = 0
    bad: list[str] = field(default_factory=list)


class ChunkFileStore:
    """The chunk files of one namespace under ``root``, within ``capacity_bytes``."""

    def __init__(self, root: str | os.PathLike, namespace_digest: bytes, layout: HostChunkLayout,
                 dtype: str, capacity_bytes: Optional[int], *, namespace_description: Optional[dict] = None,
                 low_watermark_bytes: int = 1 << 30):
        if len(namespace_digest) != _DIGEST_BYTES:
            raise ValueError("namespace digest must be 16 bytes")
        self.root = Path(root)
        self.namespace = namespace_digest
        self.layout = layout
        self.dtype = dtype
        self._dtype_field = dtype.encode()[:16].ljust(16, b"\0")
        self.low_watermark_bytes = low_watermark_bytes
        self.dir = self.root / namespace_digest.hex()
        self.record_bytes = HEADER_BYTES + layout.slot_bytes
        self.stats = StoreStats()
        self._prepare_dirs(namespace_description or {})
        # None: this process only executes orders (the I/O process); the owner sizes the store.
        self.capacity_bytes = 0 if capacity_bytes is None else self._fit_capacity(capacity_bytes)

    # ------------------------------------------------------------------ setup
    def _prepare_dirs(self, description: dict) -> None:
        parent = self.root.parent
        if not self.root.exists() and not parent.is_dir():
            raise SSDStoreError(f"--pcr-ssd-path {self.root}: parent directory {parent} does not exist")
        try:
            self.root.mkdir(mode=0o700, exist_ok=True)
            os.chmod(self.root, 0o700)
            self.dir.mkdir(mode=0o700, exist_ok=True)
            probe = self.dir / f".probe-{os.getpid()}{TMP_SUFFIX}"
            with open(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(b"ok")
            probe.unlink()
        except OSError as e:
            raise SSDStoreError(f"--pcr-ssd-path {self.root} is not a writable directory: {e}") from e
        meta = self.dir / NAMESPACE_FILE
        if not meta.exists():
            self._atomic_write(meta, json.dumps({"format_version": FORMAT_VERSION, "dtype": self.dtype,
                                                 **description}, indent=1).encode())

    def _fit_capacity(self, requested: int) -> int:
        free = self.free_disk_bytes() + self.used_bytes_on_disk()
        usable = max(free - self.low_watermark_bytes, 0)
        if requested > usable:
            logger.warning(
                "--pcr-ssd-gb asks for %.2f GiB but %s has %.2f GiB usable (free space above a "
                "%.2f GiB reserve, plus this store's files): using %.2f GiB",
                requested / 2**30, self.root, usable / 2**30, self.low_watermark_bytes / 2**30, usable / 2**30,
            )
            return usable
        return requested

    def free_disk_bytes(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def used_bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self._chunk_files())

    @property
    def capacity_chunks(self) -> int:
        return self.capacity_bytes // self.record_bytes

    def _path(self, key: bytes) -> Path:
        text = key.hex()
        return self.dir / text[:2] / f"{text}{SUFFIX}"

    def _chunk_files(self) -> Iterator[Path]:
        for sub in self.dir.iterdir():
            if sub.is_dir():
                yield from (p for p in sub.iterdir() if p.suffix == SUFFIX)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _atomic_write(self, path: Path, data) -> None:
        tmp = path.with_name(path.name + f".{os.getpid()}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with open(fd, "wb", closefd=True) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        self._fsync_dir(path.parent)

    # ------------------------------------------------------------------ records
    def _header(self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, payload) -> bytes:
        fields = _FIELDS.pack(
            MAGIC, FORMAT_VERSION, HEADER_BYTES, 0, key, parent_key, self.namespace, depth, num_tokens,
            self.layout.num_layers, self.layout.chunk_size, self.layout.row_bytes, self._dtype_field,
            len(payload), _digest(payload),
        )
        return fields + _digest(fields)

    def _parse_header(self, raw: bytes) -> Optional[ChunkRecord]:
        """The record's header if it verifies and belongs to this namespace and layout."""
        if len(raw) < HEADER_BYTES or _digest(raw[: _FIELDS.size]) != raw[_FIELDS.size:HEADER_BYTES]:
            return None
        (magic, version, header_bytes, _flags, key, parent_key, namespace, depth, num_tokens, num_layers,
         chunk_size, row_bytes, dtype, payload_bytes, payload_digest) = _FIELDS.unpack_from(raw)
        if (magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES
                or namespace != self.namespace or dtype != self._dtype_field
                or (num_layers, chunk_size, row_bytes) != (self.layout.num_layers, self.layout.chunk_size,
                                                           self.layout.row_bytes)
                or payload_bytes != self.layout.slot_bytes or depth < 1):
            return None
        return ChunkRecord(key, parent_key, depth, num_tokens, payload_bytes, payload_digest)

    def write(self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, payload) -> None:
        """Persist one chunk: durable and complete before it is visible. Raises OSError
        (ENOSPC when the store would cross the disk's low watermark)."""
        payload = memoryview(payload).cast("B")
        if len(payload) != self.layout.slot_bytes:
            raise ValueError(f"payload is {len(payload)} bytes, a chunk is {self.layout.slot_bytes}")
        if self.free_disk_bytes() - self.record_bytes < self.low_watermark_bytes:
            self.stats.write_errors += 1
            raise OSError(errno.ENOSPC, "free space below the store's low watermark", str(self.dir))
        path = self._path(key)
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            self._atomic_write(path, self._header(key, parent_key, depth, num_tokens, payload) + payload)
        except OSError:
            self.stats.write_errors += 1
            raise
        self.stats.written_chunks += 1
        self.stats.written_bytes += self.record_bytes

    def read_into(self, key: bytes, out) -> bool:
        """Read chunk ``key``'s payload into ``out`` (a writable buffer of one host slot).

        Returns False, and deletes the record, when it is missing, unreadable, or fails
        verification (wrong key, namespace, layout, length or payload digest): the
        caller then recomputes the chunk. ``out`` may hold partial bytes after a failure.
        """
        out = memoryview(out).cast("B")
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                record = self._parse_header(f.read(HEADER_BYTES))
                if record is None or record.key != key:
                    return self._drop_corrupt(path, "bad header")
                n = f.readinto(out)
                if n != record.payload_bytes or f.read(1):
                    return self._drop_corrupt(path, "wrong payload length")
        except FileNotFoundError:
            return False
        except OSError as e:
            self.stats.read_errors += 1
            logger.warning("PCR SSD store: reading %s failed (%s); the chunk will be recomputed", path, e)
            self._unlink(path)
            return False
        if _digest(out) != record.payload_digest:
            return self._drop_corrupt(path, "payload checksum mismatch")
        self.stats.read_chunks += 1
        self.stats.read_bytes += self.record_bytes
        return True

    def _drop_corrupt(self, path: Path, why: str) -> bool:
        self.stats.corrupt_chunks += 1
        logger.warning("PCR SSD store: %s: %s; deleted, the chunk will be recomputed", path.name, why)
        self._unlink(path)
        return False

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("PCR SSD store: cannot delete %s: %s", path, e)

    def delete(self, key: bytes) -> None:
        self._unlink(self._path(key))
        self.stats.deleted_chunks += 1

    # ------------------------------------------------------------------ open / scan
    def scan(self) -> list[ChunkRecord]:
        """Every record whose header verifies, after deleting partial writes (``.tmp``)
        and records that fail verification. Payload digests are checked on read."""
        records: list[ChunkRecord] = []
        for sub in sorted(p for p in self.dir.iterdir() if p.is_dir()):
            for path in sub.iterdir():
                if path.name.endswith(TMP_SUFFIX):
                    self._unlink(path)
                    self.stats.discarded_tmp_files += 1
                    continue
                if path.suffix != SUFFIX:
                    continue
                try:
                    with open(path, "rb") as f:
                        raw = f.read(HEADER_BYTES)
                    size = path.stat().st_size
                except OSError as e:
                    self.stats.read_errors += 1
                    logger.warning("PCR SSD store: cannot read %s: %s", path, e)
                    continue
                record = self._parse_header(raw)
                if record is None or path.name != f"{record.key.hex()}{SUFFIX}" or size != self.record_bytes:
                    self._drop_corrupt(path, "fails verification on open")
                    continue
                records.append(record)
        if self.stats.corrupt_chunks or self.stats.discarded_tmp_files:
            logger.warning(
                "PCR SSD store %s: discarded %d records that failed verification and %d partial writes",
                self.dir, self.stats.corrupt_chunks, self.stats.discarded_tmp_files,
            )
        return records

    def verify(self) -> VerifyReport:
        """Read every record in full and check it (the CLI's ``verify``); deletes none."""
        report = VerifyReport()
        for path in self._chunk_files():
            try:
                data = path.read_bytes()
            except OSError as e:
                report.bad.append(f"{path.name}: {e}")
                continue
            record = self._parse_header(data[:HEADER_BYTES])
            payload = data[HEADER_BYTES:]
            if record is None or path.name != f"{record.key.hex()}{SUFFIX}":
                report.bad.append(f"{path.name}: bad header")
            elif len(payload) != record.payload_bytes or _digest(payload) != record.payload_digest:
                report.bad.append(f"{path.name}: payload does not match its checksum")
            else:
                report.ok += 1
        return report


# ---------------------------------------------------------------------- directory tools
def list_namespaces(root: str | os.PathLike) -> list[NamespaceUsage]:
    """Chunks and bytes per namespace under a store directory (the CLI's ``usage``)."""
    root = Path(root)
    usages = []
    for ns_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            description = json.loads((ns_dir / NAMESPACE_FILE).read_text())
        except (OSError, ValueError):
            description = {}
        chunks = size = temp = 0
        for sub in (p for p in ns_dir.iterdir() if p.is_dir()):
            for path in sub.iterdir():
                if path.suffix == SUFFIX:
                    chunks += 1
                    size += path.stat().st_size
                elif path.name.endswith(TMP_SUFFIX):
                    temp += 1
        usages.append(NamespaceUsage(ns_dir.name, description, chunks, size, temp))
    return usages


def namespace_store(root: str | os.PathLike, digest_hex: str) -> ChunkFileStore:
    """Open an existing namespace of a store directory with the layout it was written with."""
    ns_dir = Path(root) / digest_hex
    try:
        description = json.loads((ns_dir / NAMESPACE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise SSDStoreError(f"{ns_dir} is not a PCR store namespace: {e}") from e
    layout = HostChunkLayout(1, *(int(description[k]) for k in ("num_layers", "chunk_size", "row_bytes")))
    return ChunkFileStore(root, bytes.fromhex(digest_hex), layout, description["dtype"], capacity_bytes=0,
                          namespace_description=description, low_watermark_bytes=0)


def purge_namespace(root: str | os.PathLike, digest_hex: str) -> int:
    """Delete a namespace's directory; returns the chunk files removed."""
    ns_dir = Path(root) / digest_hex
    if not (ns_dir / NAMESPACE_FILE).exists():
        raise SSDStoreError(f"{ns_dir} is not a PCR store namespace")
    count = sum(1 for sub in ns_dir.iterdir() if sub.is_dir() for p in sub.iterdir() if p.suffix == SUFFIX)
    shutil.rmtree(ns_dir)
    return count


def describe_namespace(namespace: object, layout: HostChunkLayout) -> dict:
    """What ``namespace.json`` records: the namespace's fields and the record layout."""
    fields = asdict(namespace) if hasattr(namespace, "__dataclass_fields__") else {}
    return {**fields, "num_layers": layout.num_layers, "chunk_size": layout.chunk_size,
            "row_bytes": layout.row_bytes}
