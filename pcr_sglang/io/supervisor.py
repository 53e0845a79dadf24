"""IOSupervisor: start the I/O process, track its orders, and replace it when it fails,
without ever making the scheduler wait.

One I/O process per scheduler (TP rank). Reads and writes are tracked by sequence
number until their completion arrives. When the process exits (as it does itself when
one of its reads has run longer than ``stall_timeout_s``: its other reader threads may
still answer), stops answering (an order older than ``stall_timeout_s`` with nothing
heard meanwhile) or never says hello,
it is sent SIGKILL, and its outstanding orders stay outstanding until the kernel
confirms it is gone (a process stuck in uninterruptible disk I/O keeps their host slots
reserved, so it can never write into a slot that was reused); then they come back
cancelled, and a new process starts after a back-off (1 s, doubling to 30 s). Orders
submitted while there is no healthy process come back cancelled at the next
:meth:`poll`. Every call returns at once: nothing here waits on the process, except
:meth:`wait_ready` at startup and :meth:`close` at shutdown.
"""

from __future__ import annotations

import enum
import logging
import os
import subprocess
import sys
import time
from typing import Optional

import msgspec

from pcr_sglang.core.orders import IoOutcome, Order, ReadChunk, WriteChunk
from pcr_sglang.io.client import IOChannel
from pcr_sglang.io.protocol import SOURCE_REMOTE, Done, Hello, IoProcessConfig, Probed, RemoteStatus

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


class _Phase(enum.Enum):
    STARTING = "starting"  # spawned, no hello yet
    READY = "ready"
    DYING = "dying"  # killed, exit not confirmed yet
    DOWN = "down"  # gone; restarts at _restart_at


Outcome = tuple[int, IoOutcome, float]


class IOSupervisor:
    def __init__(
        self,
        config: IoProcessConfig,
        *,
        stall_timeout_s: float = 30.0,
        startup_timeout_s: float = 60.0,
        exit_wait_s: float = 10.0,
    ):
        self._channel = IOChannel()
        self.config = msgspec.structs.replace(
            config,
            orders_endpoint=self._channel.orders_endpoint,
            replies_endpoint=self._channel.replies_endpoint,
            parent_pid=os.getpid(),
            stall_timeout_s=stall_timeout_s,
        )
        self.stall_timeout_s = stall_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.exit_wait_s = exit_wait_s  # how long restart() and close() wait for a killed process
        self._outstanding: dict[int, float] = {}  # seq -> when it was sent
        self._finished: list[Outcome] = []
        self._remote_read_seconds: list[float] = []
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._phase = _Phase.DOWN
        self._since = 0.0  # when the current phase began
        self._last_heard = 0.0
        self._backoff_s = 1.0
        self._restart_at = 0.0
        self._said_stuck = False
        self._respawn_at_exit = False  # a restart() waits for the old process's exit: no back-off then
        self.restarts = 0
        self.failures = 0
        # The remote tier (--pcr-remote): probe answers not yet taken, by probe seq, and the
        # tier's last reported state (None: no report yet, or no remote tier).
        self._probed: dict[int, Probed] = {}
        self.remote_status: Optional[RemoteStatus] = None
        self._spawn()

    # ------------------------------------------------------------------ lifecycle
    def _spawn(self) -> None:
        # The Mooncake client (remote tier) logs every connection at INFO: warnings and up only.
        env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING")}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pcr_sglang.io.process", msgspec.msgpack.encode(self.config).hex()],
            stdin=subprocess.DEVNULL,
            env=env,
            # The store's writer lease: held by the I/O process too, so a peer starting on
            # the directory never takes over the slot while this process still writes.
            pass_fds=(self.config.lease_fd,) if self.config.lease_fd >= 0 else (),
        )
        self._enter(_Phase.STARTING)
        self._last_heard = self._since

    def _enter(self, phase: _Phase) -> None:
        self._phase = phase
        self._since = time.monotonic()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None and self._phase is not _Phase.DOWN else None

    @property
    def healthy(self) -> bool:
        return self._phase is _Phase.READY

    @property
    def phase(self) -> str:
        return self._phase.value

    def wait_ready(self, timeout_s: Optional[float] = None) -> bool:
        """At startup only: wait for the first hello."""
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        while self._phase is _Phase.STARTING and time.monotonic() < deadline:
            self._take_replies(timeout_ms=50)
            self._check_health()
        return self.healthy

    def close(self) -> None:
        self._kill_and_wait()
        self._proc = None
        self._channel.close()

    def _kill_and_wait(self) -> bool:
        """SIGKILL the process and wait up to ``exit_wait_s`` for the kernel to confirm its
        exit. False when it is still there (stuck in uninterruptible disk I/O, say)."""
        if self._proc is None or self._proc.poll() is not None:
            return True
        self._proc.kill()
        try:
            self._proc.wait(timeout=self.exit_wait_s)
            return True
        except subprocess.TimeoutExpired:
            logger.error("PCR I/O process %d does not exit after SIGKILL", self._proc.pid)
            return False

    def restart(self, config: IoProcessConfig) -> bool:
        """Serve another store (the weights changed, and with them the SSD namespace): the
        running process is killed and waited for, and a process on ``config``'s store is
        started. True once it is ready.

        Its orders come back cancelled at the next :meth:`poll` only once the kernel has
        confirmed its exit. A process that does not exit within ``exit_wait_s`` (a read
        stuck in uninterruptible disk I/O can still land in its host slot) is left DYING
        as the health check leaves it: its orders stay outstanding, so their host slots
        stay reserved, and the new process starts at the first :meth:`poll` after the old
        one is gone (False is returned meanwhile)."""
        self._probed = {}
        self.remote_status = None
        self.config = msgspec.structs.replace(
            config,
            orders_endpoint=self._channel.orders_endpoint,
            replies_endpoint=self._channel.replies_endpoint,
            parent_pid=os.getpid(),
            stall_timeout_s=self.stall_timeout_s,
        )
        # mutant: io-restart-cancels-orders-of-a-live-process
        if self._phase is not _Phase.DOWN and not self._kill_and_wait():
            logger.error(
                "PCR I/O process %d: its %d orders keep their host slots reserved until it exits; "
                "the process on the new store starts then",
                self._proc.pid if self._proc else -1,
                len(self._outstanding),
            )
            self._respawn_at_exit = True
            self._said_stuck = True
            self._enter(_Phase.DYING)
            return False
        self._finished.extend((seq, IoOutcome.CANCELLED, 0.0) for seq in self._outstanding)
        self._outstanding = {}
        self._spawn()
        return self.wait_ready()

    # ------------------------------------------------------------------ orders
    def submit(self, order: Order) -> None:
        """Send ``order``; a read or write that cannot be sent comes back cancelled."""
        if self.healthy and self._channel.send(order):
            if isinstance(order, (ReadChunk, WriteChunk)):
                self._outstanding[order.seq] = time.monotonic()
        elif isinstance(order, (ReadChunk, WriteChunk)):
            self._finished.append((order.seq, IoOutcome.CANCELLED, 0.0))

    def take_replies(self) -> None:
        """Take what has arrived, without a health check (completions are kept for the next
        :meth:`poll`): for reports asked of an idle scheduler, whose steps do not run."""
        self._take_replies(timeout_ms=0)

    def take_probe(self, seq: int) -> Optional[Probed]:
        """The answer to probe ``seq`` if it has arrived (taken once). A probe lost with its
        process is never answered: the scheduler stops waiting at its deadline."""
        return self._probed.pop(seq, None)

    def drop_probes(self, keep: set[int]) -> None:
        """Forget answers nobody will take (their request left before they arrived)."""
        for seq in [s for s in self._probed if s not in keep]:
            del self._probed[seq]

    @property
    def in_flight(self) -> int:
        return len(self._outstanding)

    def take_remote_read_seconds(self) -> list[float]:
        """How long each remote-tier read that succeeded since the last call took (its call
        to the store alone; the local SSD miss before it and any queueing excluded)."""
        taken, self._remote_read_seconds = self._remote_read_seconds, []
        return taken

    def poll(self) -> list[Outcome]:
        """Completions since the last call, after a health check (never waits)."""
        self._take_replies(timeout_ms=0)
        self._check_health()
        finished, self._finished = self._finished, []
        return finished

    def _take_replies(self, timeout_ms: int) -> None:
        for reply in self._channel.receive(timeout_ms):
            self._last_heard = time.monotonic()
            if isinstance(reply, Hello):
                if self._proc is not None and reply.pid == self._proc.pid and self._phase is _Phase.STARTING:
                    self._enter(_Phase.READY)
                    self._backoff_s = 1.0
                continue
            if isinstance(reply, Probed):
                self._probed[reply.seq] = reply
                continue
            if isinstance(reply, RemoteStatus):
                self.remote_status = reply
                continue
            assert isinstance(reply, Done)
            seconds = reply.seconds
            if reply.source == SOURCE_REMOTE:  # timed apart: the cost model weighs the tiers apart
                if reply.outcome == IoOutcome.OK:  # also for a read given up on meanwhile: it took that long
                    self._remote_read_seconds.append(seconds)
                seconds = 0.0
            if self._outstanding.pop(reply.seq, None) is not None:
                self._finished.append((reply.seq, IoOutcome(reply.outcome), seconds))

    # ------------------------------------------------------------------ supervision
    def _check_health(self) -> None:
        now = time.monotonic()
        if self._phase is _Phase.DOWN:
            if now >= self._restart_at:
                self.restarts += 1
                logger.warning("PCR I/O process: restarting (attempt %d)", self.restarts)
                self._spawn()
            return
        assert self._proc is not None
        if self._proc.poll() is not None:
            if self._phase is not _Phase.DYING:
                self.failures += 1
                logger.warning("PCR I/O process %d exited with code %s", self._proc.pid, self._proc.returncode)
            self._gone(now)
            return
        if self._phase is _Phase.READY and self._outstanding:
            oldest = min(self._outstanding.values())
            if now - max(oldest, self._last_heard) > self.stall_timeout_s:
                self._kill(f"stopped answering ({len(self._outstanding)} orders outstanding)")
        elif self._phase is _Phase.STARTING and now - self._since > self.startup_timeout_s:
            self._kill("did not start")
        elif self._phase is _Phase.DYING and now - self._since > 10.0 and not self._said_stuck:
            logger.error(
                "PCR I/O process %d does not exit after SIGKILL; its %d orders keep their "
                "host slots reserved until it does",
                self._proc.pid,
                len(self._outstanding),
            )
            self._said_stuck = True

    def _kill(self, why: str) -> None:
        assert self._proc is not None
        self.failures += 1
        logger.warning("PCR I/O process %d %s: killing it; serving without the SSD tier meanwhile", self._proc.pid, why)
        self._proc.kill()
        self._said_stuck = False
        self._enter(_Phase.DYING)

    def _gone(self, now: float) -> None:
        cancelled = len(self._outstanding)
        self._finished.extend((seq, IoOutcome.CANCELLED, 0.0) for seq in self._outstanding)
        self._outstanding = {}
        self.remote_status = None  # the next process reports its own
        self._phase = _Phase.DOWN
        if self._respawn_at_exit:  # restart() asked for a process on a new store: not a failure
            self._respawn_at_exit = False
            self._restart_at = now
            logger.warning("PCR I/O process gone: %d orders cancelled; starting the one on the new store", cancelled)
            return
        self._restart_at = now + self._backoff_s
        logger.warning("PCR I/O process gone: %d orders cancelled; restart in %.0f s", cancelled, self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
