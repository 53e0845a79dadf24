"""The store directory's access rules: who may use it, the per-namespace MAC key, and
the writer slots with their ``flock`` leases (the layout, and why: docs/ssd-store.md#on-disk-format).
Also the directory tools behind ``python -m pcr_tools.store_cli`` that need no records.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pcr_sglang.tiers.fileops import FileOps

logger = logging.getLogger(__name__)

SUFFIX = ".chunk"
TMP_SUFFIX = ".tmp"
NAMESPACE_FILE = "namespace.json"
KEY_FILE = "store.key"
LOCK_FILE = "lock"
KEY_BYTES = 32
SLOT_RE = re.compile(r"w\d+")
MAX_SLOTS = 4096


class SSDStoreError(RuntimeError):
    """The store cannot be used as configured (bad path, permissions)."""


@dataclass(frozen=True)
class NamespaceUsage:
    digest_hex: str
    description: dict[str, Any]  # namespace.json
    chunks: int
    bytes: int
    temp_files: int = 0
    live_writers: int = 0


def owned_private_dir(path: Path, what: str) -> None:
    """A directory of ours inside the store: a real directory (no symlink), owned by this
    user and writable by no one else. Never changed, only checked."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SSDStoreError(f"--pcr-ssd-path: {what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise SSDStoreError(
            f"--pcr-ssd-path: {what} {path} is owned by uid {st.st_uid}, not by this "
            f"user ({os.geteuid()}); use a directory of your own"
        )
    if st.st_mode & 0o022:
        raise SSDStoreError(
            f"--pcr-ssd-path: {what} {path} is writable by other users "
            f"(mode {stat.S_IMODE(st.st_mode):o}); PCR leaves it as it is: fix its mode "
            f"(chmod go-w) or use another directory"
        )


def check_store_root(root: Path) -> None:
    """The rule for an existing ``--pcr-ssd-path``: owned by us or root, and if group- or
    world-writable then sticky (other users can then add entries but not rename or
    delete ours; each entry we use is checked to be ours). Never changes its mode. A
    symbolic link as the root must be ours or root's too: in a sticky shared directory
    another user could otherwise point it elsewhere between our checks."""
    link = os.lstat(root)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
        raise SSDStoreError(
            f"--pcr-ssd-path {root} is a symbolic link owned by uid {link.st_uid}: it must be "
            f"owned by this user ({os.geteuid()}) or root"
        )
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise SSDStoreError(f"--pcr-ssd-path {root} is not a writable directory (not a directory)")
    if st.st_uid not in (os.geteuid(), 0):
        raise SSDStoreError(
            f"--pcr-ssd-path {root} is owned by uid {st.st_uid}: it must be owned by this user ({os.geteuid()}) or root"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise SSDStoreError(
            f"--pcr-ssd-path {root} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}) and not "
            "sticky: they could replace PCR's files. Use a directory only you can write (PCR creates a "
            "missing one 0700), or a sticky one such as /tmp; PCR never changes an existing directory's mode"
        )


def load_key(ns_dir: Path, ops: FileOps, *, create: bool) -> bytes:
    """The namespace's MAC key: created once (complete before it has its name: a temp
    file linked into place, so a racing server reads either nothing or the whole key)."""
    path = ns_dir / KEY_FILE
    if not path.exists() and create:
        tmp = ns_dir / f"{KEY_FILE}.{secrets.token_hex(8)}{TMP_SUFFIX}"
        fd = ops.create(str(tmp))
        try:
            ops.write_all(fd, secrets.token_bytes(KEY_BYTES))
            ops.fsync(fd)
        finally:
            ops.close(fd)
        try:
            ops.link(str(tmp), str(path))
        except FileExistsError:
            pass  # another server made it first: use theirs
        finally:
            ops.unlink(str(tmp))
        ops.fsync_dir(str(ns_dir))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SSDStoreError(f"{ns_dir} has no {KEY_FILE}: no server has written it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SSDStoreError(
                f"--pcr-ssd-path: {path} must be a file owned by this user ({os.geteuid()}) and readable by "
                f"no one else (it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); records it "
                "authenticated cannot be trusted: purge the namespace or use another directory"
            )
        key = b""
        while len(key) <= KEY_BYTES:  # a short read is legal (NFS, FUSE): read to the end
            more = os.read(fd, KEY_BYTES + 1 - len(key))
            if not more:
                break
            key += more
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise SSDStoreError(f"--pcr-ssd-path: {path} is not a {KEY_BYTES}-byte key")
    return key


def take_slot(ns_dir: Path, ops: FileOps) -> tuple[str, int]:
    """The first writer slot whose lease nobody holds, created if need be."""
    for i in range(MAX_SLOTS):
        name = f"w{i}"
        path = ns_dir / name
        if ops.mkdir(str(path), 0o700):
            ops.fsync_dir(str(ns_dir))
        try:
            owned_private_dir(path, "writer slot")
        except SSDStoreError as e:
            logger.warning("PCR SSD store: skipping %s", e)
            continue
        fd = try_lease(path)
        if fd >= 0:
            return name, fd
    raise SSDStoreError(f"--pcr-ssd-path {ns_dir.parent}: all {MAX_SLOTS} writer slots are in use")


def slot_dirs(ns_dir: Path) -> list[Path]:
    """Every writer slot of this namespace that is ours (others' are never read)."""
    slots = []
    for entry in sorted(os.scandir(ns_dir), key=lambda e: e.name):
        if SLOT_RE.fullmatch(entry.name):
            try:
                owned_private_dir(Path(entry.path), "writer slot")
            except (SSDStoreError, OSError):
                continue
            slots.append(Path(entry.path))
    return slots


def subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return []


def unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def try_lease(slot_dir: Path) -> int:
    """The slot's lease descriptor if nobody holds it, else -1."""
    fd = os.open(slot_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    except BaseException:
        os.close(fd)
        raise
    return fd


def list_namespaces(root: str | os.PathLike[str]) -> list[NamespaceUsage]:
    """Chunks and bytes per namespace under a store directory (the CLI's ``usage``)."""
    root = Path(root)
    usages = []
    for ns_dir in sorted(p for p in root.iterdir() if p.is_dir() and (p / NAMESPACE_FILE).exists()):
        try:
            description = json.loads((ns_dir / NAMESPACE_FILE).read_text())
        except (OSError, ValueError):
            description = {}
        chunks = size = temp = live = 0
        for slot_dir in (p for p in ns_dir.iterdir() if p.is_dir() and SLOT_RE.fullmatch(p.name)):
            fd = try_lease(slot_dir)
            if fd >= 0:
                os.close(fd)
            else:
                live += 1
            for sub in subdirs(slot_dir):
                for path in sub.iterdir():
                    if path.suffix == SUFFIX:
                        chunks += 1
                        size += path.stat().st_size
                    elif path.name.endswith(TMP_SUFFIX):
                        temp += 1
        usages.append(NamespaceUsage(ns_dir.name, description, chunks, size, temp, live))
    return usages


def namespace_dir(root: str | os.PathLike[str], digest_hex: str) -> Path:
    if not re.fullmatch(r"[0-9a-f]{32}", digest_hex):
        raise SSDStoreError(f"{digest_hex!r} is not a namespace digest (32 hex digits, see 'usage')")
    return Path(root) / digest_hex


def purge_namespace(root: str | os.PathLike[str], digest_hex: str) -> int:
    """Delete a namespace's directory; returns the chunk files removed. Refuses while a
    server holds a writer lease in it."""
    ns_dir = namespace_dir(root, digest_hex)
    if not (ns_dir / NAMESPACE_FILE).exists():
        raise SSDStoreError(f"{ns_dir} is not a PCR store namespace")
    leases = []
    try:
        for slot_dir in (p for p in ns_dir.iterdir() if p.is_dir() and SLOT_RE.fullmatch(p.name)):
            fd = try_lease(slot_dir)
            if fd < 0:
                raise SSDStoreError(f"namespace {digest_hex} is in use by a running server ({slot_dir.name})")
            leases.append(fd)
        count = sum(
            1
            for slot_dir in ns_dir.iterdir()
            if slot_dir.is_dir()
            for sub in subdirs(slot_dir)
            for p in sub.iterdir()
            if p.suffix == SUFFIX
        )
        shutil.rmtree(ns_dir)
    finally:
        for fd in leases:
            os.close(fd)
    return count
