"""The I/O process: executes the scheduler's SSD orders against the store and host pool.

Started by :class:`pcr_sglang.io.client.IOProcess` as ``python -m pcr_sglang.io.worker
CONFIG`` (a msgpack-encoded :class:`~pcr_sglang.io.protocol.WorkerConfig`, hex). It
attaches the host pool's shared memory by name (plain bytes: no torch here, so it starts
in a fraction of a second), opens the store, connects to the scheduler's two IPC
sockets, says hello, and then runs orders one at a time, reads before writes: a read is
for a request that is waiting, a write only makes a chunk durable.

It dies with its scheduler: ``PR_SET_PDEATHSIG`` (SIGKILL when the parent dies, even by
kill -9), plus a check of the parent pid every second for platforms without it.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import msgspec
import zmq

from pcr_sglang.io.protocol import (
    Done,
    Hello,
    Ping,
    ReadChunk,
    Reorder,
    WorkerConfig,
    WriteChunk,
    order_decoder,
    reply_encoder,
)
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_sglang.transfer.layout import HostChunkLayout

logger = logging.getLogger(__name__)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=False)
    # Python < 3.13 would unlink the segment when this process exits: the scheduler owns it.
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        layout = HostChunkLayout(config.num_slots, config.num_layers, config.chunk_size, config.row_bytes)
        self.slot_bytes = layout.slot_bytes
        self.store = ChunkFileStore(config.store_root, bytes.fromhex(config.namespace_hex), layout,
                                    config.dtype, capacity_bytes=None,
                                    low_watermark_bytes=config.reserve_bytes)
        self.shm = _attach(config.shm_name)
        self.ctx = zmq.Context()
        self.orders = self.ctx.socket(zmq.PULL)
        self.orders.connect(config.orders_endpoint)
        self.replies = self.ctx.socket(zmq.PUSH)
        self.replies.setsockopt(zmq.LINGER, 1000)
        self.replies.connect(config.replies_endpoint)

    def slot(self, index: int) -> memoryview:
        start = index * self.slot_bytes
        return self.shm.buf[start:start + self.slot_bytes]

    def execute(self, order) -> Done:
        start = time.perf_counter()
        try:
            if isinstance(order, ReadChunk):
                ok = self.store.read_into(order.key, self.slot(order.host_slot))
                return Done(order.seq, ok, "" if ok else "missing or failed verification",
                            seconds=time.perf_counter() - start)
            if isinstance(order, WriteChunk):
                self.store.write(order.key, order.parent_key, order.depth, order.num_tokens,
                                 self.slot(order.host_slot))
                return Done(order.seq, True, seconds=time.perf_counter() - start)
            return Done(order.seq, True)  # Ping
        except OSError as e:
            return Done(order.seq, False, str(e), e.errno or 0, time.perf_counter() - start)

    def reorder(self, request: Reorder, reads: collections.deque) -> None:
        for order in reads:
            if order.seq == request.target:
                reads.remove(order)
                if request.cancel:
                    self.replies.send(reply_encoder.encode(Done(order.seq, False, "cancelled", cancelled=True)))
                else:
                    reads.appendleft(order)
                return

    def run(self) -> None:
        self.replies.send(reply_encoder.encode(Hello(os.getpid())))
        reads: collections.deque = collections.deque()
        others: collections.deque = collections.deque()
        poller = zmq.Poller()
        poller.register(self.orders, zmq.POLLIN)
        last_parent_check = time.monotonic()
        while True:
            timeout_ms = 0 if (reads or others) else 1000
            if poller.poll(timeout_ms):
                while True:
                    try:
                        raw = self.orders.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    order = order_decoder.decode(raw)
                    if isinstance(order, Reorder):
                        self.reorder(order, reads)
                    elif isinstance(order, ReadChunk) and order.urgent:
                        reads.appendleft(order)
                    else:
                        (reads if isinstance(order, (ReadChunk, Ping)) else others).append(order)
            if reads or others:
                order = reads.popleft() if reads else others.popleft()
                self.replies.send(reply_encoder.encode(self.execute(order)))
            now = time.monotonic()
            if now - last_parent_check > 1.0:
                last_parent_check = now
                if os.getppid() != self.config.parent_pid:
                    return


def main(argv: list[str]) -> int:
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="[pcr-io %(process)d] %(message)s")
    config = msgspec.msgpack.decode(bytes.fromhex(argv[1]), type=WorkerConfig)
    if os.getppid() != config.parent_pid:
        return 0
    Worker(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
