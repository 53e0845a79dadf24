"""RemoteChunkStore: the shared remote tier, PCR's chunk records as objects in Mooncake Store.

Below device, host memory and the local SSD, a fleet of servers shares one Mooncake Store
(a master that places and evicts objects, and store processes that hold them in memory;
``mooncake-transfer-engine``, over TCP or RDMA). Each object is one chunk's record, sealed
(:mod:`pcr_sglang.tiers.sealed_records`): encrypted and authenticated under a key derived
from the key the fleet shares (``key_file``) for its namespace, and named by a keyed hash
of the namespace and chunk key. The namespace covers the model, dtype, layout and TP rank,
the chunk key the prefix, ``extra_key`` and ``cache_salt``, so another model or tenant can
never hit. Mooncake authenticates no client, so a party that reaches the store learns
nothing from names or bytes without the fleet key; an object anyone else wrote, or a torn
one, fails authentication and is refused and recomputed, never served.

The Mooncake client is driven directly (not through SGLang's ``MooncakeStore``, whose
generic ``batch_set`` and ``batch_exists`` tag keys differently). Mooncake places,
replicates and evicts on its own, so a probe's answer is a hint: an object may be gone
when it is read (a miss: the chunk is recomputed). Writes are first-writer-wins: any
server's KV for a prefix is a valid KV for it, but only a record that authenticates counts
as written: a write that finds a bad object under its name replaces it.

Only the I/O process uses this (on its remote thread, :mod:`pcr_sglang.io.remote_thread`):
a call to an unreachable master can block for seconds, and the scheduler never waits.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import socket
import stat
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from pcr_sglang.tiers.records import KEY_BYTES, ChunkRecord, RecordCodec
from pcr_sglang.tiers.sealed_records import NAME_PREFIX, SealedRecordCodec

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

logger = logging.getLogger(__name__)

# Mooncake's ErrorCodes that concern one key, not the store: never a reason to call the
# tier down.
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703  # still being written by another client: a miss for now
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
INVALID_PARAMS = -600  # also what get_into answers for an object larger than the buffer
CONNECT_TIMEOUT_S = 1.0
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


class RemoteConfigError(ValueError):
    """``--pcr-remote-config`` is malformed or names a key file that cannot be used."""


class RemoteError(RuntimeError):
    """The remote store did not answer as it should (unreachable master, transfer failure)."""


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise RemoteConfigError(f"--pcr-remote-config: {name} must be a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise RemoteConfigError(f"--pcr-remote-config: {name} must be >= 0, got {value}")
        return value
    match = _SIZE.match(str(value))
    if match is None:
        raise RemoteConfigError(f"--pcr-remote-config: {name} must be bytes or a size like '64MB', got {value!r}")
    return int(match.group(1)) << (10 * " KMGT".index(match.group(2).upper() or " "))


@dataclass(frozen=True)
class RemoteConfig:
    """``--pcr-remote-config``: JSON, or ``@path`` to a JSON file. Mooncake's client keys
    (as in SGLang's HiCache Mooncake config) plus PCR's own."""

    master_server_address: str  # host:port of mooncake_master
    key_file: str  # 32 bytes, 0600, the same file on every server of the fleet
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"  # or "rdma" (the CUDA build)
    local_hostname: str = "127.0.0.1"
    device_name: str = ""  # RDMA devices, for protocol "rdma"
    # Memory this server contributes to the shared pool. 0 (the default): none, so the
    # objects live in store processes (mooncake_client) and outlive any one server.
    global_segment_size: int = 0
    local_buffer_size: int = 0  # Mooncake's staging buffer; 0: four records (at least 16 MiB)
    probe_timeout_ms: float = 100.0  # a request waits at most this long for its probe
    write_queue_records: int = 16  # write-through records held for the remote thread; more are dropped

    @classmethod
    def parse(cls, text: str) -> RemoteConfig:
        source = "--pcr-remote-config"
        if text.startswith("@"):
            source = text[1:]
            try:
                text = Path(source).read_text()
            except OSError as e:
                raise RemoteConfigError(f"--pcr-remote-config {source}: {e.strerror or e}") from None
            except UnicodeDecodeError:
                raise RemoteConfigError(f"--pcr-remote-config {source} is not UTF-8 text") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise RemoteConfigError(f"{source} is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise RemoteConfigError(f"{source} must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise RemoteConfigError(f"{source}: unknown keys {unknown}; known: {sorted(known)}")
        missing = [k for k in ("master_server_address", "key_file") if not raw.get(k)]
        if missing:
            raise RemoteConfigError(f"{source}: {', '.join(missing)} required")
        for name in ("global_segment_size", "local_buffer_size"):
            if name in raw:
                raw[name] = _size(name, raw[name])
        for f in fields(cls):
            if f.name not in raw or f.name in ("global_segment_size", "local_buffer_size"):
                continue
            value, want = raw[f.name], type(getattr(_DEFAULTS, f.name, ""))
            ok = (
                isinstance(value, str)
                if want is str
                else isinstance(value, (int, float)) and not isinstance(value, bool)
                if want is float
                else isinstance(value, int) and not isinstance(value, bool)
            )
            if not ok:
                raise RemoteConfigError(f"{source}: {f.name} must be a {want.__name__}, got {value!r}")
        config = cls(**raw)
        if config.protocol not in ("tcp", "rdma"):
            raise RemoteConfigError(f"{source}: protocol must be tcp or rdma, got {config.protocol!r}")
        if not config.probe_timeout_ms > 0 or int(config.write_queue_records) < 0:
            raise RemoteConfigError(f"{source}: probe_timeout_ms must be > 0 and write_queue_records >= 0")
        return config

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


_DEFAULTS = RemoteConfig(master_server_address="", key_file="")


def load_fleet_key(path: str) -> bytes:
    """The fleet key, from which the remote records' encryption and object-name keys are
    derived: exactly 32 bytes, in a regular file of ours that nobody else can read (anyone
    who can read it can read every record and forge records every server accepts)."""
    try:
        fd = os.open(path, os.O_RDONLY)  # a symlink is followed; the file it names is checked
    except OSError as e:
        raise RemoteConfigError(
            f"--pcr-remote-config key_file {path}: {e.strerror or e} (create one with "
            f"`python -m pcr_tools.fleet keygen {path}`)"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise RemoteConfigError(f"key_file {path} must be a regular file owned by this user")
        if st.st_mode & 0o077:
            raise RemoteConfigError(
                f"key_file {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it"
            )
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise RemoteConfigError(f"key_file {path} must hold exactly {KEY_BYTES} bytes, it has {len(key)}")
    return key


class ReadResult(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # the store does not hold it (never written, or evicted)
    CORRUPT = "corrupt"  # held, but not a record of ours for this key (removed)


class RemoteChunkStore:
    """One Mooncake client, for one namespace's records. Not thread-safe: one thread uses
    it (:meth:`build_record` excepted: it may run on any thread).

    ``codec`` is the namespace's record codec under the fleet key; the store keeps the
    sealed codec derived from it (``codec.record_bytes``: one object's size)."""

    def __init__(self, config: RemoteConfig, codec: RecordCodec):
        self.config = config
        self.codec = SealedRecordCodec(codec)
        self._client: Any = None
        self._staging: Optional[np.ndarray] = None
        self.last_record: Optional[ChunkRecord] = None  # the header of the last record read_into served

    def open(self) -> None:
        """Connect to the master. Raises RemoteError (RemoteConfigError: not installed)."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RemoteConfigError(
                f"--pcr-remote mooncake needs the Mooncake client "
                f"(pip install mooncake-transfer-engine-non-cuda, or "
                f"mooncake-transfer-engine with CUDA): {e}"
            ) from None
        c = self.config
        self._check_master_reachable()
        buffer = c.local_buffer_size or max(16 << 20, 4 * self.codec.record_bytes)
        client = MooncakeDistributedStore()
        rc = client.setup(
            {
                "local_hostname": c.local_hostname,
                "metadata_server": c.metadata_server,
                "global_segment_size": c.global_segment_size,
                "local_buffer_size": buffer,
                "protocol": c.protocol,
                "rdma_devices": c.device_name,
                "master_server_addr": c.master_server_address,
            }
        )
        if rc != 0:
            client.close()
            raise RemoteError(f"Mooncake client setup against {c.master_server_address} failed (code {rc})")
        staging = np.zeros(self.codec.record_bytes, dtype=np.uint8)
        rc = client.register_buffer(staging.ctypes.data, staging.nbytes)
        if rc != 0:
            client.close()
            raise RemoteError(f"Mooncake register_buffer failed (code {rc})")
        self._client, self._staging = client, staging

    def _check_master_reachable(self) -> None:
        """Mooncake's ``setup`` against an unreachable master blocks for about 90 s while
        holding the GIL (measured), which would stop the I/O process's main loop: connect
        first, with a timeout. (A master dying between the two still costs that wait.)"""
        host, _, port = self.config.master_server_address.rpartition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S):
                pass
        except (OSError, ValueError) as e:
            raise RemoteError(f"the master {self.config.master_server_address} is unreachable: {e}") from None

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None

    def object_key(self, key: bytes) -> str:
        return self.codec.object_name(key)

    @property
    def client(self) -> Any:
        if self._client is None:
            raise RemoteError("the remote store is not open")
        return self._client

    def probe(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """For each chain of chunk keys: how many of its first chunks the store holds
        (one round trip for all of them)."""
        flat = [self.object_key(k) for chain in chains for k in chain]
        if not flat:
            return [0] * len(chains)
        found = self._exist(flat)
        present, start = [], 0
        for chain in chains:
            run = 0
            while run < len(chain) and found[start + run] == 1:
                run += 1
            present.append(run)
            start += len(chain)
        return present

    def read_into(self, key: bytes, out: memoryview) -> ReadResult:
        """Chunk ``key``'s payload into ``out`` (one host slot) if the store holds a valid
        record of it (``out`` is untouched otherwise). Raises RemoteError when the store
        cannot be asked."""
        got = self._fetch(key)
        if got in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return ReadResult.MISSING
        assert self._staging is not None
        record = self.codec.open_into(key, self._staging.data[:got], out)
        if record is None:
            self._remove(key)
            return ReadResult.CORRUPT
        self.last_record = record
        return ReadResult.OK

    def _fetch(self, key: bytes) -> int:
        """Chunk ``key``'s object into the staging buffer: its size (0 for one larger than
        a record: never one of ours), or OBJECT_NOT_FOUND, or REPLICA_IS_NOT_READY (still
        being written). Raises RemoteError when the store cannot be asked."""
        assert self._staging is not None
        staging = self._staging
        name = self.object_key(key)
        got: int = self.client.get_into(name, staging.ctypes.data, staging.nbytes)
        if got in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return got
        if got == INVALID_PARAMS and self.client.get_size(name) > staging.nbytes:
            return 0
        if got < 0:
            raise RemoteError(f"get_into failed (code {got})")
        return min(got, staging.nbytes)

    def _remove(self, key: bytes) -> None:
        """A bad object would be served to nobody and would cost every good write of its
        key a read to find it bad: remove it (best effort)."""
        try:
            self.client.remove(self.object_key(key), True)
        except Exception as e:  # noqa: BLE001 - a failed cleanup leaves a miss, no harm
            logger.warning("PCR remote tier: removing a bad object failed: %s", e)

    def _exist(self, names: list[str]) -> list[int]:
        """``batch_is_exist``: 1 or 0 per object name. Raises RemoteError if any answer is
        an error (or the answers do not match the names)."""
        found: list[int] = self.client.batch_is_exist(names)
        if len(found) != len(names) or any(f < 0 for f in found):
            raise RemoteError(f"batch_is_exist failed (codes {sorted({f for f in found if f < 0})})")
        return found

    def ping(self) -> None:
        """Raise RemoteError unless the master answers a query (Mooncake's own
        ``health_check`` still said healthy here for a master killed moments before)."""
        try:
            self._exist([NAME_PREFIX + "ping"])
        except RemoteError as e:
            raise RemoteError(f"the master does not answer ({e})") from None

    def exists(self, key: bytes) -> bool:
        return self._exist([self.object_key(key)])[0] == 1

    def write(self, key: bytes, record: bytes | bytearray) -> bool:
        """Store ``record`` (complete, built by :meth:`build_record`) unless the store holds
        a valid record of the key already; True when it was sent.

        An object already under the name is read and opened first: one that fails
        authentication (garbage a client without the fleet key put there, a torn or
        another fleet's record) is removed and replaced, so it cannot block the key's good
        writes. One still being written by another client counts as held."""
        # mutant: remote-bad-object-blocks-good-writes
        if self.exists(key) and not self._replace_if_bad(key):
            return False
        rc = self.client.put(self.object_key(key), record)
        if rc in (OBJECT_ALREADY_EXISTS, OBJECT_HAS_LEASE):
            return False  # another server's write of it came first
        if rc != 0:
            raise RemoteError(f"put failed (code {rc})")
        return True

    def _replace_if_bad(self, key: bytes) -> bool:
        """True when the object under ``key``'s name is gone or was bad and has been removed
        (a write may land); False when it holds a valid record or is being written. An
        object that cannot be read (its store process died while the master still lists
        it) is as useless as a bad one: replaced too, and the put says whether the store
        works."""
        try:
            got = self._fetch(key)
        except RemoteError as e:
            logger.info("PCR remote tier: the object of chunk %s cannot be read (%s); replacing it", key.hex(), e)
            self._remove(key)
            return True
        if got in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            return got == OBJECT_NOT_FOUND  # gone since it was seen (evicted), or another client's write
        assert self._staging is not None
        if self.codec.open_into(key, self._staging.data[:got]) is not None:
            return False
        logger.warning("PCR remote tier: the object of chunk %s failed authentication; replacing it", key.hex())
        self._remove(key)
        return True

    def build_record(
        self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, payload: ReadableBuffer
    ) -> bytearray:
        """Chunk ``key``'s sealed object (``payload``: its host slot, copied)."""
        return self.codec.seal(key, parent_key, depth, num_tokens, payload)
