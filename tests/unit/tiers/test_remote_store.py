"""The remote tier's client (Mooncake Store) and the I/O process's remote thread, against a
real ``mooncake_master`` and store process on loopback (started once for the module)."""

from __future__ import annotations

import json
import os
import time

import pytest
import zmq

from pcr_sglang.core.orders import IoOutcome, ProbeRemote, ReadChunk
from pcr_sglang.io.protocol import SOURCE_REMOTE, Done, Probed, RemoteStatus, reply_decoder
from pcr_sglang.io.remote_calls import RemoteFaults
from pcr_sglang.io.remote_thread import RemoteThread
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import RecordCodec
from pcr_sglang.tiers.remote_store import (
    ReadResult,
    RemoteChunkStore,
    RemoteConfig,
    RemoteConfigError,
    RemoteError,
    load_fleet_key,
)
from pcr_tools.mooncake_services import MooncakeMaster, MooncakeStoreProcess, client_config, keygen

LAYOUT = HostChunkLayout(num_slots=4, num_layers=2, chunk_size=4, row_bytes=32)
NS_A, NS_B = bytes(range(16)), bytes(range(1, 17))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(LAYOUT.slot_bytes))


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    logs = tmp_path_factory.mktemp("mooncake")
    master = MooncakeMaster(log_path=logs / "master.log")
    master.start()
    store = MooncakeStoreProcess(master, 32 << 20, log_path=logs / "store.log")
    try:
        store.start()
        yield master
    finally:
        store.stop()
        master.stop()


@pytest.fixture(scope="module")
def fleet_key(tmp_path_factory):
    return keygen(tmp_path_factory.mktemp("key") / "fleet.key")


def unopened_store(master, key_file, namespace=NS_A, mac_key=None, **config) -> RemoteChunkStore:
    config = RemoteConfig.parse(json.dumps(client_config(master, key_file, **config)))
    return RemoteChunkStore(
        config, RecordCodec(mac_key or load_fleet_key(config.key_file), namespace, LAYOUT, "torch.float32")
    )


def open_store(master, key_file, namespace=NS_A, mac_key=None):
    store = unopened_store(master, key_file, namespace, mac_key)
    store.open()
    return store


@pytest.fixture(scope="module")
def remote(mooncake, fleet_key):
    store = open_store(mooncake, fleet_key)
    yield store
    store.close()


def codec(namespace=NS_A, mac_key=None) -> RecordCodec:
    return RecordCodec(mac_key or bytes(range(32)), namespace, LAYOUT, "torch.float32")


def write(store, i, parent=bytes(16), depth=1, seed=None):
    record = store.build_record(key(i), parent, depth, LAYOUT.chunk_size, payload(i if seed is None else seed))
    return store.write(key(i), record)


# ------------------------------------------------------------------ config
def test_config_parses_json_and_files_and_names_bad_keys(tmp_path, fleet_key):
    text = json.dumps(
        {
            "master_server_address": "127.0.0.1:1",
            "key_file": str(fleet_key),
            "global_segment_size": "64MB",
            "probe_timeout_ms": 20,
        }
    )
    config = RemoteConfig.parse(text)
    assert config.global_segment_size == 64 << 20 and config.probe_timeout_ms == 20
    (tmp_path / "c.json").write_text(text)
    assert RemoteConfig.parse(f"@{tmp_path / 'c.json'}") == config
    with pytest.raises(RemoteConfigError, match="unknown keys.*'master'"):
        RemoteConfig.parse(json.dumps({"master": "x", "key_file": "k"}))
    with pytest.raises(RemoteConfigError, match="master_server_address required"):
        RemoteConfig.parse(json.dumps({"key_file": "k"}))
    with pytest.raises(RemoteConfigError, match="not JSON"):
        RemoteConfig.parse("{master")
    with pytest.raises(RemoteConfigError, match="size like"):
        RemoteConfig.parse(json.dumps({"master_server_address": "a:1", "key_file": "k", "local_buffer_size": "lots"}))
    with pytest.raises(RemoteConfigError, match="protocol"):
        RemoteConfig.parse(json.dumps({"master_server_address": "a:1", "key_file": "k", "protocol": "udp"}))
    with pytest.raises(RemoteConfigError, match="No such file"):
        RemoteConfig.parse(f"@{tmp_path / 'missing.json'}")
    for bad in (
        {"probe_timeout_ms": "x"},
        {"probe_timeout_ms": None},
        {"write_queue_records": "x"},
        {"write_queue_records": 1.5},
        {"protocol": 3},
    ):
        with pytest.raises(RemoteConfigError, match=f"{next(iter(bad))} must be a"):
            RemoteConfig.parse(json.dumps({"master_server_address": "a:1", "key_file": "k", **bad}))
    (tmp_path / "latin1.json").write_bytes(b"{\xe9}")
    with pytest.raises(RemoteConfigError, match="not UTF-8"):
        RemoteConfig.parse(f"@{tmp_path / 'latin1.json'}")


def test_fleet_key_must_be_private_and_32_bytes(tmp_path):
    path = keygen(tmp_path / "k")
    assert len(load_fleet_key(str(path))) == 32 and (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(FileExistsError):
        keygen(path)  # never overwritten: the fleet shares it
    os.chmod(path, 0o644)
    with pytest.raises(RemoteConfigError, match="readable by others"):
        load_fleet_key(str(path))
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31)
    os.chmod(short, 0o600)
    with pytest.raises(RemoteConfigError, match="exactly 32 bytes"):
        load_fleet_key(str(short))
    with pytest.raises(RemoteConfigError, match="keygen"):
        load_fleet_key(str(tmp_path / "absent"))


# ------------------------------------------------------------------ the store
def test_write_probe_read_round_trip(remote):
    assert write(remote, 100) is True
    assert write(remote, 101, parent=key(100), depth=2) is True
    assert remote.probe([[key(100), key(101), key(102)], [key(102)], []]) == [2, 0, 0]
    out = bytearray(LAYOUT.slot_bytes)
    assert remote.read_into(key(101), memoryview(out)) is ReadResult.OK
    assert bytes(out) == payload(101)
    assert remote.read_into(key(199), memoryview(out)) is ReadResult.MISSING


def test_probe_counts_only_the_leading_run(remote):
    write(remote, 110)
    write(remote, 112)
    assert remote.probe([[key(110), key(111), key(112)]]) == [1]


def test_first_writer_wins(remote):
    assert write(remote, 120, seed=1) is True
    assert write(remote, 120, seed=2) is False  # held already: not sent
    out = bytearray(LAYOUT.slot_bytes)
    assert remote.read_into(key(120), memoryview(out)) is ReadResult.OK and bytes(out) == payload(1)


def test_another_namespace_never_hits(mooncake, fleet_key, remote):
    write(remote, 130)
    other = open_store(mooncake, fleet_key, namespace=NS_B)
    try:
        assert other.probe([[key(130)]]) == [0]
        assert other.read_into(key(130), memoryview(bytearray(LAYOUT.slot_bytes))) is ReadResult.MISSING
    finally:
        other.close()


def test_corrupt_and_foreign_objects_are_refused_and_removed(mooncake, fleet_key, remote):
    untouched = bytes([0xA5]) * LAYOUT.slot_bytes
    out = memoryview(bytearray(untouched))
    # Garbage under a valid object key (as a buggy or hostile client could put).
    assert remote.client.put(remote.object_key(key(140)), os.urandom(remote.codec.record_bytes)) == 0
    assert remote.read_into(key(140), out) is ReadResult.CORRUPT
    assert remote.probe([[key(140)]]) == [0]  # removed: a good write of the key can land now
    # A record of ours with one ciphertext byte flipped, in its header or its payload.
    for i, at in ((141, 30), (146, remote.codec.record_bytes - 100)):
        record = bytearray(remote.build_record(key(i), bytes(16), 1, LAYOUT.chunk_size, payload(i)))
        record[at] ^= 1
        assert remote.client.put(remote.object_key(key(i)), bytes(record)) == 0
        assert remote.read_into(key(i), out) is ReadResult.CORRUPT
    # A record for another key stored under this one.
    assert (
        remote.client.put(
            remote.object_key(key(142)), remote.build_record(key(143), bytes(16), 1, LAYOUT.chunk_size, payload(143))
        )
        == 0
    )
    assert remote.read_into(key(142), out) is ReadResult.CORRUPT
    # An object larger than a record, and a shorter one.
    assert remote.client.put(remote.object_key(key(144)), os.urandom(remote.codec.record_bytes + 64)) == 0
    assert remote.read_into(key(144), out) is ReadResult.CORRUPT
    assert remote.client.put(remote.object_key(key(147)), os.urandom(4096)) == 0
    assert remote.read_into(key(147), out) is ReadResult.CORRUPT
    assert bytes(out) == untouched  # nothing of a refused object reached the slot
    # A record of another namespace copied under this namespace's name of its key.
    other = RemoteChunkStore(remote.config, codec(NS_B, load_fleet_key(remote.config.key_file)))
    assert (
        remote.client.put(
            remote.object_key(key(148)), other.build_record(key(148), bytes(16), 1, LAYOUT.chunk_size, payload(148))
        )
        == 0
    )
    assert remote.read_into(key(148), out) is ReadResult.CORRUPT


def test_stored_objects_hold_no_kv_nor_chunk_keys(remote):
    """Whoever reaches the store reads an object's bytes: they must not hold the host
    slot's KV, nor the chunk or parent key (unkeyed hashes of public inputs, which would
    tell which prompt was served)."""
    marker = b"RECOGNISABLE-KV!"
    kv = (marker + bytes(range(16))) * (LAYOUT.slot_bytes // 32)
    chunk, parent = b"chunk-key-151...", b"parent-key-151.."
    assert remote.write(chunk, remote.build_record(chunk, parent, 2, LAYOUT.chunk_size, kv)) is True
    stored = remote.client.get(remote.object_key(chunk))
    assert len(stored) == remote.codec.record_bytes
    for secret in (marker, kv[40:56], chunk, parent, chunk.hex().encode()):
        assert secret not in stored, f"{secret!r} is readable in the stored object"
    out = bytearray(LAYOUT.slot_bytes)
    assert remote.read_into(chunk, memoryview(out)) is ReadResult.OK and bytes(out) == kv
    assert (remote.last_record.key, remote.last_record.parent_key, remote.last_record.depth) == (chunk, parent, 2)


def test_object_names_are_keyed_hashes(remote):
    """A name is neither the unkeyed chain (``pcr/<namespace>/<chunk key>``) nor computable
    without the fleet key; every server of the fleet computes the same one."""
    name = remote.object_key(key(160))
    assert name != f"pcr/{NS_A.hex()}/{key(160).hex()}"
    assert key(160).hex() not in name and NS_A.hex() not in name
    assert len(name) == len("pcr/") + 64 and int(name[4:], 16) >= 0
    fleet = load_fleet_key(remote.config.key_file)
    same_fleet = RemoteChunkStore(remote.config, codec(NS_A, fleet))
    assert same_fleet.object_key(key(160)) == name  # another server, the same fleet key
    other_fleet = RemoteChunkStore(remote.config, codec(NS_A, os.urandom(32)))
    other_ns = RemoteChunkStore(remote.config, codec(NS_B, fleet))
    assert (
        len({name, other_fleet.object_key(key(160)), other_ns.object_key(key(160)), remote.object_key(key(161))}) == 4
    )


def test_a_bad_object_under_a_good_name_does_not_block_a_good_write(remote):
    """Garbage put first (or a torn record, or one sealed for another key) under a chunk's
    name: the next good write replaces it, and the read serves the good record."""
    out = bytearray(LAYOUT.slot_bytes)
    bad_objects = {
        170: os.urandom(remote.codec.record_bytes),
        171: os.urandom(100),
        172: remote.build_record(key(173), bytes(16), 1, LAYOUT.chunk_size, payload(173)),
    }
    for i, bad in bad_objects.items():
        assert remote.client.put(remote.object_key(key(i)), bad) == 0
        assert write(remote, i) is True, i
        assert remote.read_into(key(i), memoryview(out)) is ReadResult.OK and bytes(out) == payload(i)
    assert write(remote, 170, seed=5) is False  # a good record stays: first writer wins


def test_a_wrong_fleet_key_is_a_miss_never_wrong_kv(mooncake, fleet_key, remote):
    """A record written under another fleet key lives under another name (a miss); its
    bytes copied under our name fail authentication (refused, removed). Either way the
    slot keeps what it held."""
    untouched = bytes([0x5A]) * LAYOUT.slot_bytes
    out = memoryview(bytearray(untouched))
    stranger = open_store(mooncake, fleet_key, mac_key=os.urandom(32))
    try:
        assert write(stranger, 180) is True
        assert remote.probe([[key(180)]]) == [0]
        assert remote.read_into(key(180), out) is ReadResult.MISSING
        copied = stranger.client.get(stranger.object_key(key(180)))
        assert remote.client.put(remote.object_key(key(180)), copied) == 0
        assert remote.read_into(key(180), out) is ReadResult.CORRUPT
        assert remote.probe([[key(180)]]) == [0]  # removed
        assert bytes(out) == untouched
        # And the other way: the stranger never reads ours.
        assert write(remote, 181) is True
        assert stranger.read_into(key(181), out) is ReadResult.MISSING and bytes(out) == untouched
    finally:
        stranger.close()


def test_opening_against_an_unreachable_master_fails_at_once(fleet_key):
    """Mooncake's setup would block about 90 s holding the GIL: the store connects first."""
    config = RemoteConfig.parse(json.dumps({"master_server_address": "127.0.0.1:1", "key_file": str(fleet_key)}))
    store = RemoteChunkStore(config, codec(NS_A, load_fleet_key(str(fleet_key))))
    started = time.monotonic()
    with pytest.raises(RemoteError, match="unreachable"):
        store.open()
    assert time.monotonic() - started < 5


def test_an_unreachable_master_raises(fleet_key, tmp_path):
    master = MooncakeMaster(log_path=tmp_path / "master.log")
    master.start()
    store = open_store(master, fleet_key)
    try:
        assert store.probe([[key(1)]]) == [0]
        master.kill()
        with pytest.raises(RemoteError):
            store.probe([[key(1)]])
        with pytest.raises(RemoteError, match="master does not answer"):
            store.ping()
    finally:
        store.close()
        master.kill()


# ------------------------------------------------------------------ the remote thread
class Harness:
    """A RemoteThread over a real store, answering on a real ZMQ socket, with host slots."""

    def __init__(self, store, faults=None):
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.slots = [bytearray(LAYOUT.slot_bytes) for _ in range(LAYOUT.num_slots)]
        self.thread = RemoteThread(
            store, self.ctx, f"tcp://127.0.0.1:{port}", lambda i: memoryview(self.slots[i]), faults
        )
        self.thread.start()

    def replies(self, want, timeout_s=20.0):
        got, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.pull.poll(100):
                reply = reply_decoder.decode(self.pull.recv())
                got.append(reply)
                if want(got):
                    return got
        raise AssertionError(f"no reply in time; got {got}")


def test_thread_answers_probes_and_reads_and_writes_through(mooncake, fleet_key):
    store = unopened_store(mooncake, fleet_key)  # the thread opens it
    h = Harness(store)
    record = store.build_record(key(200), bytes(16), 1, LAYOUT.chunk_size, payload(200))
    h.thread.write(key(200), record)
    deadline = time.monotonic() + 10
    while h.thread.counters.writes < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    h.thread.probe(ProbeRemote(7, [[key(200), key(201)]]))
    h.thread.read(ReadChunk(seq=9, key=key(200), host_slot=2, urgent=True))
    got = h.replies(lambda g: sum(isinstance(r, (Probed, Done)) for r in g) == 2)
    probed = next(r for r in got if isinstance(r, Probed))
    done = next(r for r in got if isinstance(r, Done))
    assert probed.seq == 7 and probed.present == [1] and probed.error == ""
    assert done.seq == 9 and done.outcome == IoOutcome.OK and done.source == SOURCE_REMOTE
    assert bytes(h.slots[2]) == payload(200)
    status = h.replies(lambda g: any(isinstance(r, RemoteStatus) for r in g), timeout_s=5)[-1]
    assert isinstance(status, RemoteStatus) and status.healthy


def test_thread_breaker_answers_at_once_while_the_store_fails(mooncake, fleet_key):
    h = Harness(unopened_store(mooncake, fleet_key), RemoteFaults(fail=True))
    h.thread.probe(ProbeRemote(1, [[key(1), key(2)]]))
    h.thread.read(ReadChunk(seq=2, key=key(1), host_slot=0))
    got = h.replies(lambda g: sum(isinstance(r, (Probed, Done)) for r in g) == 2, timeout_s=5)
    probed = next(r for r in got if isinstance(r, Probed))
    done = next(r for r in got if isinstance(r, Done))
    assert probed.present == [0] and "test fault" in probed.error
    assert done.outcome == IoOutcome.BAD and "remote tier" in done.error
    assert not h.thread.healthy and h.thread.counters.outages == 1 and h.thread.counters.read_failed == 1
    status = h.replies(lambda g: any(isinstance(r, RemoteStatus) for r in g), timeout_s=5)
    assert not [r for r in status if isinstance(r, RemoteStatus)][-1].healthy


def test_thread_drops_write_through_beyond_its_queue(mooncake, fleet_key):
    store = unopened_store(mooncake, fleet_key, write_queue_records=2)
    # Slow calls, so the queue fills before the thread drains it.
    h = Harness(store, RemoteFaults(delay_s=0.3))
    for i in range(6):
        h.thread.write(key(300 + i), store.build_record(key(300 + i), bytes(16), 1, LAYOUT.chunk_size, payload(i)))
    assert h.thread.counters.writes_dropped >= 3


def test_an_idle_thread_notices_the_store_coming_back(fleet_key, tmp_path):
    """Down with nothing to do, the thread asks the master itself after each back-off:
    once the master and store are back it is healthy again with no request needing it."""
    master = MooncakeMaster(log_path=tmp_path / "master.log")
    store_process = MooncakeStoreProcess(master, 16 << 20, log_path=tmp_path / "store.log")
    master.start()
    store_process.start()
    try:
        config = RemoteConfig.parse(json.dumps(client_config(master, fleet_key)))
        codec = RecordCodec(load_fleet_key(config.key_file), NS_A, LAYOUT, "torch.float32")
        h = Harness(RemoteChunkStore(config, codec))
        h.thread.probe(ProbeRemote(1, [[key(1)]]))
        h.replies(lambda g: any(isinstance(r, Probed) for r in g))
        assert h.thread.healthy
        store_process.kill()
        master.kill()
        h.thread.probe(ProbeRemote(2, [[key(1)]]))
        probed = [r for r in h.replies(lambda g: any(isinstance(r, Probed) for r in g)) if isinstance(r, Probed)]
        assert probed[0].error and not h.thread.healthy
        master.start()
        store_process.start()
        deadline = time.monotonic() + 20
        while not h.thread.healthy and time.monotonic() < deadline:
            time.sleep(0.1)
        assert h.thread.healthy and h.thread.counters.outages == 1
    finally:
        store_process.kill()
        master.kill()
