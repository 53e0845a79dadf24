"""The scheduler's side of the I/O process: start it, send orders, collect completions,
and supervise it.

One I/O process per scheduler (TP rank). The two ZMQ IPC sockets live in a private
runtime directory (0700); the scheduler binds them, so a restarted process reconnects to
the same endpoints. Orders are remembered until their completion arrives; when the
process dies or stops answering (an order older than ``stall_timeout_s`` with nothing
heard meanwhile), it is killed before anything else happens (so it can never write into
a slot the scheduler frees), every outstanding order is returned to the caller as
cancelled, and a new process is started after a back-off (1 s, doubling to 30 s).
Meanwhile the caller serves without the SSD tier.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

import msgspec
import zmq

from pcr_sglang.io.protocol import (
    Done,
    Hello,
    Order,
    Ping,
    ReadChunk,
    Reorder,
    WorkerConfig,
    WriteChunk,
    order_encoder,
    reply_decoder,
)

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    order: Order
    handle: Any
    submitted: float


@dataclass
class Completion:
    order: Order
    handle: Any
    done: Optional[Done]  # None: cancelled (the process failed before completing it)

    @property
    def ok(self) -> bool:
        return self.done is not None and self.done.ok


class IOProcess:
    def __init__(self, config: WorkerConfig, *, stall_timeout_s: float = 30.0,
                 startup_timeout_s: float = 60.0):
        self._runtime_dir = tempfile.mkdtemp(prefix="pcr-io-")
        os.chmod(self._runtime_dir, 0o700)
        self.config = msgspec.structs.replace(
            config,
            orders_endpoint=f"ipc://{self._runtime_dir}/orders",
            replies_endpoint=f"ipc://{self._runtime_dir}/replies",
            parent_pid=os.getpid(),
        )
        self.stall_timeout_s = stall_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._ctx = zmq.Context()
        self._orders = self._ctx.socket(zmq.PUSH)
        self._orders.setsockopt(zmq.LINGER, 0)
        self._orders.bind(self.config.orders_endpoint)
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(self.config.replies_endpoint)
        self._seq = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._completed: list[Completion] = []
        self._proc: Optional[subprocess.Popen] = None
        self._ready = False
        self._started_at = 0.0
        self._last_heard = 0.0
        self._backoff_s = 1.0
        self._restart_at: Optional[float] = None
        self.restarts = 0
        self.failures = 0
        self._spawn()

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self) -> None:
        env = dict(os.environ)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pcr_sglang.io.worker", msgspec.msgpack.encode(self.config).hex()],
            env=env, stdin=subprocess.DEVNULL,
        )
        self._ready = False
        self._started_at = self._last_heard = time.monotonic()
        self._restart_at = None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def healthy(self) -> bool:
        """Started, said hello, and not known to be dead."""
        return self._proc is not None and self._ready and self._proc.poll() is None

    def wait_ready(self, timeout_s: Optional[float] = None) -> bool:
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        while not self._ready and time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            self._receive(timeout_ms=50)
        return self._ready

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None
        self._orders.close()
        self._replies.close()
        self._ctx.term()
        shutil.rmtree(self._runtime_dir, ignore_errors=True)

    # ------------------------------------------------------------------ orders
    def submit_read(self, key: bytes, host_slot: int, handle: Any = None, urgent: bool = False) -> Optional[int]:
        return self._submit(ReadChunk(next(self._seq), key, host_slot, urgent), handle)

    def cancel(self, seq: int) -> None:
        """Ask the process to drop read ``seq`` if it has not started (best effort: the
        order's completion, cancelled or not, still arrives)."""
        self._reorder(seq, cancel=True)

    def expedite(self, seq: int) -> None:
        """Ask the process to run read ``seq`` next if it has not started."""
        self._reorder(seq, cancel=False)

    def _reorder(self, seq: int, cancel: bool) -> None:
        if self.healthy and seq in self._pending:
            try:
                self._orders.send(order_encoder.encode(Reorder(next(self._seq), seq, cancel)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def submit_write(self, key: bytes, parent_key: bytes, depth: int, num_tokens: int, host_slot: int,
                     handle: Any = None) -> Optional[int]:
        return self._submit(WriteChunk(next(self._seq), key, parent_key, depth, num_tokens, host_slot), handle)

    def _submit(self, order: Order, handle: Any) -> Optional[int]:
        """Send ``order``; None when the process is not healthy (the caller falls back)."""
        if not self.healthy:
            return None
        try:
            self._orders.send(order_encoder.encode(order), zmq.NOBLOCK)
        except zmq.ZMQError:
            return None
        self._pending[order.seq] = Pending(order, handle, time.monotonic())
        return order.seq

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def is_pending(self, seq: int) -> bool:
        return seq in self._pending

    # ------------------------------------------------------------------ completions
    def _receive(self, timeout_ms: int) -> None:
        if not self._replies.poll(timeout_ms):
            return
        while True:
            try:
                raw = self._replies.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = reply_decoder.decode(raw)
            self._last_heard = time.monotonic()
            if isinstance(reply, Hello):
                if self._proc is not None and reply.pid == self._proc.pid:
                    self._ready = True
                    self._backoff_s = 1.0
                continue
            pending = self._pending.pop(reply.seq, None)
            if pending is not None:  # else: an order cancelled by a restart
                self._completed.append(Completion(pending.order, pending.handle, reply))

    def poll(self) -> list[Completion]:
        """Completions since the last call (without waiting), after a health check: a
        failed process's outstanding orders come back cancelled."""
        self._receive(timeout_ms=0)
        self._check_health()
        completed, self._completed = self._completed, []
        return completed

    def wait(self, seq: int, timeout_s: float) -> bool:
        """Wait until order ``seq`` completed (or was cancelled); False on timeout. The
        completion itself is delivered by the next :meth:`poll`."""
        deadline = time.monotonic() + timeout_s
        while seq in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._receive(timeout_ms=min(int(remaining * 1000) + 1, 100))
            self._check_health()
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            self._receive(timeout_ms=50)
            self._check_health()
        return not self._pending

    def ping(self, timeout_s: float = 5.0) -> bool:
        seq = self._submit(Ping(next(self._seq)), None)
        return seq is not None and self.wait(seq, timeout_s) and self.healthy

    # ------------------------------------------------------------------ supervision
    def _check_health(self) -> None:
        now = time.monotonic()
        if self._proc is None:
            if self._restart_at is not None and now >= self._restart_at:
                self.restarts += 1
                logger.warning("PCR I/O process: restarting (attempt %d)", self.restarts)
                self._spawn()
            return
        dead = self._proc.poll() is not None
        stalled = False
        if not dead and self._pending:
            oldest = min(p.submitted for p in self._pending.values())
            stalled = now - max(oldest, self._last_heard) > self.stall_timeout_s
        never_ready = not self._ready and now - self._started_at > self.startup_timeout_s
        if dead or stalled or never_ready:
            why = ("exited with code %s" % self._proc.returncode if dead
                   else "stopped answering" if stalled else "did not start")
            self.fail(why)

    def fail(self, why: str) -> None:
        """Kill the process now; its outstanding orders come back cancelled."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()  # before any slot it may still write is reused
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                # Stuck in the kernel (e.g. uninterruptible disk I/O): its orders and the
                # slots they name stay reserved until it is really gone (next check).
                logger.error("PCR I/O process %d does not die after SIGKILL; retrying", proc.pid)
                return
        self.failures += 1
        self._proc = None
        cancelled = [Completion(p.order, p.handle, None) for p in self._pending.values()]
        self._pending = {}
        self._completed.extend(cancelled)
        self._ready = False
        self._restart_at = time.monotonic() + self._backoff_s
        logger.warning(
            "PCR I/O process %s; serving without the SSD tier, %d orders cancelled; restart in %.0f s",
            why, len(cancelled), self._backoff_s,
        )
        self._backoff_s = min(self._backoff_s * 2, 30.0)
