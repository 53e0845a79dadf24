"""Start and stop a Mooncake Store on this machine: its master and a store process.

The remote tier (``--pcr-remote mooncake``) needs a Mooncake master (object placement
and eviction) and at least one process that lends memory to the shared pool; PCR's I/O
processes are clients that lend none (``global_segment_size`` 0), so the objects outlive
every server. Both binaries ship in the ``mooncake-transfer-engine`` wheels. Everything
binds to loopback here except what Mooncake's transfer engine binds itself (its TCP
transfer socket listens on all interfaces: confine multi-host setups by network policy).

Used by the tests and by ``python -m pcr_tools.fleet``.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pcr_sglang.tiers.records import KEY_BYTES
from pcr_tools.launcher import free_port

logger = logging.getLogger(__name__)


class MooncakeError(RuntimeError):
    """A Mooncake process (or the gateway beside it) could not be found or started."""


def binary(name: str) -> str:
    """``mooncake_master`` or ``mooncake_client``: beside this Python, or on PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise MooncakeError(
            f"{name} not found: pip install mooncake-transfer-engine-non-cuda (CPU) or "
            f"mooncake-transfer-engine (CUDA); on Debian it also needs libibverbs1"
        )
    return found


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def keygen(path: str | os.PathLike) -> Path:
    """Write a new fleet key (what the remote tier derives its record and name keys from): 32
    random bytes, 0600.
    Refuses to overwrite one (every server of a fleet must use the same key)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(KEY_BYTES))
    return path


@dataclass
class ServiceProcess:
    """A helper process on loopback (Mooncake's master and store, SGLang's gateway): started
    in a session of its own, ready when :meth:`ready` says so, stopped with its whole
    process group (``smg`` runs its router in a child that outlives a signal to its parent)."""

    name: str
    args: list[str]
    host: str
    port: int
    log_path: Optional[Path] = None
    proc: Optional[subprocess.Popen] = None
    install_hint = ""  # what to install when the program is not found

    def ready(self) -> bool:
        return _listening(self.host, self.port)

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except FileNotFoundError:
            raise MooncakeError(
                f"{self.args[0]} not found" + (f": {self.install_hint}" if self.install_hint else "")
            ) from None
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None:
                raise MooncakeError(
                    f"{self.name} exited with code {self.proc.returncode} at start"
                    + (f" (log: {self.log_path})" if self.log_path else "")
                )
            if time.monotonic() > deadline:
                self.kill()
                raise MooncakeError(
                    f"{self.name} was not ready on {self.host}:{self.port} within {timeout_s:.0f} s"
                    + (f" (log: {self.log_path})" if self.log_path else "")
                )
            time.sleep(0.05)
        logger.info("%s ready on %s:%d (pid %d)", self.name, self.host, self.port, self.proc.pid)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left of it after ``timeout_s``."""
        if self.proc is None:
            return
        if not self._signal_group(signal.SIGTERM, timeout_s):
            self.kill()

    def kill(self) -> None:
        if self.proc is not None:
            self._signal_group(signal.SIGKILL, 10.0)

    def _signal_group(self, sig: int, wait_s: float) -> bool:
        """Send ``sig`` to the process group; whether all of it was gone within ``wait_s``."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the leader, or the group never looks empty
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.05)
        return False


class MooncakeMaster(ServiceProcess):
    """``mooncake_master`` on loopback: RPC on ``port``, metrics/admin on ``metrics_port``,
    no HTTP metadata server (clients use P2P handshakes)."""

    def __init__(
        self,
        port: Optional[int] = None,
        metrics_port: Optional[int] = None,
        host: str = "127.0.0.1",
        log_path: Optional[Path] = None,
        lease_ttl_ms: int = 5000,
    ):
        port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        super().__init__(
            "mooncake_master",
            [
                binary("mooncake_master"),
                f"--rpc_address={host}",
                f"--rpc_port={port}",
                f"--metrics_host={host}",
                f"--metrics_port={self.metrics_port}",
                f"--default_kv_lease_ttl={lease_ttl_ms}",
                "--eviction_high_watermark_ratio=0.95",
            ],
            host,
            port,
            log_path,
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class MooncakeStoreProcess(ServiceProcess):
    """``mooncake_client`` as a standalone store: lends ``segment_bytes`` of its memory to
    the pool, over TCP, registered with ``master``."""

    def __init__(
        self,
        master: MooncakeMaster,
        segment_bytes: int,
        port: Optional[int] = None,
        host: str = "127.0.0.1",
        log_path: Optional[Path] = None,
    ):
        port = port or free_port()
        self.segment_bytes = segment_bytes
        super().__init__(
            "mooncake_client",
            [
                binary("mooncake_client"),
                f"--host={host}",
                f"--port={port}",
                f"--global_segment_size={segment_bytes}",
                f"--master_server_address={master.address}",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
            ],
            host,
            port,
            log_path,
        )


def client_config(master: MooncakeMaster, key_file: str | os.PathLike, **extra) -> dict:
    """A ``--pcr-remote-config`` for servers of this store."""
    return {
        "master_server_address": master.address,
        "key_file": str(key_file),
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,
        **extra,
    }
