"""Messages between the scheduler and its I/O process (msgpack over ZMQ IPC sockets).

The scheduler owns the tree and every slot; the I/O process only executes orders on
bytes: read chunk ``key`` from the store into host slot ``host_slot``, persist host slot
``host_slot`` as chunk ``key``, or delete chunk ``key``. Reads and writes carry a
sequence number, assigned by the scheduler's cache state (the same on every TP rank),
and each completion echoes it with an :class:`IoOutcome`. Deletes and reorders are not
acknowledged. Executing an order twice has the same effect as once (a read rewrites the
same bytes, a write replaces the record atomically), so orders are safe to retry.
"""

from __future__ import annotations

import enum
from typing import Union

import msgspec


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


Order = Union[ReadChunk, WriteChunk, DeleteChunk, Reorder]


class Done(msgspec.Struct, tag="done"):
    seq: int
    outcome: int  # an IoOutcome
    error: str = ""
    errno: int = 0
    seconds: float = 0.0


class Hello(msgspec.Struct, tag="hello"):
    pid: int


Reply = Union[Done, Hello]

order_encoder = msgspec.msgpack.Encoder()
order_decoder = msgspec.msgpack.Decoder(Order)
reply_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(Reply)


class WorkerConfig(msgspec.Struct):
    """Everything the I/O process needs to open the store and attach the host pool."""

    store_root: str
    namespace_hex: str
    dtype: str
    num_slots: int
    num_layers: int
    chunk_size: int
    row_bytes: int
    reserve_bytes: int
    shm_name: str
    orders_endpoint: str
    replies_endpoint: str
    parent_pid: int
    tp_rank: int = 0  # which rank's process this is (logs, and the test fault knob)
    # The scheduler's writer slot in the store, whose lease descriptor ``lease_fd`` the I/O
    # process inherits (so the lease lives while either process lives); "": take one.
    writer_slot: str = ""
    lease_fd: int = -1
    durability: str = "record"  # --pcr-ssd-durability
