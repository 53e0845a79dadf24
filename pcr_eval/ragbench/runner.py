"""Replay a trace against real SGLang servers, one configuration and rate at a time.

Every configuration serves the same model with the same device KV pool (a fraction of the
trace's working set); the tiered ones get the same host-memory and disk budgets:

* ``radix``          SGLang's default radix cache.
* ``nocache``        ``--disable-radix-cache``: every prompt prefilled in full (the floor, and
                     the server whose capacity the operating points are set from).
* ``hicache``        SGLang's hierarchical cache: host tier plus the ``file`` storage backend,
                     capped at the disk budget.
* ``oracle``         the radix cache with a pool that never evicts: what any prefix cache
                     could reuse on this trace.
* ``pcr``            PCR with host memory, the SSD tier, prefetch, layer-wise copies and
                     look-ahead eviction.
* ``pcr-layerwise``, ``pcr-prefetch``, ``pcr-lookahead``: PCR without that one feature;
  ``pcr-device``: PCR without its host and SSD tiers (the chunk tree over the device pool).
* ``pcr-docs``, ``pcr-blend`` (``-pre``, ``-eager``, ``-idle``), ``pcr-blend-cal`` (``-pre``,
  ``-idle``, ``-request``), ``pcr-reorder``: PCR with document reuse (``DOC_REUSE_CONFIGS`` below).

The client sends each first turn at its Poisson arrival time (scaled to the rate) and each
follow-up after its session's previous answer plus the think time, streams the reply, and
records TTFT, inter-token latency, end-to-end latency, cached tokens by tier and the output
tokens. A sampler reads SGLang's ``sglang:num_queue_reqs`` gauge to report the queue depth.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import requests

from pcr_eval.ragbench.workload import Trace, TraceRequest
from pcr_tools.launcher import ServerProcess
from pcr_tools.models.smollm2 import TUNED_CALIBRATION

logger = logging.getLogger(__name__)

CONFIG_NAMES = (
    "radix",
    "nocache",
    "hicache",
    "oracle",
    "pcr",
    "pcr-docs",
    "pcr-docs-pre",
    "pcr-blend",
    "pcr-blend-pre",
    "pcr-docs-eager",
    "pcr-docs-idle",
    "pcr-layerwise",
    "pcr-prefetch",
    "pcr-lookahead",
    "pcr-blend-cal",
    "pcr-blend-cal-pre",
    "pcr-blend-cal-idle",
    "pcr-blend-cal-request",
    "pcr-reorder",
    "pcr-device",
)
# PCR with document reuse in any order: requests mark their documents; "docs" is concat
# (no recompute), "blend" recomputes the default 15% of re-placed tokens (CacheBlend);
# "-pre" first fills the store with every trace document's canonical KV (TurboRAG's
# offline phase, ``python -m pcr_tools.precompute``) and restarts the server.
# The warm-up policy (--pcr-doc-warmup, --pcr-doc-warmup-after): the default warms a
# document when it recurs, before the request that sees it again if nothing else is in
# flight, else while the server is idle ("-request": always before); "-eager" warms every
# first sighting before its request; "-idle" every first sighting, after its request,
# while nothing else is in flight.
CALIBRATED_BLEND = ("--pcr-doc-reuse", "blend", "--pcr-doc-reuse-calibration", str(TUNED_CALIBRATION))
DOC_REUSE_CONFIGS = {
    "pcr-docs": ("--pcr-doc-reuse", "concat"),
    "pcr-docs-pre": ("--pcr-doc-reuse", "concat"),
    "pcr-blend": ("--pcr-doc-reuse", "blend"),
    "pcr-blend-pre": ("--pcr-doc-reuse", "blend"),
    "pcr-docs-eager": ("--pcr-doc-reuse", "concat", "--pcr-doc-warmup-after", "1"),
    "pcr-docs-idle": ("--pcr-doc-reuse", "concat", "--pcr-doc-warmup", "idle", "--pcr-doc-warmup-after", "1"),
    # The tuned model's calibrated default (its committed calibration chooses the
    # mode's R and selector, and refuses other weights), and the exact mode that
    # serves documents in an order already cached.
    "pcr-blend-cal": CALIBRATED_BLEND,
    "pcr-blend-cal-pre": CALIBRATED_BLEND,
    # The same with warm-ups only while the server is idle: a request never
    # waits for its documents' warm-ups (what they cost under load, read
    # against pcr-blend-cal).
    "pcr-blend-cal-idle": (*CALIBRATED_BLEND, "--pcr-doc-warmup", "idle"),
    # The same with every request waiting for its due warm-ups (the default before "auto").
    "pcr-blend-cal-request": (*CALIBRATED_BLEND, "--pcr-doc-warmup", "request"),
    "pcr-reorder": ("--pcr-doc-reuse", "reorder"),
}
# Configurations that need the document-reuse tuned model (its calibration refuses others).
TUNED_ONLY_CONFIGS = ("pcr-blend-cal", "pcr-blend-cal-pre", "pcr-blend-cal-idle", "pcr-blend-cal-request")
# What runs without --configs: the warm-up variants and the tuned model's only when asked for.
DEFAULT_CONFIGS = tuple(
    c
    for c in CONFIG_NAMES
    if c not in ("nocache", "pcr-docs-eager", "pcr-docs-idle", "pcr-reorder", "pcr-device", *TUNED_ONLY_CONFIGS)
)
PRECOMPUTED_CONFIGS = ("pcr-docs-pre", "pcr-blend-pre", "pcr-blend-cal-pre")
# PCR without one feature: the flag that turns it off.
ABLATIONS = {
    "pcr-layerwise": ("--pcr-layerwise", "off"),
    "pcr-prefetch": ("--pcr-prefetch-window", "0"),
    "pcr-lookahead": ("--pcr-lookahead-window", "0"),
}
# Configurations whose whole cache lives in the device pool: SGLang's /flush_cache empties
# it, so a flushed server starts the next run as a fresh one would, and saves a server start
# (about 35 s on two cores). HiCache and PCR keep host and disk tiers a flush does not reset.
REUSABLE_CONFIGS = ("radix", "nocache", "oracle")
HICACHE_STORAGE_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
HICACHE_MAX_SIZE_ENV = "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"  # bytes; LRU-evicted above it


@dataclass(frozen=True)
class Budgets:
    """What every configuration of one run gets (the oracle's pool aside)."""

    device_pool_tokens: int
    oracle_pool_tokens: int
    host_gb: float
    ssd_gb: float
    context_length: int
    kv_bytes_per_token: int
    chunk_size: int = 16
    page_size: int = 16  # HiCache's page; PCR's chunk size matches it

    @property
    def hicache_ratio(self) -> float:
        """HiCache sizes its host pool as a multiple of the device pool (``--hicache-size``
        takes whole GB only): the multiple that gives it ``host_gb``."""
        host_tokens = self.host_gb * 2**30 / self.kv_bytes_per_token
        return host_tokens / self.device_pool_tokens


@dataclass(frozen=True)
class ServerConfig:
    name: str
    args: tuple[str, ...]
    storage_dir: Optional[Path] = None  # a fresh, empty directory per run
    env: dict[str, str] = field(default_factory=dict)


def server_config(name: str, budgets: Budgets, storage_dir: Path) -> ServerConfig:
    common = (
        "--context-length",
        str(budgets.context_length),
        "--log-level",
        "warning",
        "--sleep-on-idle",
        "--enable-metrics",
    )
    pool = ("--max-total-tokens", str(budgets.device_pool_tokens))
    if name == "radix":
        return ServerConfig(name, (*pool, *common))
    if name == "nocache":
        return ServerConfig(name, (*pool, *common, "--disable-radix-cache"))
    if name == "oracle":
        return ServerConfig(name, ("--max-total-tokens", str(budgets.oracle_pool_tokens), *common))
    if name == "hicache":
        return ServerConfig(
            name,
            (
                *pool,
                *common,
                "--page-size",
                str(budgets.page_size),
                "--enable-hierarchical-cache",
                "--hicache-ratio",
                f"{budgets.hicache_ratio:.4f}",
                "--hicache-storage-backend",
                "file",
            ),
            storage_dir=storage_dir,
            env={HICACHE_STORAGE_ENV: str(storage_dir), HICACHE_MAX_SIZE_ENV: str(int(budgets.ssd_gb * 2**30))},
        )
    if name == "pcr-device":  # PCR's chunk tree over the device pool alone: what its tiers cost, read against pcr
        return ServerConfig(
            name, (*pool, *common, "--enable-pcr", "--pcr-chunk-size", str(budgets.chunk_size), "--pcr-dram-gb", "0")
        )
    if name == "pcr" or name in ABLATIONS or name in DOC_REUSE_CONFIGS:
        args = (
            *pool,
            *common,
            "--enable-pcr",
            "--pcr-chunk-size",
            str(budgets.chunk_size),
            "--pcr-dram-gb",
            _gb_arg(budgets.host_gb),
            "--pcr-ssd-path",
            str(storage_dir),
            "--pcr-ssd-gb",
            _gb_arg(budgets.ssd_gb),
            "--pcr-ssd-reserve-gb",
            "0",
        )
        return ServerConfig(
            name, (*args, *ABLATIONS.get(name, ()), *DOC_REUSE_CONFIGS.get(name, ())), storage_dir=storage_dir
        )
    raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIG_NAMES)}")


def build_hicache_extension(timeout_s: float = 600.0) -> None:
    """Build HiCache's C++ hash extension now, if its cache needs it. HiCache compiles it
    with torch's JIT loader in the scheduler process, after the server says it is ready
    (about 20-35 s of compiler on one core here), and torch's cache sometimes wants a
    rebuild. Done during a run, that would slow whichever run is in progress."""
    code = "from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module; _load_native_hash_module()"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("building HiCache's hash extension took over %.0f s; HiCache servers build it", timeout_s)
        return
    if done.returncode != 0:
        logger.warning(
            "could not build HiCache's hash extension ahead (HiCache servers will try): %s",
            done.stderr.strip().splitlines()[-1:] or done.returncode,
        )


def _gb_arg(value: float) -> str:
    return f"{value:g}"


@dataclass
class RequestRecord:
    rid: str
    session: str
    turn: int
    scheduled_s: float  # when the client meant to send it, from the run's start
    sent_s: float
    ttft_s: float
    e2e_s: float
    itl_s: Optional[float]  # mean gap between output tokens after the first
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    output_ids: list[int]
    error: Optional[str] = None
    input_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class RunResult:
    config: str
    rate: float
    label: str  # which trace / sweep point
    pool_fraction: float
    records: list[RequestRecord]
    makespan_s: float
    startup_s: float
    queue_depth_mean: float
    queue_depth_max: float
    server_state: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- client
def _cached_by_tier(meta: dict[str, Any]) -> dict[str, int]:
    """Cached prompt tokens by where they came from. SGLang reports ``cached_tokens`` and,
    for tiered caches, ``cached_tokens_details`` (``device``, ``host``, ``storage``...)."""
    cached = int(meta.get("cached_tokens", 0))
    details = meta.get("cached_tokens_details") or {}
    tiers = {k: int(v) for k, v in details.items() if isinstance(v, (int, float)) and k != "total"}
    if not tiers:
        return {"device": cached} if cached else {}
    if "device" not in tiers:
        tiers["device"] = max(cached - sum(tiers.values()), 0)
    return {k: v for k, v in tiers.items() if v}


class QueueSampler:
    """Samples the server's waiting-queue gauge while a run is in progress."""

    _GAUGE = re.compile(r"^sglang:num_queue_reqs\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)

    def __init__(self, base_url: str, interval_s: float = 0.25):
        self.base_url, self.interval_s = base_url, interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                text = requests.get(f"{self.base_url}/metrics", timeout=5).text
            except requests.RequestException:
                continue
            values = [float(v) for v in self._GAUGE.findall(text)]
            if values:
                self.samples.append(sum(values))


Prompter = Callable[[TraceRequest, dict[str, str]], tuple[list[int], list[int]]]


def replay(
    server: ServerProcess,
    trace: Trace,
    prompt_of: Prompter,
    decode: Callable[[list[int]], str],
    rate: float,
    on_done: Callable[[], None] = lambda: None,
    timeout_s: float = 900.0,
    mark_docs: bool = False,
) -> tuple[list[RequestRecord], float, list[float]]:
    """Send ``trace`` at ``rate`` first turns per second; a session's follow-ups go after its
    previous answer and think time. ``prompt_of`` gives a request's token ids and its
    documents' bounds (given answers so far); with ``mark_docs`` the bounds are sent too.
    Returns records (trace order), makespan, queue samples."""
    if rate <= 0:
        raise ValueError("rate must be > 0 requests/s")
    sessions: dict[str, list[TraceRequest]] = {}
    for request in trace.requests:
        sessions.setdefault(request.session, []).append(request)
    answers: dict[str, str] = {}
    first = {r.rid: prompt_of(r, answers) for r in trace.first_turns()}
    records: dict[str, RequestRecord] = {}
    start = time.perf_counter()

    def run_session(turns: list[TraceRequest]) -> None:
        for request in turns:
            if request.parent is None:
                scheduled = request.arrival / rate
                time.sleep(max(0.0, start + scheduled - time.perf_counter()))
                ids, bounds = first[request.rid]
            else:
                time.sleep(request.think_s)
                scheduled = time.perf_counter() - start
                ids, bounds = prompt_of(request, answers)
            sent = time.perf_counter() - start
            sampling: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": request.max_new_tokens}
            if mark_docs and bounds:
                sampling["custom_params"] = {"pcr_doc_bounds": list(bounds)}
            try:
                reply = server.generate_stream(
                    {"input_ids": list(ids), "sampling_params": sampling}, timeout_s=timeout_s
                )
                # A reply with no data chunk before the end has its first token at the end.
                ttft = reply.latency_s if math.isnan(reply.ttft_s) else reply.ttft_s
                meta = reply.final.get("meta_info", {})
                output_ids = list(reply.final.get("output_ids") or [])
                answers[request.rid] = decode(output_ids)
                completion = max(len(output_ids), 1)
                records[request.rid] = RequestRecord(
                    rid=request.rid,
                    session=request.session,
                    turn=request.turn,
                    scheduled_s=scheduled,
                    sent_s=sent,
                    ttft_s=ttft,
                    e2e_s=reply.latency_s,
                    itl_s=(reply.latency_s - ttft) / (completion - 1) if completion > 1 else None,
                    prompt_tokens=int(meta.get("prompt_tokens", len(ids))),
                    cached_tokens=int(meta.get("cached_tokens", 0)),
                    cached_by_tier=_cached_by_tier(meta),
                    output_ids=output_ids,
                    input_ids=list(ids),
                )
            except (requests.RequestException, ValueError) as e:
                records[request.rid] = RequestRecord(
                    rid=request.rid,
                    session=request.session,
                    turn=request.turn,
                    scheduled_s=scheduled,
                    sent_s=sent,
                    ttft_s=float("nan"),
                    e2e_s=float("nan"),
                    itl_s=None,
                    prompt_tokens=len(ids),
                    cached_tokens=0,
                    cached_by_tier={},
                    output_ids=[],
                    error=str(e),
                )
                on_done()
                for skipped in turns[turns.index(request) + 1 :]:  # the session cannot go on
                    records[skipped.rid] = RequestRecord(
                        rid=skipped.rid,
                        session=skipped.session,
                        turn=skipped.turn,
                        scheduled_s=scheduled,
                        sent_s=sent,
                        ttft_s=float("nan"),
                        e2e_s=float("nan"),
                        itl_s=None,
                        prompt_tokens=0,
                        cached_tokens=0,
                        cached_by_tier={},
                        output_ids=[],
                        error="previous turn failed",
                    )
                    on_done()
                return
            on_done()

    with QueueSampler(server.base_url) as sampler, ThreadPoolExecutor(max(len(sessions), 1)) as pool:
        for future in [pool.submit(run_session, turns) for turns in sessions.values()]:
            future.result()
    makespan = time.perf_counter() - start
    return [records[r.rid] for r in trace.requests], makespan, sampler.samples


# ---------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class ServerPlan:
    """A server some run will need: its configuration, where it logs, and its storage
    directory (empty, made for it; the disk tiers' configurations use it)."""

    server: ServerConfig
    log_path: Path
    storage_dir: Path

    @property
    def config(self) -> str:
        return self.server.name

    @property
    def kept(self) -> bool:
        return self.server.name in REUSABLE_CONFIGS

    @property
    def key(self) -> tuple:
        """Kept servers are shared by runs with the same command line."""
        return self.server.args, tuple(sorted(self.server.env.items()))


def plan_server(config_name: str, budgets: Budgets, work_dir: Path, log_name: str) -> ServerPlan:
    storage = Path(tempfile.mkdtemp(prefix=f"{config_name}-", dir=work_dir))
    return ServerPlan(server_config(config_name, budgets, storage), work_dir / log_name, storage)


@dataclass(frozen=True)
class PlannedRun:
    """One configuration replaying one trace at one rate."""

    plan: ServerPlan
    budgets: Budgets
    trace: Trace
    rate: float
    label: str  # which trace / sweep point
    pool_fraction: float

    @property
    def config(self) -> str:
        return self.plan.config


def plan_run(
    config_name: str, budgets: Budgets, trace: Trace, rate: float, label: str, pool_fraction: float, work_dir: Path
) -> PlannedRun:
    plan = plan_server(config_name, budgets, work_dir, f"{label}-{config_name}-{rate:g}.log")
    return PlannedRun(plan, budgets, trace, rate, label, pool_fraction)


class ServerPool:
    """The servers of a list of runs (``plans``, in the order the runs go), one at a time.

    Every HiCache and PCR run gets a fresh server, started just before it. Runs of
    ``REUSABLE_CONFIGS`` with the same command line share one server, flushed before each
    run, and killed after the last run that needs it.
    """

    def __init__(self, model_path: str, plans: list[ServerPlan]):
        self.model_path, self.plans = model_path, plans
        self._last_use = {plan.key: i for i, plan in enumerate(plans) if plan.kept}
        self._kept: dict[tuple, ServerProcess] = {}

    def acquire(self, index: int) -> tuple[ServerProcess, bool]:
        """Run ``index``'s server, and whether it is a kept one (then just flushed).
        Raises what its start raised."""
        plan = self.plans[index]
        kept = self._kept.get(plan.key) if plan.kept else None
        if kept is not None:
            try:
                kept.flush_cache()
                return kept, True
            except (requests.RequestException, RuntimeError) as e:  # it died: start another
                logger.warning("the kept %s server failed (%s); starting a new one", plan.config, e)
                del self._kept[plan.key]
                kept.kill()
        server = ServerProcess(self.model_path, plan.server.args, env=plan.server.env, log_path=plan.log_path)
        server.start()
        if plan.kept:
            self._kept[plan.key] = server
        return server, False

    def release(self, index: int, server: ServerProcess, failed: bool = False) -> None:
        """After run ``index``: kill its server unless a later run keeps using it. Killing
        is safe for every configuration here and saves seconds a graceful stop takes: the
        launcher removes a PCR host pool its killed scheduler left, PCR's I/O process dies
        with its scheduler, and the run's storage directory is removed."""
        plan = self.plans[index]
        shutil.rmtree(plan.storage_dir, ignore_errors=True)
        if plan.kept:
            if not failed and self._last_use[plan.key] > index:
                return
            self._kept.pop(plan.key, None)
        server.kill()

    def precompute(self, index: int, server: ServerProcess, trace: Trace, prompt_of: Prompter) -> ServerProcess:
        """``pcr-docs-pre``, ``pcr-blend-pre``: fill run ``index``'s store with the canonical KV of every document
        the trace uses (one ``S ‖ d`` warm-up each, as ``python -m pcr_tools.precompute``
        sends), wait for SSD write-back, and restart on the same store: the run then starts
        on a server that has never seen these documents in traffic."""
        from pcr_tools.precompute import document_warmup, precompute, wait_for_ssd_writes

        warmups: list[tuple[list[int], list[int]]] = []
        seen: set[str] = set()
        for request in trace.first_turns():
            ids, bounds = prompt_of(request, {})
            leading = ids[: bounds[0]]
            for doc_id, start, end in zip(request.doc_ids, bounds[::2], bounds[1::2]):
                if doc_id not in seen:
                    seen.add(doc_id)
                    warmups.append(document_warmup(leading, ids[start:end]))
        result = precompute(server.base_url, warmups)
        on_disk = wait_for_ssd_writes(server.base_url)
        logger.info(
            "precomputed %d documents (%d tokens) in %.1f s, %s; restarting",
            result.documents,
            result.tokens,
            result.seconds,
            "on SSD" if on_disk else "NOT all on SSD",
        )
        server.stop()
        plan = self.plans[index]
        restarted = ServerProcess(self.model_path, plan.server.args, env=plan.server.env, log_path=plan.log_path)
        restarted.start()
        return restarted

    def close(self) -> None:
        """Kill the servers still kept and remove the runs' storage directories."""
        for server in self._kept.values():
            server.kill()
        self._kept = {}
        for plan in self.plans:
            shutil.rmtree(plan.storage_dir, ignore_errors=True)

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_planned(
    run: PlannedRun,
    servers: ServerPool,
    index: int,
    prompt_of: Prompter,
    decode: Callable[[list[int]], str],
    on_done: Callable[[], None] = lambda: None,
) -> RunResult:
    """Replay ``run`` on server ``index`` of ``servers`` (see ``ServerPool``)."""
    server, reused = servers.acquire(index)
    failed = True
    try:
        if run.config in PRECOMPUTED_CONFIGS:
            server = servers.precompute(index, server, run.trace, prompt_of)
        records, makespan, samples = replay(
            server, run.trace, prompt_of, decode, run.rate, on_done, mark_docs=run.config in DOC_REUSE_CONFIGS
        )
        state: dict[str, Any] = server.pcr_state() if run.config.startswith("pcr") else {}
        failed = False
    finally:
        servers.release(index, server, failed=failed)
    return RunResult(
        config=run.config,
        rate=run.rate,
        label=run.label,
        pool_fraction=run.pool_fraction,
        records=records,
        makespan_s=makespan,
        startup_s=0.0 if reused else server.startup_seconds,
        queue_depth_mean=statistics.mean(samples) if samples else 0.0,
        queue_depth_max=max(samples) if samples else 0.0,
        server_state=state,
    )
