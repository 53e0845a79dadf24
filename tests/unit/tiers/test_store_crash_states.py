"""Crash states of the SSD store, in the style of ALICE and CrashMonkey.

A workload runs against a real store whose file operations are recorded
(:class:`~pcr_sglang.tiers.fileops.RecordingFileOps`): writes, fsyncs, renames, links,
mkdirs, unlinks and directory fsyncs, with a mark wherever the store's caller (the I/O
process) would tell the scheduler that a write is done. For every prefix of that log (a
power cut after each operation) the generator builds the states POSIX allows:

* file data is durable only up to the file's last fsync; what was written after it may
  be lost, torn (a prefix survives) or reordered (the size grew but the blocks are zeros);
* a directory entry (create, rename, link, mkdir, unlink) is durable only once its
  parent directory is fsynced; until then it may be lost, and any one of them may
  persist while the others are lost (reordering). A rename is two entries: the new name
  (durable with its directory) and the removal of the old one (with the old directory).

Each distinct state is written into a fresh directory, a new store opens it (scan, then
reads) and two invariants are checked: (a) no record that fails verification is ever
served (every byte served is the byte written for that key), and (b) every record whose
completion was reported is still there and readable, in the durability modes that promise
it (``record``, ``batch``). The negative controls run the same workload on stores with an
fsync removed and must find violations.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pcr_sglang.tiers.fileops import FileOps, Op, RecordingFileOps
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.ssd_store import ChunkFileStore

LAYOUT = HostChunkLayout(num_slots=1, num_layers=1, chunk_size=2, row_bytes=256)
NS = bytes(range(16))


def key(i: int, prefix: int) -> bytes:
    return bytes([prefix]) + i.to_bytes(15, "little")


def payload(k: bytes) -> bytes:
    """Distinct for every key, so a record served under another key's name shows."""
    seed = hashlib.blake2b(k, digest_size=32).digest()
    return (seed * (LAYOUT.slot_bytes // len(seed) + 1))[: LAYOUT.slot_bytes]


def open_store(root: Path, durability: str, ops=None) -> ChunkFileStore:
    return ChunkFileStore(
        root,
        NS,
        LAYOUT,
        "float32",
        1 << 20,
        low_watermark_bytes=0,
        durability=durability,
        fileops=ops,
        namespace_description={"num_layers": 1, "chunk_size": 2, "row_bytes": 256},
    )


class NoSyncFileOps(FileOps):
    """For the recovering store only: its own fsyncs are not under test, and skipping them
    keeps a thousand recoveries within seconds."""

    def fsync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: str) -> None:
        pass


# ---------------------------------------------------------------------- the workload
def run_workload(base: Path, durability: str, ops: RecordingFileOps) -> None:
    """Two servers share the directory; the first writes (two keys share a ``<key[:2]>/``
    directory), deletes and rewrites, the second writes; both die; a third takes the first
    one's slot, adopts the second one's records and writes more."""
    first = open_store(base / "store", durability, ops)
    first.scan()
    second = open_store(base / "store", durability, ops)
    second.scan()
    keys = [key(1, 0xA1), key(2, 0xA1), key(3, 0xB2), key(4, 0xC3)]

    def put(store: ChunkFileStore, batch: list[bytes]) -> None:
        for k in batch:
            store.write(k, bytes(16), 1, 2, payload(k))
            if durability != "batch":
                ops.mark(("done", k))
        if durability == "batch":
            for k in store.flush():
                ops.mark(("done", k))

    put(first, keys[:2])
    put(second, [keys[2]])
    put(first, [keys[3]])
    ops.mark(("deleted", keys[0]))  # the scheduler stops counting on it, then deletes it
    first.delete(keys[0])
    put(first, [keys[1]])  # a rewrite replaces the record atomically
    put(second, [key(7, 0xE5)])
    first.close()  # both die: their leases are free
    second.close()
    third = open_store(base / "store", durability, ops)
    assert third.slot == "w0"
    third.scan()  # adopts the second server's records (slot w1)
    assert third.stats.adopted_chunks == 2
    put(third, [key(5, 0xB2), key(6, 0xD4)])
    third.close()


# ---------------------------------------------------------------------- crash states
@dataclass
class Entry:
    """One directory-entry effect of an operation: ``name`` points to ``inode`` (None:
    the name is removed; "dir": a directory), durable once ``parent`` is fsynced."""

    index: int
    parent: str
    name: str
    inode: object


@dataclass
class Timeline:
    entries: list[Entry] = field(default_factory=list)
    writes: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)  # inode -> (index, data)
    fsyncs: dict[int, list[int]] = field(default_factory=dict)  # inode -> indexes
    dir_fsyncs: dict[str, list[int]] = field(default_factory=dict)
    marks: list[tuple[int, object]] = field(default_factory=list)


def timeline(log: list[Op], base: str) -> Timeline:
    t = Timeline()
    names: dict[str, int] = {}

    def rel(path: str) -> str:
        return os.path.relpath(path, base)

    def parent(name: str) -> str:
        return os.path.dirname(name) or "."

    for i, op in enumerate(log):
        if op.kind == "create":
            names[rel(op.path)] = op.fd_id
            t.entries.append(Entry(i, parent(rel(op.path)), rel(op.path), op.fd_id))
        elif op.kind == "write":
            t.writes.setdefault(op.fd_id, []).append((i, op.data))
        elif op.kind == "fsync":
            t.fsyncs.setdefault(op.fd_id, []).append(i)
        elif op.kind in ("rename", "link"):
            src, dst = rel(op.path), rel(op.dest)
            inode = names[src]
            names[dst] = inode
            t.entries.append(Entry(i, parent(dst), dst, inode))
            if op.kind == "rename":
                del names[src]
                t.entries.append(Entry(i, parent(src), src, None))
        elif op.kind == "unlink":
            names.pop(rel(op.path), None)
            t.entries.append(Entry(i, parent(rel(op.path)), rel(op.path), None))
        elif op.kind == "mkdir":
            t.entries.append(Entry(i, parent(rel(op.path)), rel(op.path), "dir"))
        elif op.kind == "fsync_dir":
            t.dir_fsyncs.setdefault(rel(op.path), []).append(i)
        elif op.kind == "mark":
            t.marks.append((i, op.label))
    return t


def crash_states(t: Timeline, crash: int):
    """The file-system states a power cut right after operation ``crash`` may leave:
    yields (name, {path: bytes or "dir"})."""
    entries = [e for e in t.entries if e.index <= crash]
    durable = [e for e in entries if any(e.index < j <= crash for j in t.dir_fsyncs.get(e.parent, []))]
    unsynced = [e for e in entries if e not in durable]

    def content(inode: int, how: str) -> bytes:
        writes = [(i, d) for i, d in t.writes.get(inode, []) if i <= crash]
        synced_at = max((j for j in t.fsyncs.get(inode, []) if j <= crash), default=-1)
        kept = b"".join(d for i, d in writes if i < synced_at)
        rest = b"".join(d for i, d in writes if i > synced_at)
        if how == "lost":
            return kept
        if how == "torn":
            return kept + rest[: len(rest) // 2]
        if how == "zeros":  # the size grew, no block arrived
            return kept + bytes(len(rest))
        if how == "reordered":  # the first blocks arrived, the last did not
            return kept + rest[: len(rest) // 2] + bytes(len(rest) - len(rest) // 2)
        return kept + rest

    def build(chosen: list[Entry], how: str) -> dict:
        names: dict[str, object] = {}
        for e in sorted(chosen, key=lambda e: (e.index, e.inode is not None)):
            if e.inode is None:
                names.pop(e.name, None)
            else:
                names[e.name] = e.inode
        state = {}
        for name, inode in names.items():
            parts = Path(name).parents
            if all(str(p) == "." or names.get(str(p)) == "dir" for p in parts):  # reachable
                state[name] = "dir" if inode == "dir" else content(inode, how)
        return state

    yield "synced only", build(durable, "lost")
    for how in ("lost", "torn", "zeros", "reordered", "full"):
        yield f"every entry, unsynced data {how}", build(entries, how)
    for e in unsynced:
        yield f"only entry {e.name}@{e.index} of the unsynced", build(durable + [e], "full")
        yield f"all but entry {e.name}@{e.index}", build([x for x in entries if x is not e], "full")


def materialize(state: dict, root: Path) -> None:
    root.mkdir()
    for name in sorted(state, key=lambda n: n.count("/")):
        path = root / name
        if state[name] == "dir":
            path.mkdir(mode=0o700)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as f:
                f.write(state[name])


def check(state_root: Path, durability: str, done: set[bytes]) -> list[str]:
    """Recover (open, scan, read everything) and list the invariants broken."""
    problems = []
    try:
        store = open_store(state_root / "store", durability, NoSyncFileOps())
        records = {r.key for r in store.scan()}
    except Exception as e:  # a state the store cannot even open is a failure to recover
        return [f"cannot recover: {e!r}"]
    out = bytearray(LAYOUT.slot_bytes)
    for k in records | done:
        served = store.read_into(k, out)
        if served and bytes(out) != payload(k):
            problems.append(f"(a) served wrong bytes for {k.hex()}")
        if k in done and durability != "none" and not served:
            problems.append(f"(b) completed record {k.hex()} lost")
    store.close()
    return problems


def explore(tmp_path: Path, durability: str, ops: RecordingFileOps) -> tuple[int, list[str]]:
    base = tmp_path / "recorded"
    base.mkdir()
    run_workload(base, durability, ops)
    t = timeline(ops.log, str(base))
    seen: set = set()
    violations: list[str] = []
    counter = itertools.count()
    for crash in range(len(ops.log)):
        done: set[bytes] = set()
        for index, (kind, k) in ((i, m) for i, m in t.marks if i <= crash):
            if kind == "done":
                done.add(k)
            elif kind == "deleted":
                done.discard(k)
        for name, state in crash_states(t, crash):
            fingerprint = (frozenset((p, c if c == "dir" else bytes(c)) for p, c in state.items()), frozenset(done))
            if fingerprint in seen:
                continue
            seen.add(fingerprint)
            root = tmp_path / f"state{next(counter)}"
            materialize(state, root)
            violations += [
                f"after op {crash} ({ops.log[crash].kind} {ops.log[crash].path}), {name}: {p}"
                for p in check(root, durability, done)
            ]
    return len(seen), violations


# ---------------------------------------------------------------------- the tests
@pytest.mark.parametrize("durability", ["record", "batch", "none"])
def test_every_crash_state_recovers_without_serving_bad_records_or_losing_completed_ones(tmp_path, durability):
    states, violations = explore(tmp_path, durability, RecordingFileOps())
    print(f"{durability}: {states} distinct crash states checked")
    assert states > 100  # the generator really explored
    assert violations == []


def _is_slot_dir(path: str) -> bool:
    return os.path.basename(path).startswith("w") and os.path.basename(path)[1:].isdigit()


@pytest.mark.parametrize("durability", ["record", "batch"])
@pytest.mark.parametrize("removed", ["fsync before rename", "directory fsync", "new <key[:2]>/ in its parent"])
def test_removing_an_fsync_breaks_the_promise(tmp_path, durability, removed):
    """The negative controls: the same workload on a store with one fsync left out loses
    records whose completion was reported, so the crash-state check above can fail."""
    ops = {
        "fsync before rename": RecordingFileOps(skip=frozenset({"fsync"}), skip_if=lambda p: p.endswith(".tmp")),
        "directory fsync": RecordingFileOps(skip=frozenset({"fsync_dir"})),
        "new <key[:2]>/ in its parent": RecordingFileOps(skip=frozenset({"fsync_dir"}), skip_if=_is_slot_dir),
    }[removed]
    states, violations = explore(tmp_path, durability, ops)
    print(f"{durability} without {removed}: {len(violations)} violations in {states} states")
    assert any("(b) completed record" in v for v in violations), violations[:5]
