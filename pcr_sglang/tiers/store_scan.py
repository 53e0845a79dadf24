"""The SSD store's start-up scan: what a server finds in its namespace when it opens it.

At start-up a server deletes the partial writes of its own writer slot, takes over the
slots of writers that are gone (a slot whose ``flock`` lease nobody holds: it deletes their
partial writes and adopts their records into its own slot), and lists every record whose
header verifies, its own first, then its live peers', so the cache can rebuild its tree
from disk. It is the one part of the store that runs once per start and modifies other
writers' slots, and the reason those must be dead is the lease; kept apart from
:mod:`.ssd_store`'s per-chunk writes, reads and deletes, whose private helpers (counters,
dropping a record that fails verification) it uses through :meth:`ChunkFileStore.scan`.
The directory layout and the sharing rules: docs/ssd-store.md#on-disk-format and
docs/ssd-store.md#sharing-a-store-directory.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Protocol

from pcr_sglang.tiers.fileops import FileOps
from pcr_sglang.tiers.records import HEADER_BYTES, ChunkRecord, RecordCodec, read_full
from pcr_sglang.tiers.store_dir import SUFFIX, TMP_SUFFIX, slot_dirs, subdirs, try_lease

logger = logging.getLogger(__name__)


class ScannedStore(Protocol):
    """What the scan uses of a :class:`~pcr_sglang.tiers.ssd_store.ChunkFileStore` (a
    Protocol: the store imports the scan, never the reverse)."""

    dir: Path
    ops: FileOps
    codec: RecordCodec
    record_bytes: int
    stats: Any  # the store's StoreStats
    _peers: list[Path]

    @property
    def own_dir(self) -> Path: ...

    def _unlink(self, path: Path) -> None: ...

    def _read_error(self, path: Path, e: OSError) -> bool: ...

    def _drop_corrupt(self, path: Path, why: str) -> bool: ...


def scan_store(store: ScannedStore) -> list[ChunkRecord]:
    """Adopt the records of dead writers (slots whose lease nobody holds) after deleting
    their partial writes, then return every record whose header verifies, ``store``'s own
    first, then live peers'. Payload MACs are checked on read. ``store`` is writable."""
    own = store.own_dir
    try:
        _discard_tmp(store, own)
    except OSError as e:  # a full or failing disk: serve what verifies, clean up next time
        logger.warning("PCR SSD store: cannot clean %s (%s)", own, e)
    for slot_dir in slot_dirs(store.dir):
        if slot_dir != own:
            try:
                fd = try_lease(slot_dir)
            except OSError as e:
                logger.warning("PCR SSD store: cannot check the lease of %s (%s)", slot_dir, e)
                continue
            if fd >= 0:
                try:
                    _discard_tmp(store, slot_dir)
                    _adopt(store, slot_dir)
                except OSError as e:
                    # What was not adopted stays in the dead slot, readable as a peer's
                    # records, for the next start to adopt.
                    logger.warning(
                        "PCR SSD store: adopting the records of %s failed (%s); they stay there, readable", slot_dir, e
                    )
                finally:
                    os.close(fd)
    store._peers = [d for d in slot_dirs(store.dir) if d != own]
    records: dict[bytes, ChunkRecord] = {}
    for slot_dir in [own] + store._peers:
        for record in _scan_slot(store, slot_dir):
            records.setdefault(record.key, record)
            if slot_dir != own:
                store.stats.peer_chunks += 1
    if store.stats.corrupt_chunks or store.stats.discarded_tmp_files or store.stats.adopted_chunks:
        logger.warning(
            "PCR SSD store %s: discarded %d records that failed verification and %d partial writes; "
            "adopted %d records of servers that are gone",
            store.dir,
            store.stats.corrupt_chunks,
            store.stats.discarded_tmp_files,
            store.stats.adopted_chunks,
        )
    return list(records.values())


def _discard_tmp(store: ScannedStore, slot_dir: Path) -> None:
    """Delete the temp files (writes a crash cut short) of a slot nobody else writes."""
    for sub in subdirs(slot_dir):
        for path in sub.iterdir():
            if path.name.endswith(TMP_SUFFIX):
                store._unlink(path)
                store.stats.discarded_tmp_files += 1


def _adopt(store: ScannedStore, dead: Path) -> None:
    """Move a dead writer's records into our slot: its lease is ours for the duration,
    and nothing else writes there. Each record is linked into our slot, our directories
    are synced, and only then is it unlinked from the dead slot: a crash midway leaves a
    record in both places at worst, never in neither (a cross-directory rename would
    need both directories' entries to persist together, which POSIX does not promise)."""
    own = store.own_dir
    touched_own, moved = set(), []
    for sub in subdirs(dead):
        for path in sub.iterdir():
            if path.suffix != SUFFIX:
                continue
            target_dir = own / sub.name
            if store.ops.mkdir(str(target_dir), 0o700):
                store.ops.fsync_dir(str(own))
            try:
                store.ops.link(str(path), str(target_dir / path.name))
                store.stats.adopted_chunks += 1
                touched_own.add(str(target_dir))
            except FileExistsError:
                pass  # we hold it already
            moved.append(path)
    for d in sorted(touched_own):
        store.ops.fsync_dir(d)
    for path in moved:
        store._unlink(path)
    for d in sorted({str(p.parent) for p in moved}):
        store.ops.fsync_dir(d)


def _scan_slot(store: ScannedStore, slot_dir: Path) -> Iterator[ChunkRecord]:
    """The records of one slot whose header verifies (owner, MAC, name, length); the
    others go to :meth:`ChunkFileStore._drop_corrupt`, which deletes only our own."""
    for sub in subdirs(slot_dir):
        try:
            paths = list(sub.iterdir())
        except OSError as e:
            store._read_error(sub, e)
            continue
        for path in paths:
            if path.suffix != SUFFIX:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue  # a live peer deleted it meanwhile
            except OSError as e:
                store._read_error(path, e)
                continue
            try:
                with open(fd, "rb", buffering=0) as f:
                    st = os.fstat(fd)
                    raw = bytearray(HEADER_BYTES)
                    n = read_full(f, memoryview(raw))
            except OSError as e:
                store._read_error(path, e)
                continue
            record = store.codec.parse_header(bytes(raw[:n]))
            if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                store._drop_corrupt(path, f"owned by uid {st.st_uid}, not by this user")
            elif record is None or path.name != f"{record.key.hex()}{SUFFIX}" or st.st_size != store.record_bytes:
                store._drop_corrupt(path, "fails verification on open")
            else:
                yield record
