"""Remote-tier records rotate their keys: one AES-GCM key never seals more than a bounded
number of records under random nonces, and records of every epoch stay readable (review
N13). No Mooncake needed: the codec alone, with real keys and real AES-GCM."""

from __future__ import annotations

import struct
from collections import Counter

import pytest

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import RecordCodec
from pcr_sglang.tiers.sealed_records import EPOCH_BYTES, SealedRecordCodec

LAYOUT = HostChunkLayout(num_slots=1, num_layers=2, chunk_size=4, row_bytes=32)
NAMESPACE = bytes(range(16))
FLEET_KEY = bytes(range(32, 64))
_EPOCH_AT = struct.calcsize("<8sHH")


def codec(**kwargs) -> SealedRecordCodec:
    return SealedRecordCodec(RecordCodec(FLEET_KEY, NAMESPACE, LAYOUT, "torch.float32"), **kwargs)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> bytes:
    return bytes((i * 13 + j) % 251 for j in range(LAYOUT.slot_bytes))


def epoch_of(record: bytearray) -> bytes:
    return bytes(record[_EPOCH_AT : _EPOCH_AT + EPOCH_BYTES])


def opened(reader: SealedRecordCodec, i: int, record: bytearray) -> bytes | None:
    out = bytearray(LAYOUT.slot_bytes)
    header = reader.open_into(key(i), memoryview(record), memoryview(out))
    return bytes(out) if header is not None else None


def test_no_key_seals_more_than_its_bound_and_every_epoch_stays_readable():
    writer = codec(seals_per_epoch=4)
    records = [writer.seal(key(i), key(i + 100), 1, 4, payload(i)) for i in range(10)]
    per_epoch = Counter(epoch_of(r) for r in records)
    assert sorted(per_epoch.values()) == [2, 4, 4] and writer.epochs_drawn == 3
    reader = codec()  # another server of the fleet: same fleet key, an epoch of its own
    assert all(opened(reader, i, r) == payload(i) for i, r in enumerate(records))
    assert all(opened(writer, i, r) == payload(i) for i, r in enumerate(records))


def test_each_writer_draws_its_own_epoch():
    a, b = codec(), codec()
    ra, rb = a.seal(key(1), key(0), 1, 4, payload(1)), b.seal(key(1), key(0), 1, 4, payload(1))
    assert epoch_of(ra) != epoch_of(rb)
    assert opened(a, 1, rb) == payload(1) and opened(b, 1, ra) == payload(1)


@pytest.mark.parametrize("where", ["epoch", "version"])
def test_a_record_whose_epoch_or_version_was_changed_is_a_miss(where):
    writer = codec()
    record = writer.seal(key(1), key(0), 1, 4, payload(1))
    if where == "epoch":
        record[_EPOCH_AT] ^= 1
    else:
        record[8] = 1  # the format before epochs
    assert opened(codec(), 1, record) is None
