from __future__ import annotations

import logging
import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from pcr_sglang.tiers.host_pool import (
    LOCK_SUFFIX,
    SHM_DIR,
    SHM_PREFIX,
    HostChunkPool,
    HostPoolError,
    HostPoolInfo,
    available_host_memory_bytes,
    remove_stale_segments,
    take_owner_lock,
)
from pcr_sglang.tiers.layout import HostChunkLayout

LAYOUT = HostChunkLayout(num_slots=6, num_layers=3, chunk_size=4, row_bytes=10)


def _child_writes(info, slot, value):
    pool = HostChunkPool.attach(info)
    pool.slot_view(slot)[1, 0].fill_(value)  # layer 1, K rows
    pool.close()


def test_second_process_attaches_and_writes_the_same_memory():
    with HostChunkPool(LAYOUT, pin=False) as pool:
        slot = 4
        ctx = mp.get_context("spawn")
        child = ctx.Process(target=_child_writes, args=(pool.info(), slot, 7))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        view = pool.slot_view(slot)
        assert bool((view[1, 0] == 7).all())
        assert int(view[0].sum()) == 0 and int(view[1, 1].sum()) == 0
        del view


def test_too_large_a_pool_fails_with_a_clear_message():
    # Four times what is available now: memory freed meanwhile (servers of other tests
    # exiting) cannot make it fit.
    rows = available_host_memory_bytes() // 2 + 1
    huge = HostChunkLayout(num_slots=1, num_layers=1, chunk_size=4, row_bytes=rows)
    with pytest.raises(HostPoolError, match="GiB of memory is available"):
        HostChunkPool(huge, pin=False)


def test_attach_to_missing_pool_fails_clearly():
    with pytest.raises(HostPoolError, match="does not exist"):
        HostChunkPool.attach(HostPoolInfo(shm_name="pcr-host-missing", layout=LAYOUT))


def test_segment_and_its_owner_lock_are_removed_when_the_owner_closes():
    pool = HostChunkPool(LAYOUT, pin=False)
    info = pool.info()
    segment = os.path.join(SHM_DIR, info.shm_name)
    assert os.path.exists(segment) and os.path.exists(segment + LOCK_SUFFIX)
    # The token never reads as a pid: older versions' pid-based sweeps leave it alone.
    assert not info.shm_name[len(SHM_PREFIX) :].split("-", 1)[0].isdigit()
    pool.close()
    assert not os.path.exists(segment) and not os.path.exists(segment + LOCK_SUFFIX)
    with pytest.raises(HostPoolError):
        HostChunkPool.attach(info)


# A pool owner in another process: it prints the segment's name, then holds the pool
# until its stdin closes. Its resource tracker is told to forget the segment, as a
# killed SGLang scheduler's tracker (killed with its process group) would never act.
OWNER = """
import sys
from multiprocessing import resource_tracker
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.layout import HostChunkLayout
pool = HostChunkPool(HostChunkLayout(num_slots=2, num_layers=1, chunk_size=4, row_bytes=8), pin=False)
resource_tracker.unregister(pool._shm._name, "shared_memory")
print(pool.info().shm_name, flush=True)
sys.stdin.readline()
pool.close()
"""

# Holds the owner lock of segment argv[2] in directory argv[1] until stdin closes.
LOCK_HOLDER = """
import sys
from pcr_sglang.tiers.host_pool import take_owner_lock
fd = take_owner_lock(sys.argv[1], sys.argv[2])
print("locked", flush=True)
sys.stdin.readline()
"""


def _spawn(script: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline().strip()  # blocks until the child holds its lock
    assert line, f"the child failed (exit code {proc.wait()})"
    return proc, line


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def test_a_live_pool_of_another_process_is_never_swept_and_a_killed_owners_pool_is():
    proc, name = _spawn(OWNER)
    segment = os.path.join(SHM_DIR, name)
    try:
        assert name not in remove_stale_segments()
        assert os.path.exists(segment) and os.path.exists(segment + LOCK_SUFFIX)
        with HostChunkPool(LAYOUT, pin=False) as mine:  # creating a pool sweeps too
            assert os.path.exists(segment)
            attached = HostChunkPool.attach(HostPoolInfo(name, HostChunkLayout(2, 1, 4, 8)))
            attached.close()
            assert os.path.exists(os.path.join(SHM_DIR, mine.info().shm_name))
    finally:
        proc.kill()  # SIGKILL: no exit handler runs, the segment stays behind
        proc.wait()
    assert os.path.exists(segment)
    assert name in remove_stale_segments(expected=True)
    assert not os.path.exists(segment) and not os.path.exists(segment + LOCK_SUFFIX)


def test_a_held_owner_lock_keeps_a_segment_whatever_pid_its_name_carries(tmp_path):
    """A server in another pid namespace: the pid in its segment's name is not alive
    here, but it holds the owner lock, so its segment stays. Once it is killed, the lock
    is free and the segment goes, with the lock file."""
    name = f"{SHM_PREFIX}{_dead_pid()}-abcd"
    (tmp_path / name).write_bytes(b"x")
    proc, _ = _spawn(LOCK_HOLDER, str(tmp_path), name)
    try:
        assert remove_stale_segments(str(tmp_path)) == []
        assert (tmp_path / name).exists() and (tmp_path / (name + LOCK_SUFFIX)).exists()
    finally:
        proc.kill()
        proc.wait()
    assert remove_stale_segments(str(tmp_path)) == [name]
    assert not (tmp_path / name).exists() and not (tmp_path / (name + LOCK_SUFFIX)).exists()


def test_segments_without_an_owner_lock_are_never_swept_and_orphaned_locks_are(tmp_path, caplog):
    legacy = tmp_path / f"{SHM_PREFIX}{_dead_pid()}-abcd"  # an older version's name: its creator's pid
    orphan_lock = tmp_path / f"{SHM_PREFIX}0123abcd{LOCK_SUFFIX}"  # its owner died before its segment existed
    other = tmp_path / "unrelated-123"
    for f in (legacy, orphan_lock, other):
        f.write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="pcr_sglang.tiers.shm_owner"):
        assert remove_stale_segments(str(tmp_path)) == []
    assert legacy.exists() and other.exists() and not orphan_lock.exists()
    assert legacy.name in caplog.text and "no owner lock" in caplog.text


def test_a_pool_name_whose_lock_file_exists_is_not_taken(tmp_path):
    """The owner lock is taken before the segment exists; a name whose lock file is
    there already (a live owner, or a sweep removing it) is never taken over."""
    name = f"{SHM_PREFIX}feedbeef"
    fd = take_owner_lock(str(tmp_path), name)
    try:
        with pytest.raises(FileExistsError):
            take_owner_lock(str(tmp_path), name)
    finally:
        os.close(fd)
    assert remove_stale_segments(str(tmp_path)) == []  # no segment: only the free lock file goes
    assert not (tmp_path / (name + LOCK_SUFFIX)).exists()
