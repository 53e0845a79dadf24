from __future__ import annotations

import multiprocessing as mp

import pytest

from pcr_sglang.tiers.host_pool import HostChunkPool, HostPoolError, available_host_memory_bytes
from pcr_sglang.transfer.layout import HostChunkLayout

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
    from pcr_sglang.tiers.host_pool import HostPoolInfo

    with pytest.raises(HostPoolError, match="does not exist"):
        HostChunkPool.attach(HostPoolInfo(shm_name="pcr-host-missing", layout=LAYOUT))


def test_segment_is_removed_when_the_owner_closes():
    pool = HostChunkPool(LAYOUT, pin=False)
    info = pool.info()
    pool.close()
    with pytest.raises(HostPoolError):
        HostChunkPool.attach(info)


def test_pools_of_dead_processes_are_swept(tmp_path):
    import subprocess
    import sys

    from pcr_sglang.tiers.host_pool import SHM_PREFIX, remove_stale_segments

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"{SHM_PREFIX}{dead_pid}-abcd"
    live = tmp_path / f"{SHM_PREFIX}{__import__('os').getpid()}-abcd"
    other = tmp_path / "unrelated-123"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert remove_stale_segments(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
