"""The SSD chunk store on its own: durability protocol, verification, namespaces, faults."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import HEADER_BYTES
from pcr_sglang.tiers.ssd_store import ChunkFileStore, namespace_store
from pcr_sglang.tiers.store_dir import SSDStoreError, list_namespaces, purge_namespace

LAYOUT = HostChunkLayout(num_slots=1, num_layers=2, chunk_size=4, row_bytes=32)
NS_A, NS_B = bytes(range(16)), bytes(range(1, 17))


def make_store(root, namespace=NS_A, capacity=1 << 20, **kwargs):
    kwargs.setdefault("low_watermark_bytes", 0)
    return ChunkFileStore(
        root / "store",
        namespace,
        LAYOUT,
        "torch.float32",
        capacity,
        namespace_description={"num_layers": 2, "chunk_size": 4, "row_bytes": 32},
        **kwargs,
    )


def payload(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(LAYOUT.slot_bytes))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_round_trip_with_owner_only_permissions(tmp_path):
    store = make_store(tmp_path)
    store.write(key(1), key(0), 1, 4, payload(1))
    out = bytearray(LAYOUT.slot_bytes)
    assert store.read_into(key(1), out) and bytes(out) == payload(1)
    assert stat.S_IMODE(os.stat(tmp_path / "store").st_mode) == 0o700
    files = list(store._chunk_files())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert files[0].stat().st_size == HEADER_BYTES + LAYOUT.slot_bytes
    [record] = store.scan()
    assert (record.key, record.parent_key, record.depth, record.num_tokens) == (key(1), key(0), 1, 4)
    assert not store.read_into(key(2), out)  # absent: a miss, not an error


def test_a_crashed_write_leaves_nothing_readable(tmp_path):
    store = make_store(tmp_path)
    store.write(key(1), key(0), 1, 4, payload(1))
    # What a kill -9 between write and rename leaves behind: a partial temp file.
    partial = store._path(key(2)).with_name(store._path(key(2)).name + ".123.tmp")
    partial.parent.mkdir(exist_ok=True)
    partial.write_bytes(payload(2)[:100])
    store.close()  # the writer is gone: its lease is free, its partial writes are junk
    reopened = make_store(tmp_path)
    assert [r.key for r in reopened.scan()] == [key(1)]
    assert reopened.stats.discarded_tmp_files == 1 and not partial.exists()


def test_flipped_truncated_and_garbage_records_are_detected_and_deleted(tmp_path):
    store = make_store(tmp_path)
    for i in (1, 2, 3, 4):
        store.write(key(i), key(0), 1, 4, payload(i))
    flipped, truncated, garbage = store._path(key(1)), store._path(key(2)), store._path(key(3))
    data = bytearray(flipped.read_bytes())
    data[HEADER_BYTES + 10] ^= 0xFF  # payload byte: only a full read can tell
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-7])
    garbage.write_bytes(os.urandom(HEADER_BYTES + LAYOUT.slot_bytes))
    report = store.verify()
    assert report.ok == 1 and len(report.bad) == 3
    store.close()
    reopened = make_store(tmp_path)
    assert sorted(r.key for r in reopened.scan()) == [key(1), key(4)]  # headers of 1 and 4 verify
    assert reopened.stats.corrupt_chunks == 2 and not truncated.exists() and not garbage.exists()
    out = bytearray(LAYOUT.slot_bytes)
    assert not reopened.read_into(key(1), out)  # payload checksum mismatch on read
    assert reopened.stats.corrupt_chunks == 3 and not flipped.exists()
    assert reopened.read_into(key(4), out) and bytes(out) == payload(4)


def test_a_record_never_passes_for_another_key_or_namespace(tmp_path):
    a = make_store(tmp_path, NS_A)
    b = make_store(tmp_path, NS_B)
    a.write(key(1), key(0), 1, 4, payload(1))
    out = bytearray(LAYOUT.slot_bytes)
    assert not b.read_into(key(1), out) and b.scan() == []
    # Even a record copied into the other namespace's directory, or renamed, is refused.
    target = b._path(key(1))
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(a._path(key(1)).read_bytes())
    assert not b.read_into(key(1), out)
    renamed = a._path(key(5))
    renamed.parent.mkdir(exist_ok=True)
    renamed.write_bytes(a._path(key(1)).read_bytes())
    assert not a.read_into(key(5), out)
    assert [r.key for r in a.scan()] == [key(1)]


def test_disk_below_the_low_watermark_refuses_writes_with_enospc(tmp_path):
    store = make_store(tmp_path)
    store.low_watermark_bytes = store.free_disk_bytes() + (1 << 40)
    with pytest.raises(OSError) as info:
        store.write(key(1), key(0), 1, 4, payload(1))
    assert info.value.errno == errno.ENOSPC and store.stats.write_errors == 1
    assert store.scan() == []


def test_capacity_larger_than_the_disk_is_reduced(tmp_path, caplog):
    free = make_store(tmp_path).free_disk_bytes()
    with caplog.at_level("WARNING"):
        store = make_store(tmp_path, capacity=free + (1 << 40))
    assert store.capacity_bytes <= free and "--pcr-ssd-gb" in caplog.text


def test_unusable_paths_fail_with_a_clear_message(tmp_path):
    with pytest.raises(SSDStoreError, match="parent directory"):
        ChunkFileStore(tmp_path / "missing" / "store", NS_A, LAYOUT, "f32", 1 << 20)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(SSDStoreError, match="not a writable directory"):
        ChunkFileStore(a_file, NS_A, LAYOUT, "f32", 1 << 20)


def test_directory_tools_list_verify_and_purge(tmp_path):
    a = make_store(tmp_path, NS_A)
    b = make_store(tmp_path, NS_B)
    for i in range(3):
        a.write(key(i + 1), key(0), 1, 4, payload(i))
    b.write(key(9), key(0), 1, 4, payload(9))
    usage = {u.digest_hex: u for u in list_namespaces(tmp_path / "store")}
    assert usage[NS_A.hex()].chunks == 3 and usage[NS_B.hex()].chunks == 1
    assert usage[NS_A.hex()].bytes == 3 * a.record_bytes
    assert namespace_store(tmp_path / "store", NS_A.hex()).verify().ok == 3
    with pytest.raises(SSDStoreError, match="in use by a running server"):
        purge_namespace(tmp_path / "store", NS_B.hex())  # b holds its writer lease
    assert usage[NS_B.hex()].live_writers == 1
    b.close()
    assert purge_namespace(tmp_path / "store", NS_B.hex()) == 1
    assert [u.digest_hex for u in list_namespaces(tmp_path / "store")] == [NS_A.hex()]
    with pytest.raises(SSDStoreError):
        purge_namespace(tmp_path / "store", NS_B.hex())


def test_cli_usage_verify_purge(tmp_path, capsys):
    from pcr_tools.store_cli import main

    a = make_store(tmp_path, NS_A)
    a.write(key(1), key(0), 1, 4, payload(1))
    a.write(key(2), key(0), 1, 4, payload(2))
    root = str(tmp_path / "store")
    assert main(["usage", root]) == 0
    assert f"{NS_A.hex()}  2 chunks" in capsys.readouterr().out
    assert main(["verify", root]) == 0
    path = a._path(key(2))
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    assert main(["verify", root, "--namespace", NS_A.hex()]) == 1
    assert "1 records ok, 1 bad" in capsys.readouterr().out
    a.close()
    assert main(["purge", root, "--namespace", NS_A.hex()]) == 0
    assert main(["verify", root, "--namespace", NS_A.hex()]) == 2
    assert main(["usage", str(tmp_path / "nope")]) == 2
