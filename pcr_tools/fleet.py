"""Several pcr-sglang servers on one machine: a Mooncake Store they share, and SGLang's
gateway in front. Everything binds to loopback.

    python -m pcr_tools.fleet keygen fleet.key
    python -m pcr_tools.fleet serve --servers 2 --dir /srv/pcr-fleet [--policy cache_aware] \\
        [--no-remote] [--model-path PATH] -- [extra launch_server flags]

``serve`` starts, in order: ``mooncake_master``, a ``mooncake_client`` store process
(``--store-gb`` of memory), N ``python -m sglang.launch_server --enable-pcr ...`` servers
(each with its own SSD directory under ``--dir`` and ``--pcr-remote mooncake`` unless
``--no-remote``), then ``smg launch`` (SGLang Model Gateway) over them; it prints the
gateway's URL and every process's, writes them to ``DIR/fleet.json``, and stops them all
(gateway first, store last) on Ctrl-C or SIGTERM, or if any of them dies.

Gateway settings for RAG traffic (docs/scale-out.md): ``cache_aware`` routes a
request to the worker whose routed prefixes share the most of it (above
``--cache-threshold``, 0.3 of the prompt), else to the least loaded, and spills when load
is imbalanced; with a shared remote tier a spilled request still finds the documents'
KV, so the spill thresholds can stay at SMG's defaults.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import requests

from pcr_tools.launcher import ServerProcess, cpu_only, free_port, stop_all
from pcr_tools.mooncake_services import (
    MooncakeError,
    MooncakeMaster,
    MooncakeStoreProcess,
    ServiceProcess,
    client_config,
    keygen,
)

logger = logging.getLogger(__name__)

GATEWAY_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "prefix_hash", "consistent_hashing")


class Gateway(ServiceProcess):
    """``smg launch`` over ``worker_urls`` on loopback, ready once it has registered every
    worker (its ``/health`` answers before it has checked them)."""

    install_hint = "pip install smg==1.13.0 (SGLang Model Gateway)"

    def __init__(
        self,
        worker_urls: list[str],
        policy: str = "cache_aware",
        cache_threshold: float = 0.3,
        port: int = 0,
        log_path: Optional[Path] = None,
    ):
        self.worker_urls, self.policy, self.cache_threshold = list(worker_urls), policy, cache_threshold
        port = port or free_port()
        smg = Path(sys.executable).with_name("smg")
        super().__init__(
            "smg",
            [
                str(smg) if smg.exists() else "smg",
                "launch",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                *self.worker_urls,
                "--policy",
                policy,
                "--cache-threshold",
                str(cache_threshold),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ],
            "127.0.0.1",
            port,
            log_path,
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            workers = requests.get(f"{self.base_url}/workers", timeout=2).json()
        except (requests.RequestException, ValueError):
            return False
        return int(workers.get("total", 0)) >= len(self.worker_urls)

    def start(self, timeout_s: float = 60.0) -> Gateway:
        super().start(timeout_s)
        return self


@dataclass
class Fleet:
    """Master, store, servers and gateway, started and stopped together."""

    model_path: str
    work_dir: Path
    num_servers: int = 2
    remote: bool = True
    policy: str = "cache_aware"
    store_bytes: int = 1 << 30
    server_args: Sequence[str] = ()
    key_file: Optional[Path] = None
    server_env: dict[str, str] = field(default_factory=dict)
    master: Optional[MooncakeMaster] = None
    store: Optional[MooncakeStoreProcess] = None
    servers: list[ServerProcess] = field(default_factory=list)
    gateway: Optional[Gateway] = None

    def start(self) -> Fleet:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            remote_args: tuple[str, ...] = ()
            if self.remote:
                self.master = MooncakeMaster(log_path=self.work_dir / "mooncake-master.log")
                self.master.start()
                self.store = MooncakeStoreProcess(
                    self.master, self.store_bytes, log_path=self.work_dir / "mooncake-store.log"
                )
                self.store.start()
                key = self.key_file or self.work_dir / "fleet.key"
                if not key.exists():
                    keygen(key)
                remote_args = (
                    "--pcr-remote",
                    "mooncake",
                    "--pcr-remote-config",
                    json.dumps(client_config(self.master, key)),
                )
            for i in range(self.num_servers):
                ssd = self.work_dir / f"server-{i}" / "ssd"
                ssd.parent.mkdir(parents=True, exist_ok=True)
                self.servers.append(
                    ServerProcess(
                        self.model_path,
                        (*self.server_args, "--pcr-ssd-path", str(ssd), *remote_args),
                        log_path=self.work_dir / f"server-{i}.log",
                        env=dict(self.server_env),
                    )
                )
            for server in self.servers:  # one at a time: each start is mostly imports, on every core
                server.start()
            self.gateway = Gateway(
                [s.base_url for s in self.servers], self.policy, log_path=self.work_dir / "gateway.log"
            ).start()
        except BaseException:
            self.stop()
            raise
        (self.work_dir / "fleet.json").write_text(json.dumps(self.describe(), indent=1))
        return self

    def describe(self) -> dict:
        return {
            "gateway": self.gateway.base_url if self.gateway else None,
            "policy": self.policy,
            "servers": [s.base_url for s in self.servers],
            "mooncake_master": self.master.address if self.master else None,
            "store_bytes": self.store_bytes if self.store else 0,
        }

    def alive(self) -> Optional[str]:
        """The name of a process that died, or None."""
        for name, proc in [
            ("gateway", self.gateway.proc if self.gateway else None),
            *[(f"server {s.base_url}", s._proc) for s in self.servers],
            ("mooncake store", self.store.proc if self.store else None),
            ("mooncake master", self.master.proc if self.master else None),
        ]:
            if proc is not None and proc.poll() is not None:
                return name
        return None

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        stop_all(self.servers)
        for proc in (self.store, self.master):
            if proc is not None:
                proc.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m pcr_tools.fleet",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("keygen", help="write a new fleet key (32 random bytes, mode 0600)")
    gen.add_argument("path", type=Path)
    serve = sub.add_parser("serve", help="start the whole fleet in the foreground; Ctrl-C stops it all")
    serve.add_argument("--servers", type=int, default=2, help="pcr-sglang servers (default: 2)")
    serve.add_argument("--dir", type=Path, required=True, help="logs, SSD directories, the key and fleet.json")
    serve.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct (built offline)")
    serve.add_argument("--policy", choices=GATEWAY_POLICIES, default="cache_aware", help="the gateway's policy")
    serve.add_argument("--no-remote", action="store_true", help="no shared remote tier (no Mooncake)")
    serve.add_argument("--store-gb", type=float, default=1.0, help="memory the Mooncake store lends (default: 1)")
    serve.add_argument("--key-file", type=Path, default=None, help="the fleet key (default: DIR/fleet.key, made)")
    serve.add_argument("--dram-gb", type=float, default=0.5, help="--pcr-dram-gb of each server")
    serve.add_argument("--ssd-gb", type=float, default=2.0, help="--pcr-ssd-gb of each server")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "keygen":
        try:
            print(f"wrote {keygen(args.path)}")
        except FileExistsError:
            parser.error(f"{args.path} exists: a fleet key is never overwritten")
        return 0
    if args.servers < 1 or args.store_gb <= 0:
        parser.error("--servers must be >= 1 and --store-gb > 0")
    model = args.model_path
    if model is None:
        from pcr_tools.models.smollm2 import build_smollm2

        model = str(build_smollm2())
    # On CPU, idle schedulers sleep: several busy-polling ones would starve each other's cores.
    idle = ("--sleep-on-idle",) if cpu_only() and "--sleep-on-idle" not in extra else ()
    fleet = Fleet(
        model,
        args.dir,
        args.servers,
        not args.no_remote,
        args.policy,
        int(args.store_gb * 2**30),
        (
            "--enable-pcr",
            "--pcr-dram-gb",
            str(args.dram_gb),
            "--pcr-ssd-gb",
            str(args.ssd_gb),
            "--enable-metrics",
            *idle,
            *extra,
        ),
        args.key_file,
    )
    stop = {"signal": None}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(signal="SIGTERM"))
    try:
        fleet.start()
        print(json.dumps(fleet.describe(), indent=1), flush=True)
        print(f"gateway: {fleet.gateway.base_url} (Ctrl-C stops everything)", flush=True)
        while stop["signal"] is None:
            dead = fleet.alive()
            if dead is not None:
                logger.error("%s exited: stopping the fleet", dead)
                return 1
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    except (MooncakeError, RuntimeError, TimeoutError) as e:
        logger.error("the fleet did not start: %s", e)
        return 1
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
