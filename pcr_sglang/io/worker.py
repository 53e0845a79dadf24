"""The I/O process: executes the scheduler's SSD orders against the store and host pool.

Started by :class:`pcr_sglang.io.supervisor.IOSupervisor` as ``python -m
pcr_sglang.io.worker CONFIG`` (a msgpack-encoded
:class:`~pcr_sglang.io.protocol.WorkerConfig`, hex). It attaches the host pool's shared
memory by name (plain bytes: no torch here, so it starts in a fraction of a second),
opens the store, connects to the scheduler's two IPC sockets, says hello, and then runs
orders one at a time: urgent reads first (a request waits for them), then prefetch reads
and deletes, then writes (a write only makes a chunk durable).

It dies with its scheduler: it checks its parent pid at least once a second and exits
when the parent is gone (even after kill -9). ``PR_SET_PDEATHSIG`` is not used: Linux
sends that signal when the parent *thread* that spawned the process exits, which would
kill the I/O process whenever a helper thread built the cache.

Test knob: ``PCR_IO_TEST_FAULTS`` (JSON, e.g. ``{"tp_ranks": [1], "read_delay_s": 2}``,
``{"fail_reads": true}`` or ``{"fail_writes": true}``) makes the processes of the listed
TP ranks (all ranks when absent) delay or fail their reads, or fail their writes as a
full disk would, so tests can make one rank's reads arrive late or fail. It is read once
at start and logged; never set it in production.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import msgspec
import zmq

from pcr_sglang.io.protocol import (
    DeleteChunk,
    Done,
    Hello,
    IoOutcome,
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

FAULTS_ENV = "PCR_IO_TEST_FAULTS"


@dataclass(frozen=True)
class TestFaults:
    read_delay_s: float = 0.0
    fail_reads: bool = False
    fail_writes: bool = False

    @classmethod
    def from_env(cls, tp_rank: int) -> Optional[TestFaults]:
        text = os.environ.get(FAULTS_ENV)
        if not text:
            return None
        spec = json.loads(text)
        ranks = spec.get("tp_ranks")
        if ranks is not None and tp_rank not in ranks:
            return None
        faults = cls(float(spec.get("read_delay_s", 0.0)), bool(spec.get("fail_reads", False)),
                     bool(spec.get("fail_writes", False)))
        logger.warning("PCR I/O process of TP rank %d: test faults %s (%s)", tp_rank, faults, FAULTS_ENV)
        return faults


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
        self.faults = TestFaults.from_env(config.tp_rank)
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

    def execute(self, order) -> Optional[Done]:
        start = time.perf_counter()
        try:
            if isinstance(order, ReadChunk):
                if self.faults is not None:
                    time.sleep(self.faults.read_delay_s)
                    if self.faults.fail_reads:
                        return Done(order.seq, IoOutcome.BAD, "test fault", seconds=time.perf_counter() - start)
                ok = self.store.read_into(order.key, self.slot(order.host_slot))
                return Done(order.seq, IoOutcome.OK if ok else IoOutcome.BAD,
                            "" if ok else "missing or failed verification", seconds=time.perf_counter() - start)
            if isinstance(order, WriteChunk):
                if self.faults is not None and self.faults.fail_writes:
                    raise OSError(errno.ENOSPC, "test fault: no space left on device")
                self.store.write(order.key, order.parent_key, order.depth, order.num_tokens,
                                 self.slot(order.host_slot))
                return Done(order.seq, IoOutcome.OK, seconds=time.perf_counter() - start)
            self.store.delete(order.key)  # DeleteChunk: not acknowledged
            return None
        except OSError as e:
            if isinstance(order, DeleteChunk):
                return None
            return Done(order.seq, IoOutcome.BAD, str(e), e.errno or 0, time.perf_counter() - start)

    def reorder(self, request: Reorder, urgent: collections.deque, reads: collections.deque) -> None:
        for order in reads:
            if isinstance(order, ReadChunk) and order.seq == request.target:
                reads.remove(order)
                if request.cancel:
                    self.replies.send(reply_encoder.encode(Done(order.seq, IoOutcome.CANCELLED, "cancelled")))
                else:
                    urgent.append(order)
                return

    def run(self) -> None:
        self.replies.send(reply_encoder.encode(Hello(os.getpid())))
        urgent: collections.deque = collections.deque()  # reads a request waits for, in order
        reads: collections.deque = collections.deque()  # prefetch reads and deletes
        writes: collections.deque = collections.deque()
        queues = (urgent, reads, writes)
        poller = zmq.Poller()
        poller.register(self.orders, zmq.POLLIN)
        last_parent_check = time.monotonic()
        while True:
            timeout_ms = 0 if any(queues) else 1000
            if poller.poll(timeout_ms):
                while True:
                    try:
                        raw = self.orders.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    order = order_decoder.decode(raw)
                    if isinstance(order, Reorder):
                        self.reorder(order, urgent, reads)
                    elif isinstance(order, ReadChunk):
                        (urgent if order.urgent else reads).append(order)
                    else:
                        (writes if isinstance(order, WriteChunk) else reads).append(order)
            queue = next((q for q in queues if q), None)
            if queue is not None:
                done = self.execute(queue.popleft())
                if done is not None:
                    self.replies.send(reply_encoder.encode(done))
            now = time.monotonic()
            if now - last_parent_check > 1.0:
                last_parent_check = now
                if os.getppid() != self.config.parent_pid:
                    return


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="[pcr-io %(process)d] %(message)s")
    config = msgspec.msgpack.decode(bytes.fromhex(argv[1]), type=WorkerConfig)
    if os.getppid() != config.parent_pid:
        return 0
    Worker(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
