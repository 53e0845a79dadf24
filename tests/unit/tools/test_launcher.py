"""The launcher's port handling, with uvicorn (the server's HTTP front end) in place of a full server.

A full SGLang start costs about a minute here; what is under test is how the launcher reacts
to uvicorn failing to bind, so uvicorn itself runs, with an app answering the two readiness
endpoints the launcher polls.
"""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path

import pytest

from pcr_tools import launcher
from pcr_tools.launcher import PortInUseError, ServerProcess

READY_APP = textwrap.dedent(
    """
    import sys
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="info")
    """
)


class UvicornProcess(ServerProcess):
    def argv(self) -> list[str]:
        return [sys.executable, "-c", READY_APP, str(self.port)]


@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", launcher.free_port()))
        s.listen()
        yield s.getsockname()[1]


def test_free_port_is_below_the_ephemeral_range():
    # Outgoing connections take local ports from the ephemeral range; a port from there can
    # be taken in the minutes before the server binds it.
    assert launcher.free_port() < launcher._ephemeral_port_floor()


def test_a_port_taken_before_the_server_binds_it_is_replaced(taken_port, monkeypatch):
    real_free_port = launcher.free_port
    offered = iter([taken_port])
    monkeypatch.setattr(launcher, "free_port", lambda: next(offered, None) or real_free_port())
    server = UvicornProcess("unused", startup_timeout_s=60)
    with server:
        assert server.port != taken_port
        assert launcher.requests.get(f"{server.base_url}/health", timeout=5).status_code == 200


def test_a_port_the_caller_chose_is_not_replaced(taken_port):
    server = UvicornProcess("unused", port=taken_port, startup_timeout_s=60)
    with pytest.raises(PortInUseError, match=str(taken_port)):
        server.start()
    assert server.port == taken_port


def test_start_slots_let_only_n_servers_start_at_once(monkeypatch, tmp_path):
    """PCR_SERVER_START_SLOTS=1: a second start waits for the first one's slot (a lock
    file, so it holds across the test suite's worker processes too)."""
    import tempfile
    import threading

    monkeypatch.setenv(launcher.START_SLOTS_ENV, "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = launcher._acquire_start_slot()
    assert first is not None
    got = []
    waiter = threading.Thread(target=lambda: got.append(launcher._acquire_start_slot()), daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not got  # the only slot is held
    first.close()
    waiter.join(10)
    assert got and got[0] is not None
    got[0].close()
    monkeypatch.setenv(launcher.START_SLOTS_ENV, "0")
    assert launcher._acquire_start_slot() is None  # no limit
    monkeypatch.setenv(launcher.START_SLOTS_ENV, "two")
    with pytest.raises(ValueError, match=launcher.START_SLOTS_ENV):
        launcher._acquire_start_slot()


def test_a_module_takes_its_server_slots_all_at_once(monkeypatch, tmp_path):
    """The e2e helpers' machine-wide server budget: a module needing more slots than are
    free waits, holding none, until another module releases its own."""
    import tempfile
    import threading

    from tests.e2e.helpers import SERVER_SLOTS_ENV, server_budget

    monkeypatch.setenv(SERVER_SLOTS_ENV, "3")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    entered = threading.Event()

    def second_module():
        with server_budget(2):
            entered.set()

    with server_budget(2):
        waiter = threading.Thread(target=second_module, daemon=True)
        waiter.start()
        assert not entered.wait(1.0)  # one slot is free, two are needed
        with server_budget(1):  # and that one slot is still free: the waiter holds none
            pass
    assert entered.wait(10)
    waiter.join(10)


def test_stop_all_stops_every_server_at_once_even_when_one_fails():
    """The servers' stops run side by side (each waits for the others here: one after
    another they would break the barrier), and a failing stop does not leave the others
    running."""
    import threading

    barrier = threading.Barrier(3, timeout=10)
    stopped = []

    class Server:
        def __init__(self, name: str, fails: bool = False):
            self.name, self.fails = name, fails

        def stop(self, timeout_s: float) -> None:
            barrier.wait()
            stopped.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} would not stop")

    with pytest.raises(RuntimeError, match="b would not stop"):
        launcher.stop_all([Server("a"), Server("b", fails=True), Server("c")])
    assert sorted(stopped) == ["a", "b", "c"]


def test_stop_all_not_graceful_kills_every_server_at_once():
    """``graceful=False`` (the e2e modules' teardown) kills instead of stopping, the kills
    side by side as the stops are."""
    import threading

    barrier = threading.Barrier(2, timeout=10)
    calls = []

    class Server:
        def __init__(self, name: str):
            self.name = name

        def stop(self, timeout_s: float) -> None:
            calls.append(("stop", self.name))

        def kill(self) -> None:
            barrier.wait()
            calls.append(("kill", self.name))

    launcher.stop_all([Server("a"), Server("b")], graceful=False)
    assert sorted(calls) == [("kill", "a"), ("kill", "b")]


class MetricsDirReporter(UvicornProcess):
    """Writes the PROMETHEUS_MULTIPROC_DIR it was started with to ``report`` (a line a start)."""

    report: Path = Path()

    def argv(self) -> list[str]:
        note = "import os; open(%r, 'a').write(os.environ.get('PROMETHEUS_MULTIPROC_DIR', '-') + '\\n')" % str(
            self.report
        )
        return [sys.executable, "-c", note + "\n" + READY_APP, str(self.port)]


def test_each_start_gets_a_metrics_directory_of_its_own_removed_however_it_ends(taken_port, monkeypatch, tmp_path):
    """SGLang removes its PROMETHEUS_MULTIPROC_DIR at a graceful exit only (red without the
    launcher's own: every killed --enable-metrics server left one in the temporary
    directory). A start retried on another port gets a fresh one, the first removed."""
    real_free_port = launcher.free_port
    offered = iter([taken_port])
    monkeypatch.setattr(launcher, "free_port", lambda: next(offered, None) or real_free_port())
    server = MetricsDirReporter("unused", startup_timeout_s=60)
    server.report = tmp_path / "dirs.txt"
    server.start()
    try:
        first, second = server.report.read_text().split()  # the taken port's attempt, then this one
        assert first != second and not Path(first).exists() and Path(second).is_dir()
    finally:
        server.kill()
    assert not Path(second).exists()


def test_a_metrics_directory_the_caller_set_is_left_to_the_caller(tmp_path):
    server = MetricsDirReporter("unused", startup_timeout_s=60, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    server.report = tmp_path / "dirs.txt"
    with server:
        assert server.report.read_text().split() == [str(tmp_path)]
    assert tmp_path.is_dir()


def test_a_server_started_from_a_niced_process_keeps_its_niceness_in_its_own_session():
    """With autogroup scheduling a new session competes at full weight whatever its nice
    value; the launcher's wrapper gives the server's session the caller's niceness (red
    without it: the session's autogroup is at nice 0)."""
    import os
    import subprocess

    if os.nice(0) == 0:
        assert launcher.keep_niceness(["x"]) == ["x"]  # nothing to keep
    if not launcher.AUTOGROUP.exists():
        pytest.skip("this kernel schedules without autogroups")
    probe = textwrap.dedent("""
        import os, subprocess, sys
        from pcr_tools.launcher import keep_niceness
        niceness = os.nice(3)
        report = [sys.executable, "-c", "print(open('/proc/self/autogroup').read().split()[-1])"]
        print(niceness, subprocess.run(keep_niceness(report), start_new_session=True, capture_output=True,
                                       text=True, check=True).stdout.strip())
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    niceness, group = out.split()
    assert group == niceness  # whatever niceness this test itself runs at, plus 3


SECRET = "launcher-SECRET-key-31"


def test_keys_go_to_a_private_config_file_not_the_command_line(tmp_path):
    """``ps`` shows every process's argv to every user: the launcher moves ``--api-key``
    and ``--admin-api-key`` (both spellings) into SGLang's ``--config`` YAML, mode 0600,
    merged with a ``--config`` the caller gave (red before: the key was on argv)."""
    import stat

    import yaml

    given = tmp_path / "given.yaml"
    given.write_text("log-level: warning\n")
    server = ServerProcess(
        "m", ("--admin-api-key", SECRET, f"--api-key={SECRET}-b", "--config", str(given), "--enable-pcr")
    )
    try:
        argv = server.argv()
        assert not any(SECRET in arg for arg in argv)
        assert argv[-2:-1] == ["--config"] and "--enable-pcr" in argv and str(given) not in argv
        path = Path(argv[-1])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert yaml.safe_load(path.read_text()) == {
            "log-level": "warning",
            "admin-api-key": SECRET,
            "api-key": f"{SECRET}-b",
        }
        assert server.admin_api_key == SECRET
        assert server.public_args[:2] == ["--admin-api-key", "<redacted>"]
    finally:
        server._drop_secrets_dir()
    assert not path.exists()
    assert ServerProcess("m", ("--enable-pcr",)).argv()[-1] == "--enable-pcr"  # no key: argv as given


class SecretsReporter(UvicornProcess):
    config_path: Path

    def argv(self) -> list[str]:
        self.config_path = Path(self._args_with_secrets_in_a_file()[-1])
        return super().argv()


def test_the_key_file_is_removed_once_the_server_is_ready():
    server = SecretsReporter("unused", ("--admin-api-key", SECRET), startup_timeout_s=60)
    with server:
        assert not server.config_path.exists() and not server.config_path.parent.exists()


def test_an_abbreviated_key_flag_is_refused_not_left_on_the_command_line():
    """SGLang's parser takes ``--admin-api-k`` for ``--admin-api-key`` (review R4)."""
    with pytest.raises(ValueError, match="--admin-api-k: spell the flag out"):
        ServerProcess("m", ("--admin-api-k", SECRET)).argv()
    assert ServerProcess("m", ("--ssl-keyfile", "key.pem")).argv()[-2:] == ["--ssl-keyfile", "key.pem"]
