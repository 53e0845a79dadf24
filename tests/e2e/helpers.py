from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from pcr_sglang.launcher import ServerProcess

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
COMMON_ARGS = (
    "--max-total-tokens", "24000", "--context-length", "4096", "--log-level", "warning",
    "--sleep-on-idle",
)


def start_servers(servers: Sequence[ServerProcess]) -> None:
    """Start several servers at once (their startup is mostly import time)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.start) for s in servers]
        errors = [f.exception() for f in futures]
    if any(errors):
        for s in servers:
            s.stop()
        raise next(e for e in errors if e)


def generate_greedy(server: ServerProcess, prompts: Sequence[list[int]], concurrency: int = 1):
    """(output_ids, cached_tokens) per prompt, in prompt order."""

    def one(ids):
        out = server.generate({"input_ids": ids, "sampling_params": GREEDY})
        return out["output_ids"], out["meta_info"]["cached_tokens"]

    if concurrency == 1:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))
