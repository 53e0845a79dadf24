"""Chunk identity: a hash chain over fixed-size token chunks.

KV is position- and prefix-dependent, so a chunk's identity is its own tokens *and*
everything before it: ``key_i = H(key_{i-1}, tokens_i)``. The chain starts at a root key
that folds in the cache namespace's chain digest (model fingerprint, KV dtype, the
numerics flags, layout, chunk size) and the request's own namespace (the client's
``extra_key``, its ``cache_salt`` and its LoRA adapter, as separate fields:
:class:`RequestTenant`), so two models, adapters or tenants never share a chain. The TP
rank is not in the chain: every rank of a tensor-parallel server names a chunk by the same
key (which is how the ranks agree on what their SSD stores hold); each rank's share of the
KV bytes lives under its own store namespace (:meth:`CacheNamespace.digest`).

Keys are 128-bit BLAKE2b digests: at a billion chunks the collision probability is below
1e-20, which is why the tree does not also store and compare every chunk's tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

ChunkKey = bytes
KEY_BYTES = 16
# The parent key a record names for a first chunk (its parent is the root); the SSD
# record format depends on it.
NO_PARENT: ChunkKey = bytes(KEY_BYTES)
_TOKEN_TYPECODE = "q"  # tokens hashed as little-endian int64, whatever the input type


@dataclass(frozen=True)
class CacheNamespace:
    """Everything that makes two KV caches of the same tokens different bytes.

    ``model_fingerprint`` is the weights' identity (config and weight files), ``kv_dtype``
    the KV pool's storage dtype, and ``numerics`` every other setting that changes the KV
    values computed from the same weights (activation dtype, quantization, the KV recipe,
    ...), as canonical text; the adapter decides what goes into both strings.
    """

    model_fingerprint: str
    kv_dtype: str
    chunk_size: int
    layout: str = "token-major"
    tp_rank: int = 0
    tp_size: int = 1
    numerics: str = ""

    def digest(self) -> bytes:
        """The namespace of this rank's KV bytes (the SSD store's directory)."""
        text = "|".join(["pcr-ns-v3", self.chain_digest().hex(), f"{self.tp_rank}/{self.tp_size}"])
        return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()

    def chain_digest(self) -> bytes:
        """What chunk keys fold in: the same on every TP rank of a server."""
        # v3: ``numerics`` joined the chain and the fingerprint reads the weights' tensors,
        # so no store or key of the v2 scheme is ever matched again.
        text = "|".join(
            ["pcr-chain-v3", self.model_fingerprint, self.kv_dtype, str(self.chunk_size), self.layout, self.numerics]
        )
        return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def root_key(
    namespace_digest: bytes,
    extra_key: Optional[str] = None,
    cache_salt: Optional[str] = None,
    lora_id: Optional[str] = None,
) -> ChunkKey:
    """Key of the (virtual) parent of a request's first chunk.

    ``extra_key`` is the client's own, ``lora_id`` the adapter the server runs the request
    with: separate fields, because the client chooses the first and not the second (SGLang
    concatenates them, with no separator, into one ``extra_key``; a client without an
    adapter could then name an adapter's chains)."""
    h = hashlib.blake2b(namespace_digest, digest_size=KEY_BYTES)
    # Length-prefix each optional field so ("ab", None) and ("a", "b") differ.
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            data = part.encode()
            h.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    if lora_id is not None:  # absent: the bytes (and so the keys) of a request without an adapter
        data = lora_id.encode()
        h.update(b"\x02" + len(data).to_bytes(8, "little") + data)
    return h.digest()


@dataclass(frozen=True)
class RequestTenant:
    """A request's own namespace inside the server's, as the separate fields its root key
    folds in: the client's ``extra_key``, its ``cache_salt``, and the LoRA adapter the
    server runs it with (None: the base model)."""

    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
    lora_id: Optional[str] = None


def _as_int64_array(tokens: Sequence[int]) -> array[int]:
    if isinstance(tokens, array) and tokens.typecode == _TOKEN_TYPECODE:
        return tokens
    return array(_TOKEN_TYPECODE, tokens)


def chunk_key(parent: ChunkKey, chunk_tokens: Sequence[int]) -> ChunkKey:
    data = _as_int64_array(chunk_tokens).tobytes()
    return hashlib.blake2b(parent + data, digest_size=KEY_BYTES).digest()


def iter_chunk_keys(root: ChunkKey, tokens: Sequence[int], chunk_size: int) -> Iterator[ChunkKey]:
    """Lazily yield the key of every whole chunk of ``tokens``; a partial tail is skipped.

    Lazy so a match can stop hashing at its first miss: the cost of a lookup is
    proportional to the chunks it matches, not to the prompt.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = _as_int64_array(tokens)
    parent = root
    for start in range(0, len(data) - chunk_size + 1, chunk_size):
        parent = chunk_key(parent, data[start : start + chunk_size])
        yield parent


def chunk_keys(root: ChunkKey, tokens: Sequence[int], chunk_size: int) -> list[ChunkKey]:
    return list(iter_chunk_keys(root, tokens, chunk_size))


class ChainKeyer:
    r"""The one object that turns a request's tokens into chunk keys.

    It holds the server's chain digest (:meth:`CacheNamespace.chain_digest`) and chunk size;
    the prefix cache, the scheduler side, document reuse and KV hints all derive keys
    through the same instance, so no two places can hash one chunk two ways. A weight
    update in place :meth:`rekey`\ s it: every key derived after that differs from every
    key derived before, on every tier.
    """

    def __init__(self, chain_digest: bytes, chunk_size: int):
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chain_digest = chain_digest
        self.chunk_size = chunk_size

    def root(
        self, extra_key: Optional[str] = None, cache_salt: Optional[str] = None, lora_id: Optional[str] = None
    ) -> ChunkKey:
        """The root a request's chain starts from: the namespace and its tenant."""
        return root_key(self.chain_digest, extra_key, cache_salt, lora_id)

    def iter_keys(
        self,
        tokens: Sequence[int],
        extra_key: Optional[str] = None,
        cache_salt: Optional[str] = None,
        lora_id: Optional[str] = None,
    ) -> Iterator[ChunkKey]:
        """The keys of ``tokens``' whole chunks, lazily (a match stops at its first miss)."""
        return iter_chunk_keys(self.root(extra_key, cache_salt, lora_id), tokens, self.chunk_size)

    def keys(
        self,
        tokens: Sequence[int],
        extra_key: Optional[str] = None,
        cache_salt: Optional[str] = None,
        lora_id: Optional[str] = None,
    ) -> list[ChunkKey]:
        return list(self.iter_keys(tokens, extra_key, cache_salt, lora_id))

    def request_root(self, tenant: RequestTenant) -> ChunkKey:
        return self.root(tenant.extra_key, tenant.cache_salt, tenant.lora_id)

    def request_keys(self, tokens: Sequence[int], tenant: RequestTenant) -> list[ChunkKey]:
        return self.keys(tokens, tenant.extra_key, tenant.cache_salt, tenant.lora_id)

    def iter_request_keys(self, tokens: Sequence[int], tenant: RequestTenant) -> Iterator[ChunkKey]:
        return self.iter_keys(tokens, tenant.extra_key, tenant.cache_salt, tenant.lora_id)

    def rekey(self, chain_digest: bytes) -> None:
        self.chain_digest = chain_digest
