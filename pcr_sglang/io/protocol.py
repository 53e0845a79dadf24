"""The wire between the scheduler and its I/O process (msgpack over ZMQ IPC sockets).

The scheduler owns the tree and every slot; the I/O process only executes orders on
bytes: read chunk ``key`` from the store into host slot ``host_slot`` (from the local SSD,
else from the remote tier when there is one), persist host slot ``host_slot`` as chunk
``key`` (and write it through to the remote tier), delete chunk ``key`` (locally; remote
objects are the remote store's to evict), or ask the remote tier which chunks it holds.
The orders and their outcomes are the core's words (:mod:`pcr_sglang.core.orders`, where
sequence numbers and retries are explained); this module encodes them, and defines the
replies (each read or write completion echoes its order's ``seq`` with a
:class:`~pcr_sglang.core.orders.IoOutcome`; deletes and reorders are not acknowledged) and
the process's start-up configuration.
"""

from __future__ import annotations

from typing import Union

import msgspec

from pcr_sglang.core.orders import Order


class Done(msgspec.Struct, tag="done"):
    seq: int
    outcome: int  # an IoOutcome
    error: str = ""
    errno: int = 0
    seconds: float = 0.0
    source: int = 0  # a read: SOURCE_LOCAL or SOURCE_REMOTE


SOURCE_LOCAL, SOURCE_REMOTE = 0, 1


class Hello(msgspec.Struct, tag="hello"):
    pid: int


class Probed(msgspec.Struct, tag="probed"):
    seq: int
    present: list[int]  # per chain: how many of its first chunks the remote tier holds
    error: str = ""  # why nothing was found ("": the store answered)
    seconds: float = 0.0


class RemoteStatus(msgspec.Struct, tag="remote"):
    """The remote tier as the I/O process sees it, sent when it changes (at most once a
    second): reachable or not, why not, its counters since the process started, and
    ``queued_writes`` and ``queued_reads`` (not started yet)."""

    healthy: bool
    error: str
    counters: dict[str, float]
    pid: int = 0  # the I/O process's: its counters start again from 0 after a restart


Reply = Union[Done, Hello, Probed, RemoteStatus]

order_encoder = msgspec.msgpack.Encoder()
order_decoder = msgspec.msgpack.Decoder(Order)
reply_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(Reply)


class IoProcessConfig(msgspec.Struct):
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
    read_threads: int = 4  # --pcr-ssd-read-threads (same default): reads in flight at once
    # A read running longer than this makes the process exit, to be restarted (the
    # supervisor's own stall timeout, which sees only a process that answers nothing).
    stall_timeout_s: float = 30.0
    remote_config: str = ""  # --pcr-remote-config as JSON (RemoteConfig); "": no remote tier
    # A remote-tier call running longer than this is given up on and its client restarted
    # (io.remote_thread). Above the about 4 s a call to an unreachable master takes to fail
    # (that case is the breaker's) and far above a chunk's transfer; below the stall timeout.
    remote_call_timeout_s: float = 10.0
