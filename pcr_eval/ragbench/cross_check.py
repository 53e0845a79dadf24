"""The same server configurations measured by SGLang's own client, not ours.

``python -m sglang.benchmark.serving --dataset-name generated-shared-prefix
--gsp-group-distribution zipf`` sends groups of prompts that share a long system prompt,
with Zipf group popularity, at a Poisson request rate. Each configuration gets a fresh
server with the device pool at the same fraction of *this* workload's working set (never
below one prompt plus 256 tokens) and the same host / disk budgets, as in the main runs;
the figures come from the client's JSON.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from pcr_eval.ragbench.runner import Budgets, ServerPool, plan_server

logger = logging.getLogger(__name__)

REPORTED = (
    "completed",
    "request_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_e2e_latency_ms",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "mean_itl_ms",
)
CACHE_REPORTED = ("cache_hit_rate_pct", "device_cached_tokens", "host_cached_tokens", "storage_cached_tokens")


@dataclass(frozen=True)
class SharedPrefixWorkload:
    num_groups: int = 8
    prompts: int = 16
    system_prompt_len: int = 512
    question_len: int = 64
    output_len: int = 8
    zipf_alpha: float = 1.1
    seed: int = 1

    @property
    def prompts_per_group(self) -> int:
        return -(-self.prompts // self.num_groups)

    @property
    def working_set_tokens(self) -> int:
        return self.num_groups * (self.system_prompt_len + self.prompts_per_group * self.question_len)

    def client_args(self) -> list[str]:
        return [
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            str(self.num_groups),
            "--gsp-prompts-per-group",
            str(self.prompts_per_group),
            "--gsp-system-prompt-len",
            str(self.system_prompt_len),
            "--gsp-question-len",
            str(self.question_len),
            "--gsp-output-len",
            str(self.output_len),
            "--gsp-group-distribution",
            "zipf",
            "--gsp-zipf-alpha",
            str(self.zipf_alpha),
            "--seed",
            str(self.seed),
        ]  # the dataset sends groups x prompts per group


def budgets_for_workload(
    workload: SharedPrefixWorkload, like: Budgets, pool_fraction: float, host_fraction: float, bytes_per_token: int
) -> Budgets:
    working_set = workload.working_set_tokens
    longest = workload.system_prompt_len + workload.question_len + workload.output_len
    return replace(
        like,
        device_pool_tokens=max(int(working_set * pool_fraction), longest + 256),
        oracle_pool_tokens=4 * working_set,
        host_gb=round(max(working_set * host_fraction * bytes_per_token / 2**30, 0.05), 3),
        ssd_gb=round(max(4 * working_set * bytes_per_token / 2**30, 1.0), 2),
        context_length=longest + 256,
    )


def run_client(
    model_path: str, base_url: str, workload: SharedPrefixWorkload, rate: float, out_file: Path, timeout_s: float = 1200
) -> dict[str, Any]:
    """Run SGLang's serving benchmark against ``base_url``; its summary as a dict. No warm-up
    request: it would prime the cache with the first prompt before the clock starts."""
    out_file.unlink(missing_ok=True)  # the client appends
    cmd = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--backend",
        "sglang",
        "--base-url",
        base_url,
        "--model",
        model_path,
        "--tokenizer",
        model_path,
        *workload.client_args(),
        "--request-rate",
        f"{rate:g}",
        "--warmup-requests",
        "0",
        "--cache-report",
        "--output-file",
        str(out_file),
        "--disable-tqdm",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not out_file.is_file():
        raise RuntimeError(f"sglang.benchmark.serving failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads(out_file.read_text().splitlines()[-1])
    cache = summary.get("cache_report") or {}
    return {**{k: summary.get(k) for k in REPORTED}, **{k: cache.get(k) for k in CACHE_REPORTED}}


def run_cross_check(
    model_path: str,
    like: Budgets,
    configs: Sequence[str],
    rate: float,
    work_dir: Path,
    pool_fraction: float,
    host_fraction: float,
    bytes_per_token: int,
    workload: Optional[SharedPrefixWorkload] = None,
) -> dict[str, Any]:
    workload = workload or SharedPrefixWorkload()
    budgets = budgets_for_workload(workload, like, pool_fraction, host_fraction, bytes_per_token)
    results: dict[str, Any] = {"workload": workload.__dict__, "rate": rate, "budgets": budgets.__dict__, "configs": {}}
    plans = [plan_server(name, budgets, work_dir, f"xcheck-{name}.log") for name in configs]
    with ServerPool(model_path, plans) as servers:
        for index, name in enumerate(configs):
            try:
                server, _ = servers.acquire(index)
            except (RuntimeError, TimeoutError, OSError) as e:
                logger.error("cross-check of %s failed: %s", name, e)
                results["configs"][name] = {"error": str(e)[-500:]}
                continue
            try:
                results["configs"][name] = run_client(
                    model_path, server.base_url, workload, rate, work_dir / f"xcheck-{name}.jsonl"
                )
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                logger.error("cross-check of %s failed: %s", name, e)
                results["configs"][name] = {"error": str(e)[-500:]}
            finally:
                servers.release(index, server)
    return results
