"""The SSD store's record checks: whether one chunk file may be served, and the CLI's ``verify``.

A record is served only if it verifies: a regular file owned by this user, of the record's
exact length, whose header parses and names the key asked for, and whose payload passes
its MAC. A read that fails a check drops the record (:meth:`ChunkFileStore._drop_corrupt`
decides whose it is to delete) and the cache recomputes the chunk, so a crash, another user
or another deployment can cost a recompute, never wrong KV. Kept apart from
:mod:`.ssd_store`'s writes, deletes and bookkeeping: this is the one place that decides
what counts as a good record. The rules and why: docs/ssd-store.md#on-disk-format.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from pcr_sglang.tiers.records import HEADER_BYTES, RecordCodec, read_full
from pcr_sglang.tiers.store_dir import SUFFIX


@dataclass
class VerifyReport:
    """The CLI's ``verify``: records that check out, and why each other one does not."""

    ok: int = 0
    bad: list[str] = field(default_factory=list)


class CheckedStore(Protocol):
    """What the checks use of a :class:`~pcr_sglang.tiers.ssd_store.ChunkFileStore` (a
    Protocol: the store imports the checks, never the reverse)."""

    codec: RecordCodec
    record_bytes: int

    def _chunk_files(self, *, own_only: bool = False) -> Iterator[Path]: ...

    def _read_error(self, path: Path, e: OSError) -> bool: ...

    def _drop_corrupt(self, path: Path, why: str) -> bool: ...


def read_record(store: CheckedStore, path: Path, key: bytes, out: memoryview) -> bool:
    """Read the record at ``path`` into ``out`` if it verifies as chunk ``key``'s; False
    when it is missing, unreadable (counted) or fails a check (dropped by the store)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError as e:
        return store._read_error(path, e)
    try:
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return store._drop_corrupt(path, f"owned by uid {st.st_uid}, not by this user")
            if st.st_size != store.record_bytes:
                return store._drop_corrupt(path, "wrong length")
            header = bytearray(HEADER_BYTES)
            if read_full(f, memoryview(header)) != HEADER_BYTES:
                return store._drop_corrupt(path, "wrong length")
            record = store.codec.parse_header(bytes(header))
            if record is None or record.key != key:
                return store._drop_corrupt(path, "bad header")
            if read_full(f, out) != record.payload_bytes or f.read(1):
                return store._drop_corrupt(path, "wrong payload length")
    except OSError as e:
        return store._read_error(path, e)
    if not store.codec.payload_ok(record, out):
        return store._drop_corrupt(path, "payload fails authentication")
    return True


def verify_store(store: CheckedStore) -> VerifyReport:
    """Read every record of the namespace in full and check it; deletes none."""
    report = VerifyReport()
    for path in store._chunk_files():
        try:
            st = path.lstat()
            data = path.read_bytes()
        except OSError as e:
            report.bad.append(f"{path.name}: {e}")
            continue
        record = store.codec.parse_header(data[:HEADER_BYTES])
        payload = data[HEADER_BYTES:]
        if st.st_uid != os.geteuid():
            report.bad.append(f"{path.name}: owned by uid {st.st_uid}")
        elif record is None or path.name != f"{record.key.hex()}{SUFFIX}":
            report.bad.append(f"{path.name}: bad header")
        elif not store.codec.payload_ok(record, payload):
            report.bad.append(f"{path.name}: payload fails authentication")
        else:
            report.ok += 1
    return report
