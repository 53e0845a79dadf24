from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import MappingProxyType
from typing import Iterator, Mapping, Sequence

from pcr_tools.launcher import ServerProcess, acquire_slots, slots_from_env, stop_all
from tests.conftest import CHUNK_SIZE

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
COMMON_ARGS = (
    "--max-total-tokens",
    "24000",
    "--context-length",
    "4096",
    "--log-level",
    "warning",
    "--sleep-on-idle",
)


BASELINE_ARGS = (*COMMON_ARGS, "--disable-radix-cache")


# PCR_TEST_SERVER_SLOTS=N: the modules running side by side (scripts/test.sh runs two
# pytest-xdist workers) hold at most N of their servers at once, among the processes
# sharing a temporary directory (the slot files live there). A server of
# the tiny model takes about 1.3 GB with its scheduler and I/O processes, and the largest
# module runs eight: two large modules at once came within 3 GB of the machine's 24.
# Unset or 0: no limit.
SERVER_SLOTS_ENV = "PCR_TEST_SERVER_SLOTS"


@contextmanager
def server_budget(count: int) -> Iterator[None]:
    """Hold ``count`` of the machine's server slots (all at once or none, so two modules
    never each hold part of what they need and wait for the other) while a module's
    servers run."""
    slots = slots_from_env(SERVER_SLOTS_ENV)
    held = acquire_slots("test-servers", slots, count) if slots > 0 and count > 0 else []
    try:
        yield
    finally:
        for slot in held:
            slot.close()


@contextmanager
def serving(
    servers: dict[str, ServerProcess],
    start_first: Sequence[str] = (),
    shared: Mapping[str, ServerProcess] = MappingProxyType({}),
) -> Iterator[dict[str, ServerProcess]]:
    """Start several servers at once (their startup is mostly import time); on exit kill
    every server the dict then holds (a test may replace one with a restarted server).
    ``start_first`` are started alone beforehand: HiCache checks at startup that host
    memory beyond a 10 GB reserve is free, which servers starting beside it can use up.
    ``shared`` are added to the dict already running and are left running (the session's
    baseline server, which every module's token-for-token checks use)."""
    with server_budget(len(servers)):
        try:
            for name in start_first:
                servers[name].start()
            rest = [s for name, s in servers.items() if name not in start_first]
            with ThreadPoolExecutor(max(len(rest), 1)) as pool:
                futures = [pool.submit(s.start) for s in rest]
                errors = [f.exception() for f in futures]
            if any(errors):
                raise next(e for e in errors if e)
            servers.update(shared)
            yield servers
        finally:
            # Killed, not stopped: nothing of them is wanted any more, and a graceful stop
            # takes 5-6 s however idle (pcr_tools.launcher.stop_all). The graceful path is
            # still taken where it matters, by the restarts of test_faults and test_ssd_tier.
            kept = {id(s) for s in shared.values()}
            stop_all((s for s in servers.values() if id(s) not in kept), graceful=False)


def generate_greedy(server: ServerProcess, prompts: Sequence[list[int]], concurrency: int = 1):
    """(output_ids, cached_tokens) per prompt, in prompt order."""

    def one(ids):
        out = server.generate({"input_ids": ids, "sampling_params": GREEDY})
        return out["output_ids"], out["meta_info"]["cached_tokens"]

    if concurrency == 1:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


# Device pool ~2.6k tokens and host memory ~5k tokens, for a ~26k-token working set.
TIERED_ARGS = (
    "--max-total-tokens",
    "2600",
    "--context-length",
    "2048",
    "--log-level",
    "warning",
    "--sleep-on-idle",
    "--enable-pcr",
    "--pcr-debug-checks",
    "--pcr-chunk-size",
    str(CHUNK_SIZE),
    "--pcr-dram-gb",
    "0.01",
)


def ssd_server(model: str, path, *extra: str) -> ServerProcess:
    """A PCR server with device, host and SSD tiers (store under ``path``)."""
    return ServerProcess(
        model, (*TIERED_ARGS, "--pcr-ssd-path", str(path), "--pcr-ssd-gb", "0.5", "--pcr-ssd-reserve-gb", "0", *extra)
    )


def wait_for_write_back(server, timeout_s: float = 60) -> dict:
    """Poll until the server has no SSD write in flight (or the timeout); its state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = server.pcr_state()
        if state["ssd"]["writes_in_flight"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def prometheus_counts(server: ServerProcess, metric: str, label: str) -> dict[str, float]:
    """``metric``'s samples on the server's ``/metrics`` (``--enable-metrics``), by the
    value of ``label`` (one series per value: the other labels are the server's own)."""
    import requests

    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    counts = {}
    for line in text.splitlines():
        if line.startswith(metric + "{") and f'{label}="' in line:
            value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
            counts[value] = float(line.rsplit(" ", 1)[1])
    return counts
