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
  this namespace and an epoch, with a random 96-bit nonce per record. The associated data
  binds it to its object name, namespace and layout, so a record moved under another name,
  or read with another layout, fails authentication like a forged or torn one.

The AEAD's tag is the record's only authenticator: the SSD record's two BLAKE3 MACs would
authenticate the same bytes again. What stays visible is a record's size (one per layout),
when it is written and read, and a constant format tag. AES-GCM was chosen over
ChaCha20-Poly1305 from ``bench/remote_record_bench.py`` (AES-NI makes it the faster of the
two).

Keys rotate: a random nonce is safe under one AES-GCM key only for a bounded number of
records (NIST SP 800-38D: 2^32 keeps the chance of a repeated nonce below 2^-32), and a
namespace's records are written by every server of the fleet, for as long as the fleet
serves those weights, evicted chunks written again. So each writer seals under an epoch of
its own: 16 random bytes, in the record's clear prefix and folded into the HKDF info of the
record key, drawn when the codec is made (each I/O process, each restart) and drawn again
after ``SEALS_PER_EPOCH`` records. No key ever seals more than 2^24 records (a repeated
nonce under one key: below 2^-48), and two writers share a key only if they draw the same
128-bit epoch. A reader derives the key of the epoch a record names (the last
``READ_KEYS_KEPT`` derived are kept), so records of every epoch stay readable; records of
the format before epochs (version 1, a different size) are misses, replaced when written
again.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pcr_sglang.tiers.records import ChunkRecord, RecordCodec

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

SEAL_MAGIC = b"PCRSEAL\0"
SEAL_VERSION = 2  # 1: no epoch (one key per namespace)
NONCE_BYTES = 12
EPOCH_BYTES = 16
TAG_BYTES = 16
NAME_PREFIX = "pcr/"
SEALS_PER_EPOCH = 1 << 24  # records one writer seals under one key before it draws a new epoch
READ_KEYS_KEPT = 256  # epochs' record keys a reader keeps derived
# In clear: magic, version, reserved, epoch, nonce.
_PREFIX = struct.Struct("<8sHH16s12s")
# Encrypted, before the payload: key, parent key, depth, num tokens, payload bytes.
_INNER = struct.Struct("<16s16sIIQ")
# Authenticated, never stored: magic, version, namespace, num layers, chunk size, row bytes, dtype.
_CONTEXT = struct.Struct("<8sH16sIII16s")


class SealedRecordCodec:
    """Seals and opens the remote records of one namespace and layout, under keys derived
    from ``codec``'s key (the fleet key). :meth:`seal` may run on any thread; :meth:`open_into`
    uses one plaintext buffer and must stay on one thread (the remote thread)."""

    def __init__(self, codec: RecordCodec, seals_per_epoch: int = SEALS_PER_EPOCH):
        if seals_per_epoch < 1:
            raise ValueError(f"seals_per_epoch must be positive, got {seals_per_epoch}")
        self.namespace = codec.namespace
        self.layout = codec.layout
        self._codec = codec
        self.seals_per_epoch = seals_per_epoch
        self._seal_lock = threading.Lock()
        self._sealing = self._new_epoch()  # (epoch, its AEAD, records sealed under it)
        self.epochs_drawn = 1
        self._read_keys: OrderedDict[bytes, AESGCM] = OrderedDict()  # open_into's thread only
        self._name_key = codec.derive_key(b"remote object name key")
        self._context = _CONTEXT.pack(
            SEAL_MAGIC,
            SEAL_VERSION,
            codec.namespace,
            codec.layout.num_layers,
            codec.layout.chunk_size,
            codec.layout.row_bytes,
            codec.dtype.encode()[:16].ljust(16, b"\0"),
        )
        self.plaintext_bytes = _INNER.size + codec.layout.slot_bytes
        self.record_bytes = _PREFIX.size + self.plaintext_bytes + TAG_BYTES
        self._plaintext: Optional[np.ndarray] = None  # allocated on first open_into

    def object_name(self, key: bytes) -> str:
        """The object that holds chunk ``key``: computable only with the fleet key."""
        digest = hashlib.blake2b(
            self.namespace + key, digest_size=32, key=self._name_key, person=b"pcr-object-name"
        ).hexdigest()
        return NAME_PREFIX + digest

    def _associated_data(self, name: str) -> bytes:
        return self._context + name.encode()

    def _record_key(self, epoch: bytes) -> AESGCM:
        return AESGCM(self._codec.derive_key(b"remote record key " + self.namespace + b" epoch " + epoch))

    def _new_epoch(self) -> tuple[bytes, AESGCM, list[int]]:
        epoch = os.urandom(EPOCH_BYTES)
        return epoch, self._record_key(epoch), [0]

    def _epoch_for_one_seal(self) -> tuple[bytes, AESGCM]:
        """The epoch and key the next record is sealed under, counted: a key that has
        sealed ``seals_per_epoch`` records is never used again."""
        with self._seal_lock:
            epoch, aead, sealed = self._sealing
            # mutant: remote-record-key-never-rotates
            if sealed[0] >= self.seals_per_epoch:
                self._sealing = epoch, aead, sealed = self._new_epoch()
                self.epochs_drawn += 1
            sealed[0] += 1
            return epoch, aead

    def _opening_key(self, epoch: bytes) -> AESGCM:
        aead = self._read_keys.get(epoch)
        if aead is None:
            aead = self._read_keys[epoch] = self._record_key(epoch)
            if len(self._read_keys) > READ_KEYS_KEPT:
                self._read_keys.popitem(last=False)
        else:
            self._read_keys.move_to_end(epoch)
        return aead

    def seal(self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, payload: ReadableBuffer) -> bytearray:
        """The complete object for chunk ``key`` (``payload``: one host slot's bytes, copied),
        encrypted straight into the object's buffer."""
        payload = memoryview(payload).cast("B")
        if len(payload) != self.layout.slot_bytes:
            raise ValueError(f"a chunk's payload is {self.layout.slot_bytes} bytes, got {len(payload)}")
        epoch, aead = self._epoch_for_one_seal()
        nonce = os.urandom(NONCE_BYTES)
        plaintext = b"".join((_INNER.pack(key, parent_key, depth, num_tokens, len(payload)), payload))
        record = bytearray(self.record_bytes)
        _PREFIX.pack_into(record, 0, SEAL_MAGIC, SEAL_VERSION, 0, epoch, nonce)
        aead.encrypt_into(
            nonce, plaintext, self._associated_data(self.object_name(key)), memoryview(record)[_PREFIX.size :]
        )
        return record

    def open_into(self, key: bytes, raw: memoryview, out: Optional[memoryview] = None) -> Optional[ChunkRecord]:
        """Chunk ``key``'s verified header, its payload copied into ``out`` (None: verify
        only); None (``out`` untouched) unless ``raw`` is a record sealed for this key,
        namespace and layout under this fleet key. The payload is decrypted into a private
        buffer first: AES-GCM writes plaintext before it has checked the tag."""
        if len(raw) != self.record_bytes:
            return None
        magic, version, _reserved, epoch, nonce = _PREFIX.unpack_from(raw)
        if magic != SEAL_MAGIC or version != SEAL_VERSION:
            return None
        if self._plaintext is None:
            self._plaintext = np.zeros(self.plaintext_bytes, dtype=np.uint8)
        plaintext = self._plaintext.data  # the array's memoryview
        try:
            # mutant: remote-record-opened-under-the-readers-epoch
            self._opening_key(epoch).decrypt_into(
                nonce, raw[_PREFIX.size :], self._associated_data(self.object_name(key)), plaintext
            )
        except InvalidTag:
            return None
        inner_key, parent_key, depth, num_tokens, payload_bytes = _INNER.unpack_from(plaintext)
        if inner_key != key or payload_bytes != self.layout.slot_bytes or depth < 1:
            return None
        if out is not None:
            memoryview(out).cast("B")[:] = plaintext[_INNER.size :]
        # The AEAD tag stands where the SSD record has its payload MAC.
        return ChunkRecord(key, parent_key, depth, num_tokens, payload_bytes, bytes(raw[-TAG_BYTES:]))
