"""Start and stop a real ``python -m sglang.launch_server`` for the demo, tests and benchmarks."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Optional, Sequence

import psutil
import requests

logger = logging.getLogger(__name__)

# On CPUs without AMX or AVX512-BF16, half-precision matmuls run about 6x slower than
# float32 (measured on the 2-core CI machine: 20 vs 128 GFLOPS), and SGLang's "auto"
# dtype picks half precision: serve in float32. Later --dtype arguments override this.
CPU_SERVER_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32")


# PCR_SERVER_START_SLOTS=N: at most N servers (of this user, sharing a temporary directory) start at
# once; others wait for a slot before they launch. A start is mostly CPU-bound imports, so
# on a small machine many at once each take as long as all of them together and can run
# past their startup timeout (the test suite runs modules side by side). Unset or 0: no limit.
START_SLOTS_ENV = "PCR_SERVER_START_SLOTS"


def slots_from_env(name: str) -> int:
    """A slot count from environment variable ``name`` (unset: 0, no limit)."""
    try:
        return int(os.environ.get(name) or 0)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {os.environ[name]!r}") from None


def acquire_slots(pool: str, slots: int, count: int = 1) -> list[IO]:
    """Lock ``count`` of the ``slots`` slot files of ``pool`` (this user's, in the temporary
    directory: processes with another ``TMPDIR`` have pools of their own),
    all at once or none: while fewer are free, hold none and poll (so two holders never
    each wait for the other). Closing a returned file releases its slot."""
    directory = Path(tempfile.gettempdir()) / f"pcr-sglang-{pool}-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    count = min(count, slots)
    while True:
        held: list[IO] = []
        for i in range(slots):
            slot = open(directory / f"slot-{i}", "a")
            try:
                fcntl.flock(slot, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                slot.close()
                continue
            held.append(slot)
            if len(held) == count:
                return held
        for slot in held:
            slot.close()
        time.sleep(0.2)


def _acquire_start_slot() -> Optional[IO]:
    """A locked slot file (held until the server is up), or None without a limit."""
    slots = slots_from_env(START_SLOTS_ENV)
    return acquire_slots("start-slots", slots)[0] if slots > 0 else None


# What uvicorn logs when the server's HTTP port is taken; the server then hangs instead of exiting.
PORT_IN_USE_MESSAGE = "error while attempting to bind on address"
PORT_ATTEMPTS = 3


def _ephemeral_port_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(low: int = 20000, high: int = 32767, attempts: int = 64) -> int:
    """A port that is free now, below the kernel's ephemeral range where possible.

    The server binds its port only after loading the model, minutes later on CPU. A port
    from bind(0) lies in the range that outgoing connections take their local ports from,
    and one of them can hold it by then (this happened with several servers starting at
    once). SGLang picks its own NCCL port the same way.
    """
    high = min(high, _ephemeral_port_floor() - 1)
    candidates = random.sample(range(low, high + 1), attempts) if high - low >= attempts else []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_gone(processes: list[psutil.Process], timeout_s: float) -> None:
    """Wait until every process has exited (a zombie counts as exited)."""
    deadline = time.monotonic() + timeout_s
    for p in processes:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)


AUTOGROUP = Path("/proc/self/autogroup")


def keep_niceness(argv: list[str]) -> list[str]:
    """``argv`` run so that a server started in a session of its own keeps this process's
    niceness. With the kernel's autogroup scheduling (most desktop and CI kernels) the CPU
    is shared fairly between sessions first and by nice only within one, so a server
    started from ``nice -n 19`` in a new session would otherwise compete at full weight;
    its session's autogroup gets the same nice value instead. Unchanged at niceness 0 or
    without autogroups."""
    niceness = os.nice(0)
    if niceness <= 0 or not AUTOGROUP.exists():
        return argv
    # The kernel lets an unprivileged user set an autogroup's nice value once per 100 ms,
    # machine-wide (EAGAIN otherwise): servers starting together retry for a second.
    set_nice = f"for i in 1 2 3 4 5 6 7 8 9 10; do echo {niceness} > {AUTOGROUP} 2>/dev/null && break; sleep 0.1; done"
    return ["/bin/sh", "-c", f'{set_nice}; exec "$@"', "sh", *argv]


def cpu_only() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


class PortInUseError(RuntimeError):
    """The server could not bind its HTTP port."""


@dataclass(frozen=True)
class StreamedResponse:
    """A streamed ``/generate`` call: time to the first chunk, total time, last chunk."""

    ttft_s: float
    latency_s: float
    final: dict


class ServerRequests:
    """The HTTP calls the tools make to a server (``base_url``, ``admin_api_key``)."""

    base_url: str
    admin_api_key: Optional[str]

    def generate(self, payload: dict, timeout_s: float = 300.0) -> dict:
        r = requests.post(f"{self.base_url}/generate", json=payload, timeout=timeout_s)
        r.raise_for_status()
        return r.json()

    def generate_stream(self, payload: dict, timeout_s: float = 600.0) -> StreamedResponse:
        """POST ``payload`` with ``stream: true``; measures TTFT at the first data chunk."""
        start = time.perf_counter()
        ttft, final = None, {}
        with requests.post(
            f"{self.base_url}/generate", json={**payload, "stream": True}, stream=True, timeout=timeout_s
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                if ttft is None:
                    ttft = time.perf_counter() - start
                final = json.loads(data)
        return StreamedResponse(
            ttft_s=ttft if ttft is not None else float("nan"),
            latency_s=time.perf_counter() - start,
            final=final,
        )

    def flush_cache(self, timeout_s: float = 30.0) -> None:
        """Empty the server's prefix cache (SGLang's ``/flush_cache``). SGLang flushes only
        an idle server: it waits up to ``timeout_s`` for running requests to finish."""
        r = requests.post(f"{self.base_url}/flush_cache", params={"timeout": timeout_s}, timeout=timeout_s + 30)
        if r.status_code != 200:
            raise RuntimeError(f"flush_cache failed ({r.status_code}): {r.text.strip()}")

    def server_info(self, *, check_invariants: bool = False) -> dict:
        """SGLang's ``/server_info``; ``check_invariants`` asks for PCR's O(tree) check, which
        needs ``--pcr-debug-checks`` or the admin key (sent when the server has one)."""
        params = {"pcr_check_invariants": "1"} if check_invariants else None
        key = self.admin_api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        r = requests.get(f"{self.base_url}/server_info", params=params, headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def pcr_state(self, *, check_invariants: bool = False) -> dict:
        """PCR's ``/server_info`` state; ``check_invariants`` also runs the O(tree)
        bookkeeping check (``state["invariants"]["ok"]`` is None without it)."""
        states = self.server_info(check_invariants=check_invariants).get("internal_states") or []
        for state in states:
            if "pcr" in state:
                return state["pcr"]
        raise KeyError("the server reports no PCR state (is --enable-pcr set?)")


@dataclass
class ServerClient(ServerRequests):
    """A server someone else started, at ``url`` (``python -m pcr_tools.calibrate --url``)."""

    url: str
    api_key: Optional[str] = None

    @property
    def base_url(self) -> str:  # type: ignore[override]
        return self.url.rstrip("/")

    @property
    def admin_api_key(self) -> Optional[str]:  # type: ignore[override]
        return self.api_key


# SGLang flags that are prefixes of a secret flag without being secret themselves.
_FLAGS_NAMED_LIKE_A_SECRET = frozenset({"--ssl-keyfile"})


@dataclass
class ServerProcess(ServerRequests):
    """A server subprocess; use as a context manager or call ``start``/``stop``."""

    model_path: str
    extra_args: Sequence[str] = ()
    port: int = 0
    startup_timeout_s: float = 300.0
    log_path: Optional[Path] = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None  # the server's working directory (default: this process's)
    startup_seconds: float = 0.0
    _proc: Optional[subprocess.Popen] = None
    _port_chosen_here: bool = False
    _metrics_dir: Optional[str] = None  # PROMETHEUS_MULTIPROC_DIR of the running server, ours to remove
    _secrets_dir: Optional[str] = None  # the running server's --config file with its keys, ours to remove

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        """The server's command line. Its keys (``--api-key``, ``--admin-api-key``, ...) are
        not on it: they go in a config file only this user can read (``_secrets_file``), so
        ``ps`` shows no secret."""
        args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if cpu_only():
            args += CPU_SERVER_ARGS
        return args + self._args_with_secrets_in_a_file()

    @property
    def public_args(self) -> list[str]:
        """``extra_args`` with the secrets' values redacted: what reports may record."""
        from pcr_sglang.sglang_adapter.redaction import redact_argv

        return redact_argv(self.extra_args)

    def _args_with_secrets_in_a_file(self) -> list[str]:
        """``extra_args`` with every secret flag and its value moved into a YAML file of
        SGLang's ``--config`` (mode 0600 in a 0700 directory, removed when the server
        stops); a ``--config`` the caller gave is merged into it."""
        from pcr_sglang.sglang_adapter.redaction import SECRET_FLAGS

        args = list(self.extra_args)
        secrets: dict[str, object] = {}
        kept: list[str] = []
        i = 0
        while i < len(args):
            flag, eq, value = args[i].partition("=")
            if (
                flag.startswith("--")
                and flag not in SECRET_FLAGS
                and flag not in _FLAGS_NAMED_LIKE_A_SECRET
                and any(secret.startswith(flag) for secret in SECRET_FLAGS)
            ):
                # SGLang's parser takes an abbreviation (--admin-api-k) for the whole flag;
                # the launcher keeps only whole secret flags off the command line.
                raise ValueError(
                    f"{flag}: spell the flag out (one of {sorted(SECRET_FLAGS)}), so its value is "
                    "kept off the server's command line"
                )
            if flag in SECRET_FLAGS and (eq or i + 1 < len(args)):
                secrets[flag[2:]] = value if eq else args[i + 1]
                i += 1 if eq else 2
                continue
            kept.append(args[i])
            i += 1
        # mutant: launcher-puts-the-key-on-the-command-line
        if not secrets:
            return args
        if "--config" in kept:
            import yaml

            at = kept.index("--config")
            if at + 1 >= len(kept):
                raise ValueError("--config needs a file")
            with open(kept[at + 1]) as f:
                given = yaml.safe_load(f) or {}
            if not isinstance(given, dict):
                raise ValueError(f"{kept[at + 1]}: a --config file holds a mapping of flags")
            secrets = {**given, **secrets}
            del kept[at : at + 2]
        return [*kept, "--config", str(self._secrets_file(secrets))]

    def _secrets_file(self, settings: dict[str, object]) -> Path:
        import yaml

        self._drop_secrets_dir()
        self._secrets_dir = tempfile.mkdtemp(prefix="pcr-server-config-")  # mode 0700
        path = Path(self._secrets_dir) / "secrets.yaml"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(settings, f)
        return path

    def _drop_secrets_dir(self) -> None:
        if self._secrets_dir is not None:
            shutil.rmtree(self._secrets_dir, ignore_errors=True)
            self._secrets_dir = None

    def start(self) -> ServerProcess:
        """Start the server and wait until it serves.

        A port chosen here can still be taken before the server binds it; the server is
        then restarted on another port, up to ``PORT_ATTEMPTS`` times. A port the caller
        chose is not replaced: that failure is raised.
        """
        choose_port = self._port_chosen_here = self._port_chosen_here or not self.port
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = dict(os.environ)
        if cpu_only():
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        env.update(self.env)
        slot = _acquire_start_slot()
        try:
            self._launch(env, choose_port)
        finally:
            if slot is not None:
                slot.close()  # releases the lock
        return self

    def _launch(self, env: dict[str, str], choose_port: bool) -> None:
        started = time.monotonic()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if choose_port:
                self.port = free_port()
            server_env = self._with_metrics_dir(env)
            log = open(self.log_path, "w")
            try:
                self._proc = subprocess.Popen(
                    keep_niceness(self.argv()),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=server_env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            except BaseException:
                self._drop_metrics_dir()
                self._drop_secrets_dir()
                raise
            finally:
                log.close()
            try:
                self._wait_ready(time.monotonic())
            except PortInUseError:
                self.kill()
                if not choose_port or attempt == PORT_ATTEMPTS:
                    raise
                logger.warning("Port %d was taken before the server bound it; restarting on another.", self.port)
                continue
            except BaseException:
                self.stop()
                raise
            # SGLang read its --config file at startup, in this process's child, and never
            # again: the keys need not stay on disk while it serves.
            self._drop_secrets_dir()
            break
        self.startup_seconds = time.monotonic() - started

    def _with_metrics_dir(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with a ``PROMETHEUS_MULTIPROC_DIR`` of this launcher's own, unless the
        caller set one. SGLang makes its metrics directory (``--enable-metrics``) in the
        system's temporary directory and removes it at a graceful exit only: a killed
        server's stayed behind, one per start. Under ours, it goes when the server does."""
        self._drop_metrics_dir()  # a previous start's, if it was never stopped
        if "PROMETHEUS_MULTIPROC_DIR" in env:
            return env
        self._metrics_dir = tempfile.mkdtemp(prefix="pcr-server-metrics-")
        return {**env, "PROMETHEUS_MULTIPROC_DIR": self._metrics_dir}

    def _port_taken(self) -> bool:
        if self.log_path is None or not self.log_path.exists():
            return False
        return PORT_IN_USE_MESSAGE in self.log_path.read_text(errors="replace")

    def _wait_ready(self, started: float) -> None:
        assert self._proc is not None
        while time.monotonic() - started < self.startup_timeout_s:
            if self._port_taken():
                raise PortInUseError(f"port {self.port} is in use; last log lines:\n{self.log_tail()}")
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with code {self._proc.returncode} during startup; "
                    f"last log lines:\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.base_url}/model_info", timeout=2).status_code == 200:
                    # /model_info answers before the warmup request; wait for it too.
                    if requests.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                        return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang server not ready after {self.startup_timeout_s:.0f} s; log:\n{self.log_tail()}")

    @property
    def pid(self) -> Optional[int]:
        """The launcher's process id (its children are the server's processes), None when stopped."""
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line[:400] for line in text[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL the whole server at once, as a crash would: no exit handler runs."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: int, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        try:
            self._end(proc, sig, timeout_s)
        finally:
            self._drop_metrics_dir()
            self._drop_secrets_dir()

    def _drop_metrics_dir(self) -> None:
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            self._metrics_dir = None

    def _end(self, proc: Optional[subprocess.Popen], sig: int, timeout_s: float) -> None:
        if proc is None or proc.poll() is not None:
            return
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        # The server spawns scheduler and detokenizer processes: signal the whole group.
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        # The server's scheduler and detokenizer may outlive the launcher process by a
        # moment: wait for them, then unlink any PCR host pool a killed scheduler left.
        _wait_gone(children, timeout_s=15)
        from pcr_sglang.tiers.host_pool import remove_stale_segments

        remove_stale_segments(expected=True)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def admin_api_key(self) -> Optional[str]:
        """The server's ``--admin-api-key``, if it was started with one."""
        args = list(self.extra_args)
        for i, arg in enumerate(args):
            if arg.startswith("--admin-api-key="):
                return arg.partition("=")[2]
            if arg == "--admin-api-key" and i + 1 < len(args):
                return args[i + 1]
        return None


def stop_all(servers: Iterable[ServerProcess], timeout_s: float = 30.0, *, graceful: bool = True) -> None:
    """Stop several servers at once: each stop waits seconds for SGLang's processes to
    exit, mostly idle, so one after another a module's eight servers took 45 s.

    ``graceful=False`` kills them instead (``ServerProcess.kill``), for servers nothing is
    wanted from any more: a graceful stop takes 5-6 s however idle the server is (SGLang's
    SIGTERM watchdog polls every 5 s; its detokenizer, signalled with the group, is taken
    for a crash and reported after a 5 s pause)."""
    stopping = list(servers)
    if not stopping:
        return
    with ThreadPoolExecutor(len(stopping)) as pool:
        futures = [pool.submit(s.stop, timeout_s) if graceful else pool.submit(s.kill) for s in stopping]
        for future in futures:
            future.result()
