"""PCR's chunk record: an authenticated header, then one host slot's bytes.

The SSD store's files and the remote tier's objects are the same record, so a chunk
moves between them unchanged and is verified the same way wherever it is read. The
header names the chunk (its key, its parent's key, its depth), the namespace (model,
dtype, layout, TP rank: :mod:`pcr_sglang.core.keys`) and the layout, and carries a keyed
BLAKE3 MAC of the payload; a second MAC covers the header. Whoever holds the MAC key can
write records the others accept; nobody else can (docs/ssd-store.md#permissions-and-trust).

The remote tier stores the same chunk sealed instead (encrypted and authenticated,
:mod:`pcr_sglang.tiers.sealed_records`), under keys :meth:`RecordCodec.derive_key` derives
from the fleet key; a chunk read from there is written to the SSD as this record.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import blake3
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pcr_sglang.tiers.layout import HostChunkLayout

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

MAGIC = b"PCRCHUNK"
FORMAT_VERSION = 2
MAC_BYTES = 16
KEY_BYTES = 32
# magic, version, header bytes, flags, key, parent key, namespace digest, depth,
# num tokens, num layers, chunk size, row bytes, dtype, payload bytes, payload MAC
_FIELDS = struct.Struct("<8sHHI16s16s16sIIIII16sQ16s")
HEADER_BYTES = _FIELDS.size + MAC_BYTES


@dataclass(frozen=True)
class ChunkRecord:
    """A verified header: what the store knows of a chunk without reading its payload."""

    key: bytes
    parent_key: bytes
    depth: int
    num_tokens: int
    payload_bytes: int
    payload_digest: bytes


class RecordCodec:
    """Builds and verifies the records of one namespace and layout under one MAC key."""

    def __init__(self, mac_key: bytes, namespace: bytes, layout: HostChunkLayout, dtype: str):
        if len(mac_key) != KEY_BYTES:
            raise ValueError(f"a record MAC key is {KEY_BYTES} bytes, got {len(mac_key)}")
        if len(namespace) != 16:
            raise ValueError("namespace digest must be 16 bytes")
        self.namespace = namespace
        self.layout = layout
        self.dtype = dtype
        self._secret = mac_key
        self._dtype_field = dtype.encode()[:16].ljust(16, b"\0")
        self._header_key = blake3.blake3(b"pcr-sglang record header", key=mac_key).digest()
        self._payload_key = blake3.blake3(b"pcr-sglang record payload", key=mac_key).digest()
        self.record_bytes = HEADER_BYTES + layout.slot_bytes

    def derive_key(self, purpose: bytes) -> bytes:
        """A 32-byte key for another use of this codec's key (the remote tier's record and
        object-name keys), independent of the MAC keys and of every other ``purpose``:
        HKDF-SHA256 (RFC 5869) with the purpose as its info. Knowing a derived key tells
        nothing of the codec's key nor of the other derived keys."""
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=b"pcr-sglang " + purpose).derive(
            self._secret
        )

    @staticmethod
    def _mac(key: bytes, data: ReadableBuffer) -> bytes:
        return blake3.blake3(data, key=key).digest(MAC_BYTES)

    def header(self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, payload: bytes | memoryview) -> bytes:
        fields = _FIELDS.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            0,
            key,
            parent_key,
            self.namespace,
            depth,
            num_tokens,
            self.layout.num_layers,
            self.layout.chunk_size,
            self.layout.row_bytes,
            self._dtype_field,
            len(payload),
            self._mac(self._payload_key, payload),
        )
        return fields + self._mac(self._header_key, fields)

    def parse_header(self, raw: bytes) -> Optional[ChunkRecord]:
        """The record's header if its MAC verifies and it belongs to this namespace and layout."""
        if (
            len(raw) < HEADER_BYTES
            or self._mac(self._header_key, raw[: _FIELDS.size]) != raw[_FIELDS.size : HEADER_BYTES]
        ):
            return None
        (
            magic,
            version,
            header_bytes,
            _flags,
            key,
            parent_key,
            namespace,
            depth,
            num_tokens,
            num_layers,
            chunk_size,
            row_bytes,
            dtype,
            payload_bytes,
            payload_mac,
        ) = _FIELDS.unpack_from(raw)
        if (
            magic != MAGIC
            or version != FORMAT_VERSION
            or header_bytes != HEADER_BYTES
            or namespace != self.namespace
            or dtype != self._dtype_field
            or (num_layers, chunk_size, row_bytes)
            != (self.layout.num_layers, self.layout.chunk_size, self.layout.row_bytes)
            or payload_bytes != self.layout.slot_bytes
            or depth < 1
        ):
            return None
        return ChunkRecord(key, parent_key, depth, num_tokens, payload_bytes, payload_mac)

    def payload_ok(self, record: ChunkRecord, payload: bytes | memoryview) -> bool:
        return len(payload) == record.payload_bytes and self._mac(self._payload_key, payload) == record.payload_digest


def read_full(f: io.RawIOBase, view: memoryview) -> int:
    """Fill ``view`` unless the file ends first: a short ``readinto`` is legal (NFS, FUSE,
    signals) and is not the end of the file. (The store's reads and its start-up scan both read records through it.)"""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got
