"""Sealed chunk records: the remote tier's objects, encrypted and authenticated.

Mooncake Store has no authentication: whoever reaches its master and store processes can
list, read, write and remove any object. So what the remote tier puts there must tell such
a party nothing and let it forge nothing:

* The object's name is a keyed BLAKE2b of the namespace and the chunk key under a name key
  derived from the fleet key. Chunk keys are unkeyed hashes of public inputs (model,
  tokens, ``extra_key``, ``cache_salt``), so an unkeyed name would let anyone test whether
  a prompt was served; a keyed one cannot be computed without the fleet key.
* The record (the chunk's key, its parent's key, its depth and token count, then the host
  slot's bytes) is encrypted with AES-256-GCM under a key derived from the fleet key for
  this namespace, with a random 96-bit nonce per record. The associated data binds it to
  its object name, namespace and layout, so a record moved under another name, or read
  with another layout, fails authentication like a forged or torn one.

The AEAD's tag is the record's only authenticator: the SSD record's two BLAKE3 MACs would
authenticate the same bytes again. What stays visible is a record's size (one per layout),
when it is written and read, and a constant format tag. AES-GCM was chosen over
ChaCha20-Poly1305 from ``bench/remote_record_bench.py`` (AES-NI makes it the faster of the
two). Random nonces keep the chance of a repeated nonce below 2^-32 for up to 2^32 records
per namespace key (NIST SP 800-38D's bound).
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import TYPE_CHECKING, Optional

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pcr_sglang.tiers.records import ChunkRecord, RecordCodec

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

SEAL_MAGIC = b"PCRSEAL\0"
SEAL_VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
NAME_PREFIX = "pcr/"
# In clear: magic, version, reserved, nonce.
_PREFIX = struct.Struct("<8sHH12s")
# Encrypted, before the payload: key, parent key, depth, num tokens, payload bytes.
_INNER = struct.Struct("<16s16sIIQ")
# Authenticated, never stored: magic, version, namespace, num layers, chunk size, row bytes, dtype.
_CONTEXT = struct.Struct("<8sH16sIII16s")


class SealedRecordCodec:
    """Seals and opens the remote records of one namespace and layout, under keys derived
    from ``codec``'s key (the fleet key). :meth:`seal` may run on any thread; :meth:`open_into`
    uses one plaintext buffer and must stay on one thread (the remote thread)."""

    def __init__(self, codec: RecordCodec):
        self.namespace = codec.namespace
        self.layout = codec.layout
        self._aead = AESGCM(codec.derive_key(b"remote record key " + codec.namespace))
        self._name_key = codec.derive_key(b"remote object name key")
        self._context = _CONTEXT.pack(SEAL_MAGIC, SEAL_VERSION, codec.namespace, codec.layout.num_layers,
                                      codec.layout.chunk_size, codec.layout.row_bytes,
                                      codec.dtype.encode()[:16].ljust(16, b"\0"))
        self.plaintext_bytes = _INNER.size + codec.layout.slot_bytes
        self.record_bytes = _PREFIX.size + self.plaintext_bytes + TAG_BYTES
        self._plaintext: Optional[np.ndarray] = None  # allocated on first open_into

    def object_name(self, key: bytes) -> str:
        """The object that holds chunk ``key``: computable only with the fleet key."""
        digest = hashlib.blake2b(self.namespace + key, digest_size=32, key=self._name_key,
                                 person=b"pcr-object-name").hexdigest()
        return NAME_PREFIX + digest

    def _associated_data(self, name: str) -> bytes:
        return self._context + name.encode()

    def seal(self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, payload: ReadableBuffer) -> bytearray:
        """The complete object for chunk ``key`` (``payload``: one host slot's bytes, copied),
        encrypted straight into the object's buffer."""
        payload = memoryview(payload).cast("B")
        if len(payload) != self.layout.slot_bytes:
            raise ValueError(f"a chunk's payload is {self.layout.slot_bytes} bytes, got {len(payload)}")
        nonce = os.urandom(NONCE_BYTES)
        plaintext = b"".join((_INNER.pack(key, parent_key, depth, num_tokens, len(payload)), payload))
        record = bytearray(self.record_bytes)
        _PREFIX.pack_into(record, 0, SEAL_MAGIC, SEAL_VERSION, 0, nonce)
        self._aead.encrypt_into(nonce, plaintext, self._associated_data(self.object_name(key)),
                                memoryview(record)[_PREFIX.size:])
        return record

    def open_into(self, key: bytes, raw: memoryview, out: Optional[memoryview] = None) -> Optional[ChunkRecord]:
        """Chunk ``key``'s verified header, its payload copied into ``out`` (None: verify
        only); None (``out`` untouched) unless ``raw`` is a record sealed for this key,
        namespace and layout under this fleet key. The payload is decrypted into a private
        buffer first: AES-GCM writes plaintext before it has checked the tag."""
        if len(raw) != self.record_bytes:
            return None
        magic, version, _reserved, nonce = _PREFIX.unpack_from(raw)
        if magic != SEAL_MAGIC or version != SEAL_VERSION:
            return None
        if self._plaintext is None:
            self._plaintext = np.zeros(self.plaintext_bytes, dtype=np.uint8)
        plaintext = self._plaintext.data  # the array's memoryview
        try:
            self._aead.decrypt_into(nonce, raw[_PREFIX.size:], self._associated_data(self.object_name(key)),
                                    plaintext)
        except InvalidTag:
            return None
        inner_key, parent_key, depth, num_tokens, payload_bytes = _INNER.unpack_from(plaintext)
        if inner_key != key or payload_bytes != self.layout.slot_bytes or depth < 1:
            return None
        if out is not None:
            memoryview(out).cast("B")[:] = plaintext[_INNER.size:]
        # The AEAD tag stands where the SSD record has its payload MAC.
        return ChunkRecord(key, parent_key, depth, num_tokens, payload_bytes, bytes(raw[-TAG_BYTES:]))
