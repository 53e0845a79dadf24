"""Messages between the scheduler and its I/O process (msgpack over ZMQ IPC sockets).

The scheduler owns the tree and every slot; the I/O process only executes orders on
bytes: read chunk ``key`` from the store into host slot ``host_slot``, or persist host
slot ``host_slot`` as chunk ``key``. Each order carries a sequence number and each
completion echoes it, so a completion from an order the scheduler has since cancelled
(the process was restarted) is recognised and ignored. Executing an order twice has
the same effect as once (a read rewrites the same bytes, a write replaces the record
atomically), so orders are safe to retry.
"""

from __future__ import annotations

from typing import Union

import msgspec


class ReadChunk(msgspec.Struct, tag="read"):
    seq: int
    key: bytes
    host_slot: int
    urgent: bool = False  # a scheduled request waits for it: ahead of every prefetch


class WriteChunk(msgspec.Struct, tag="write"):
    seq: int
    key: bytes
    parent_key: bytes
    depth: int
    num_tokens: int
    host_slot: int


class Ping(msgspec.Struct, tag="ping"):
    seq: int


class Reorder(msgspec.Struct, tag="reorder"):
    """For a read ``target`` that has not started: ``cancel`` drops it (its completion
    says ``cancelled``), otherwise it moves to the front (a request now waits for it).
    A started or finished order completes normally."""

    seq: int
    target: int
    cancel: bool


Order = Union[ReadChunk, WriteChunk, Ping, Reorder]


class Done(msgspec.Struct, tag="done"):
    seq: int
    ok: bool
    error: str = ""
    errno: int = 0
    seconds: float = 0.0
    cancelled: bool = False


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
