"""The cache state's orders to the I/O process, and how each ended.

:class:`~pcr_sglang.core.residency.CacheState` decides every read, write and delete and
hands them out as these values inside :class:`~pcr_sglang.core.effects.Effects`; the I/O
process executes them on bytes and answers each read and write with an
:class:`IoOutcome`. They are the core's words: :mod:`pcr_sglang.io.protocol` only
encodes them for the wire (msgpack over ZMQ), which is why they are ``msgspec`` Structs
with a tag each, not dataclasses (encoded without a copy into another type).

Reads and writes carry a sequence number, assigned by the cache state (the same on every
TP rank). Executing an order twice has the same effect as once (a read rewrites the same
bytes, a write replaces the record atomically), so orders are safe to retry.
"""

from __future__ import annotations

import enum
from typing import Union

import msgspec

__all__ = ["DeleteChunk", "IoOutcome", "Order", "ProbeRemote", "ReadChunk", "Reorder", "WriteChunk"]


class IoOutcome(enum.IntEnum):
    """How an order ended, ordered so that the minimum over TP ranks is what every rank
    may assume: one rank's bad record makes the chunk bad everywhere, one rank's
    cancellation makes the order cancelled everywhere."""

    PENDING = 0  # not finished (never sent in a reply; used by the TP agreement)
    BAD = 1  # read: the record is missing or fails verification; write: the disk refused it
    CANCELLED = 2  # dropped before it ran, or its I/O process died first
    OK = 3


class ReadChunk(msgspec.Struct, tag="read"):
    seq: int
    key: bytes
    host_slot: int
    urgent: bool = False  # a request waits for it: ahead of every prefetch


class WriteChunk(msgspec.Struct, tag="write"):
    seq: int
    key: bytes
    parent_key: bytes
    depth: int
    num_tokens: int
    host_slot: int


class DeleteChunk(msgspec.Struct, tag="delete"):
    """Remove chunk ``key``'s record (the tree dropped it)."""

    key: bytes


class Reorder(msgspec.Struct, tag="reorder"):
    """For a read ``target`` that has not started: ``cancel`` drops it (its completion
    says cancelled), otherwise it moves to the front (a request now waits for it). A
    started or finished order completes normally."""

    target: int
    cancel: bool


class ProbeRemote(msgspec.Struct, tag="probe"):
    """Which leading chunks of each chain the remote tier holds (one round trip). Answered
    by :class:`Probed` with the same ``seq`` (a counter of its own, not the reads')."""

    seq: int
    chains: list[list[bytes]]


Order = Union[ReadChunk, WriteChunk, DeleteChunk, Reorder, ProbeRemote]
