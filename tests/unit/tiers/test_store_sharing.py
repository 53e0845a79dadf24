"""One store directory shared by several servers, its permissions, and record trust.

Servers are stand-ins only in that each is a real ChunkFileStore (what a scheduler opens)
in this process; the lease tests use the real I/O process through its supervisor.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time

import pytest
import torch

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.core import CacheNamespace
from pcr_sglang.core.orders import IoOutcome, WriteChunk
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.sglang_adapter.factory import build_ssd_store
from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import HEADER_BYTES, read_full
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_sglang.tiers.store_dir import KEY_FILE, SSDStoreError
from tests.unit.io_config import io_config

LAYOUT = HostChunkLayout(num_slots=4, num_layers=2, chunk_size=4, row_bytes=32)
NS = bytes(range(16))
NOBODY = 65534


def make_store(root, **kwargs):
    kwargs.setdefault("low_watermark_bytes", 0)
    return ChunkFileStore(
        root,
        NS,
        LAYOUT,
        "torch.float32",
        1 << 20,
        namespace_description={"num_layers": 2, "chunk_size": 4, "row_bytes": 32},
        **kwargs,
    )


def payload(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(LAYOUT.slot_bytes))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def read(store: ChunkFileStore, k: bytes):
    out = bytearray(LAYOUT.slot_bytes)
    return bytes(out) if store.read_into(k, out) else None


# ---------------------------------------------------------------------- sharing
def test_live_servers_get_their_own_slots_and_read_each_others_records(tmp_path):
    a = make_store(tmp_path / "store")
    a.scan()
    a.write(key(1), key(0), 1, 4, payload(1))
    b = make_store(tmp_path / "store")
    assert (a.slot, b.slot) == ("w0", "w1")
    assert [r.key for r in b.scan()] == [key(1)] and b.stats.peer_chunks == 1  # a's, seen at b's start
    assert read(b, key(1)) == payload(1)
    b.write(key(2), key(0), 1, 4, payload(2))
    assert read(a, key(2)) == payload(2)  # written after a started: found on read
    # Eviction by one never deletes the other's record; the owner's delete is a miss for both.
    b.delete(key(1))
    assert read(a, key(1)) == payload(1) == read(b, key(1))
    a.delete(key(1))
    assert read(b, key(1)) is None and read(a, key(1)) is None


def test_a_starting_server_never_touches_a_live_writers_partial_writes(tmp_path):
    a = make_store(tmp_path / "store", durability="batch")
    a.scan()
    a.write(key(1), key(0), 1, 4, payload(1))  # in its temp file, not renamed yet
    temps = list((tmp_path / "store").rglob("*.tmp"))
    assert len(temps) == 1 and ".w0-" in temps[0].name
    b = make_store(tmp_path / "store")
    b.scan()
    assert temps[0].exists() and b.stats.discarded_tmp_files == 0
    assert a.flush() == [key(1)]  # a's write-back survives b's start
    assert read(b, key(1)) == payload(1)


def test_a_dead_writers_slot_is_taken_back_with_its_records_and_without_its_partial_writes(tmp_path):
    a = make_store(tmp_path / "store", durability="batch")
    b = make_store(tmp_path / "store")
    a.write(key(1), key(0), 1, 4, payload(1))
    a.flush()
    a.write(key(2), key(0), 1, 4, payload(2))  # never flushed: a dies mid-write
    os.close(a.lease_fd)  # what the kernel does when the process dies (even kill -9)
    c = make_store(tmp_path / "store")
    assert c.slot == "w0"  # a's slot, free again (b, live, keeps w1)
    assert [r.key for r in c.scan()] == [key(1)] and c.stats.discarded_tmp_files == 1
    assert read(c, key(1)) == payload(1)
    b.close()


def test_a_starting_server_adopts_the_records_of_other_dead_slots(tmp_path):
    a = make_store(tmp_path / "store")
    b = make_store(tmp_path / "store")
    a.write(key(4), key(0), 1, 4, payload(4))
    b.write(key(5), key(0), 1, 4, payload(5))
    b.write(key(6), key(0), 1, 4, payload(6))
    partial = b.own_dir / key(7).hex()[:2] / f"{key(7).hex()}.w1-dead-1.tmp"
    partial.parent.mkdir(exist_ok=True)
    partial.write_bytes(b"half")
    a.close()  # both die
    b.close()
    c = make_store(tmp_path / "store")
    assert c.slot == "w0"
    records = c.scan()  # w1 is free: its temp file goes, its records move into w0
    assert {r.key for r in records} == {key(4), key(5), key(6)}
    assert c.stats.adopted_chunks == 2 and c.stats.discarded_tmp_files == 1 and not partial.exists()
    assert not list((tmp_path / "store" / NS.hex() / "w1").rglob("*.chunk"))
    assert all((c.own_dir / k.hex()[:2] / f"{k.hex()}.chunk").exists() for k in (key(5), key(6)))
    assert read(c, key(5)) == payload(5)
    # A server starting now takes the empty w1 and sees c's records as a live peer's.
    d = make_store(tmp_path / "store")
    assert d.slot == "w1" and {r.key for r in d.scan()} == {key(4), key(5), key(6)}
    assert d.stats.adopted_chunks == 0 and d.stats.peer_chunks == 3


def test_a_full_disk_while_adopting_a_dead_writer_degrades_instead_of_failing(tmp_path):
    """Review finding: ENOSPC while adopting made scan() raise, so the server would not
    start (and with TP the other ranks would wait in the next collective)."""
    from pcr_sglang.tiers.fileops import FileOps

    class FullDisk(FileOps):
        def mkdir(self, path, mode=0o700):
            if os.path.isdir(path):
                return False
            raise OSError(28, "No space left on device", path)

        def link(self, src, dst):
            raise OSError(28, "No space left on device", dst)

    live = make_store(tmp_path / "store")
    dead = make_store(tmp_path / "store")
    dead.write(key(5), key(0), 1, 4, payload(5))
    dead.close()
    starting = make_store(tmp_path / "store", fileops=FullDisk())  # takes w1, the dead writer's slot
    assert starting.slot == "w1"
    other_dead = make_store(tmp_path / "store")  # w2
    other_dead.write(key(6), key(0), 1, 4, payload(6))
    other_dead.close()
    records = starting.scan()
    assert {r.key for r in records} >= {key(5), key(6)}  # served from where they are
    assert read(starting, key(6)) == payload(6)
    live.close()


def test_capacity_counts_only_space_this_server_can_free(tmp_path):
    """Review finding: a live peer's records were counted as space we could reclaim, so
    writes then failed at the reserve instead of evicting."""
    big = HostChunkLayout(num_slots=1, num_layers=2, chunk_size=64, row_bytes=4096)  # 1 MiB records
    desc = {"num_layers": 2, "chunk_size": 64, "row_bytes": 4096}
    peer = ChunkFileStore(
        tmp_path / "store", NS, big, "torch.float32", 1 << 40, namespace_description=desc, low_watermark_bytes=0
    )
    for i in range(8):
        peer.write(key(i), key(0), 1, 64, bytes(big.slot_bytes))
    free = shutil.disk_usage(tmp_path).free
    ours = ChunkFileStore(
        tmp_path / "store", NS, big, "torch.float32", 1 << 40, namespace_description=desc, low_watermark_bytes=0
    )
    assert ours.capacity_bytes <= free  # the peer's 8 MiB are not ours to free
    peer.close()
    ours.close()


def test_a_peers_record_that_fails_verification_is_left_to_the_peer(tmp_path):
    """Review finding: we verify an inode but unlink by name, which may already be the
    peer's valid rewrite: a peer's slot is never modified."""
    a = make_store(tmp_path / "store")
    b = make_store(tmp_path / "store")
    a.write(key(3), key(0), 1, 4, payload(3))
    path = a.own_dir / key(3).hex()[:2] / f"{key(3).hex()}.chunk"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert read(b, key(3)) is None and path.exists()  # b: a miss; the file stays a's
    assert read(a, key(3)) is None and not path.exists()  # a deletes its own bad record


def test_the_io_process_holds_the_lease_while_it_lives(tmp_path):
    """The lease descriptor is inherited by the I/O process: even after its scheduler's
    copy is closed, no new server takes the slot until the I/O process is gone."""
    pool = HostChunkPool(LAYOUT, pin=False)
    store = make_store(tmp_path / "store")
    sup = IOSupervisor(
        io_config(
            pool,
            store.root,
            NS.hex(),
            "torch.float32",
            writer_slot=store.slot,
            lease_fd=store.lease_fd,
        )
    )
    try:
        assert sup.wait_ready(30)
        pool.buffer[: LAYOUT.slot_bytes] = torch.frombuffer(bytearray(payload(9)), dtype=torch.uint8)  # slot 0
        sup.submit(WriteChunk(1, key(9), key(0), 1, 4, 0))
        outcomes = []
        deadline = time.monotonic() + 30
        while not outcomes and time.monotonic() < deadline:
            outcomes += sup.poll()
            time.sleep(0.01)
        assert outcomes[0][1] is IoOutcome.OK
        assert (store.own_dir / key(9).hex()[:2] / f"{key(9).hex()}.chunk").exists()  # in the slot given
        store.close()  # the scheduler's descriptor is gone; the I/O process still has its own
        other = make_store(tmp_path / "store")
        assert other.slot == "w1"
        other.close()
    finally:
        sup.close()  # SIGKILL and wait
        pool.close()
    after = make_store(tmp_path / "store")
    assert after.slot == "w0"  # the kernel released the lease with the process
    assert {r.key for r in after.scan()} == {key(9)}


def test_batch_durability_acknowledges_each_write_once_its_record_is_in_place(tmp_path):
    pool = HostChunkPool(LAYOUT, pin=False)
    store = make_store(tmp_path / "store", durability="batch")
    sup = IOSupervisor(
        io_config(
            pool,
            store.root,
            NS.hex(),
            "torch.float32",
            writer_slot=store.slot,
            lease_fd=store.lease_fd,
            durability="batch",
        )
    )
    try:
        assert sup.wait_ready(30)
        for slot in range(LAYOUT.num_slots):
            pool.buffer[slot * LAYOUT.slot_bytes : (slot + 1) * LAYOUT.slot_bytes] = torch.frombuffer(
                bytearray(payload(slot)), dtype=torch.uint8
            )
        for seq in range(40):  # more than one batch (16) in a burst
            sup.submit(WriteChunk(seq, key(100 + seq), key(0), 1, 4, seq % LAYOUT.num_slots))
        outcomes = []
        deadline = time.monotonic() + 60
        while len(outcomes) < 40 and time.monotonic() < deadline:
            for seq, outcome, _ in sup.poll():
                # Acknowledged: the record is under its final name already (synced first).
                assert outcome is IoOutcome.OK and read(store, key(100 + seq)) == payload(seq % LAYOUT.num_slots)
                outcomes.append(seq)
            time.sleep(0.01)
        assert sorted(outcomes) == list(range(40))
        assert not list(store.own_dir.rglob("*.tmp"))
    finally:
        sup.close()
        pool.close()


def test_batch_durability_never_acknowledges_a_write_whose_record_was_replaced(tmp_path):
    """Review finding: a held write whose record the store dropped (a rewrite of the same
    key, or a delete, before the group fsync) was acknowledged OK. Driven on an IoProcess
    in this process, its replies collected instead of sent."""
    from multiprocessing import resource_tracker

    from pcr_sglang.core.orders import DeleteChunk
    from pcr_sglang.io.process import IoProcess
    from pcr_sglang.io.protocol import reply_decoder

    pool = HostChunkPool(LAYOUT, pin=False)
    store = make_store(tmp_path / "store", durability="batch")
    proc = IoProcess(
        io_config(
            pool,
            store.root,
            NS.hex(),
            "torch.float32",
            orders_endpoint=f"ipc://{tmp_path}/orders",
            replies_endpoint=f"ipc://{tmp_path}/replies",
            parent_pid=os.getpid(),
            writer_slot=store.slot,
            lease_fd=store.lease_fd,
            durability="batch",
        )
    )
    # The I/O process unregisters the segment from this process's resource tracker (in its own
    # process the scheduler owns it); here the pool is ours, so it is registered back.
    resource_tracker.register(proc.shm._name, "shared_memory")
    sent = []
    proc.replies.send = lambda raw: sent.append(reply_decoder.decode(raw))
    try:
        for order in (
            WriteChunk(1, key(50), key(0), 1, 4, 0),
            WriteChunk(2, key(50), key(0), 1, 4, 1),
            WriteChunk(3, key(51), key(0), 1, 4, 2),
            DeleteChunk(key(51)),
        ):
            assert proc.execute(order) is None  # held for the group fsync (or unacknowledged)
        proc.flush()
        outcomes = {d.seq: d.outcome for d in sent}
        assert outcomes == {1: IoOutcome.CANCELLED, 2: IoOutcome.OK, 3: IoOutcome.CANCELLED}, outcomes
        assert read(store, key(50)) is not None and read(store, key(51)) is None
    finally:
        proc.ctx.destroy(linger=0)
        proc.shm.close()
        pool.close()


# ---------------------------------------------------------------------- permissions
def test_new_directories_are_0700_and_existing_ones_keep_their_mode(tmp_path):
    store = make_store(tmp_path / "new")
    for path in (tmp_path / "new", store.dir, store.own_dir):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE((store.dir / KEY_FILE).stat().st_mode) == 0o600
    existing = tmp_path / "existing"
    existing.mkdir()
    os.chmod(existing, 0o755)
    make_store(existing).close()
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755  # never chmod-ed (it was 0700 before)
    sticky = tmp_path / "shared-tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    s = make_store(sticky)  # sticky and ours (or root's), like /tmp: allowed, untouched
    assert stat.S_IMODE(sticky.stat().st_mode) == 0o1777
    assert stat.S_IMODE(s.dir.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_a_directory_others_can_write_is_refused_and_left_alone(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(SSDStoreError, match="--pcr-ssd-path .* writable by other users"):
        make_store(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == mode and not list(shared.iterdir())


def test_foreign_owned_directories_and_keys_are_refused(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, NOBODY, NOBODY)
    with pytest.raises(SSDStoreError, match="owned by uid 65534"):
        make_store(foreign)
    # In a sticky shared directory another user may have created our namespace's name first.
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    squatted = sticky / NS.hex()
    squatted.mkdir(mode=0o700)
    os.chown(squatted, NOBODY, NOBODY)
    with pytest.raises(SSDStoreError, match="namespace directory .* owned by uid 65534"):
        make_store(sticky)
    ok = make_store(tmp_path / "ok")
    ok.close()
    key_file = ok.dir / KEY_FILE
    os.chmod(key_file, 0o644)
    with pytest.raises(SSDStoreError, match="readable by\\s+no one else"):
        make_store(tmp_path / "ok")
    os.chmod(key_file, 0o600)
    os.chown(key_file, NOBODY, NOBODY)
    with pytest.raises(SSDStoreError, match="owned by this user"):
        make_store(tmp_path / "ok")


def test_the_server_refuses_a_shared_directory_naming_the_flag(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    pool = HostChunkPool(LAYOUT, pin=False)
    try:
        config = PCRConfig(enabled=True, dram_gb=0.01, ssd_path=str(shared), ssd_gb=0.01, ssd_reserve_gb=0)
        namespace = CacheNamespace(
            model_fingerprint="m", kv_dtype="torch.float32", chunk_size=4, layout="token-major", tp_rank=0, tp_size=1
        )
        with pytest.raises(PCRConfigError, match="--pcr-ssd-path"):
            build_ssd_store(config, namespace, pool)
    finally:
        pool.close()


# ---------------------------------------------------------------------- trust
def test_records_planted_by_another_user_or_forged_are_never_served(tmp_path):
    store = make_store(tmp_path / "store")
    store.write(key(1), key(0), 1, 4, payload(1))
    genuine = store._path(key(1)).read_bytes()
    # (1) A record that verifies, but whose file another user owns (so another user wrote
    # or replaced it: only our own files are trusted).
    store.write(key(2), key(0), 1, 4, payload(2))
    os.chown(store._path(key(2)), NOBODY, NOBODY)
    # (2) Another deployment's record (its own key) for a key this store will ask for.
    other = make_store(tmp_path / "other")
    other.write(key(3), key(0), 1, 4, payload(33))
    store._path(key(3)).parent.mkdir(exist_ok=True)
    shutil.copy(other._path(key(3)), store._path(key(3)))
    # (3) A genuine header with a forged payload: what an XXH3 digest alone would accept
    # once the forger recomputed it; here the payload MAC is keyed.
    forged = bytearray(genuine)
    forged[HEADER_BYTES:] = payload(44)
    store._path(key(1)).write_bytes(bytes(forged))
    store.close()
    reopened = make_store(tmp_path / "store")
    records = {r.key for r in reopened.scan()}
    assert key(2) not in records and key(3) not in records  # refused on open
    assert read(reopened, key(1)) is None and read(reopened, key(2)) is None and read(reopened, key(3)) is None
    assert reopened.stats.corrupt_chunks >= 3 and reopened.stats.read_chunks == 0
    reopened.write(key(1), key(0), 1, 4, payload(1))  # recomputed and written again: served
    assert read(reopened, key(1)) == payload(1)


# ---------------------------------------------------------------------- short reads
def test_short_reads_are_retried_not_taken_for_corruption():
    """A pipe hands out what has arrived: ``readinto`` returns short counts, as NFS and
    FUSE may; the read loop must still fill the buffer."""
    r, w = os.pipe()
    data = payload(5)
    first_read = threading.Event()

    def trickle():
        os.write(w, data[:100])
        first_read.wait(10)  # the rest only after the reader took a short read (not by timing)
        for i in range(100, len(data), 100):
            os.write(w, data[i : i + 100])
            time.sleep(0.002)
        os.close(w)

    t = threading.Thread(target=trickle)
    t.start()
    out = bytearray(len(data))
    with open(r, "rb", buffering=0) as f:
        first = f.readinto(memoryview(out)[: len(data)])
        first_read.set()
        assert first == 100  # a real short read happened
        assert first + read_full(f, memoryview(out)[first:]) == len(data)
    t.join()
    assert bytes(out) == data


def test_a_root_that_is_another_users_symlink_is_refused(tmp_path):
    """Review finding: in a sticky shared directory another user can plant the path as a
    symlink and re-point it between our checks."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "store"
    link.symlink_to(real)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(SSDStoreError, match="symbolic link owned by uid"):
        make_store(link)
    os.lchown(link, os.geteuid(), os.getegid())
    make_store(link).close()  # our own link is fine
