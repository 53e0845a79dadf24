"""Queue-based prefetch: timeliness and TTFT for prefetch off and windows 1-16, one trace.

A warm-up server with the SSD tier serves the trace once, so its chunks are persisted.
Then, for each configuration, a fresh server starts on a copy of that store: its device
and host tiers are empty, so every hit is SSD-resident, and the same trace is replayed
with seeded Poisson arrivals at ``--rate`` requests/s, above what the server completes
per second, so the waiting queue builds up (``--rate 0``: all at once, the worst case
for prefetch, since the first batch is scheduled before anything could be read). ``off`` is
``--pcr-prefetch-window 0`` (SSD chunks are read when their request is scheduled); the others
prefetch for the first W waiting requests.

Prints, per configuration: mean and P99 TTFT, prefetch timeliness (share of SSD chunks
needed by scheduled requests already in host memory when their request was scheduled),
prefetch orders issued / late / unused, and whether greedy outputs match the warm-up's.

Usage: python bench/prefetch_sweep.py [--requests 96] [--windows 1,2,4,6,8,16] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pcr_tools.launcher import ServerProcess
from pcr_tools.workload import RagWorkloadParams, chat_prompt, make_rag_workload, working_set_tokens


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def replay(server: ServerProcess, prompts: list[list[int]], max_new_tokens: int, rate: float, seed: int):
    """Send the prompts with Poisson arrivals at ``rate``/s (0: all at once); (TTFT s,
    output ids) per prompt, in prompt order. TTFT counts from each request's arrival."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    start = time.monotonic()

    def one(index):
        time.sleep(max(0.0, start + arrivals[index] - time.monotonic()))
        r = server.generate_stream(
            {"input_ids": prompts[index], "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
        )
        return r.ttft_s, r.final.get("output_ids", [])

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=96, help="enough that the first seconds, before a queue forms, weigh little"
    )
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--windows", default="1,2,4,6,8,16")
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument(
        "--rate",
        type=float,
        default=4.0,
        help="Poisson arrivals per second (0: all at once); the bench model serves ~1/s here",
    )
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--dram-gb",
        type=float,
        default=0.25,
        help="host tier: about a third of the trace's working set, so the window's chunks fit",
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pcr_tools.models.smollm2 import build_smollm2

    model = args.model_path or str(build_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    workload = make_rag_workload(
        RagWorkloadParams(
            num_requests=args.requests, doc_pool_size=args.docs, zipf_exponent=1.0, max_doc_chars=600, seed=args.seed
        )
    )
    prompts = [tok.encode(chat_prompt(tok, r), add_special_tokens=False) for r in workload]
    longest = max(map(len, prompts))
    working_set = working_set_tokens(prompts, args.chunk_size)
    work = Path(tempfile.mkdtemp(prefix="pcr-prefetch-sweep-"))
    warm_store = work / "warm"
    # Device pool of a few prompts and a small host tier: the trace lives on SSD.
    common = (
        "--max-total-tokens",
        str(4 * longest + 256),
        "--context-length",
        str(longest + 256),
        "--log-level",
        "warning",
        "--sleep-on-idle",
        "--enable-pcr",
        "--pcr-chunk-size",
        str(args.chunk_size),
        "--pcr-dram-gb",
        str(args.dram_gb),
        "--pcr-ssd-gb",
        "2",
        "--pcr-ssd-reserve-gb",
        "0",
    )
    print(
        f"trace: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, working set "
        f"{working_set} tokens; arrivals: " + (f"Poisson, {args.rate}/s" if args.rate > 0 else "all at once")
    )
    try:
        with ServerProcess(model, (*common, "--pcr-ssd-path", str(warm_store))) as warm:
            reference = [ids for _, ids in replay(warm, prompts, args.max_new_tokens, 0, args.seed)]
            deadline_state = warm.pcr_state()
            while deadline_state["ssd"]["writes_in_flight"]:
                deadline_state = warm.pcr_state()
        configs = [("off", 0)] + [(f"W={w}", int(w)) for w in args.windows.split(",")]
        rows = []
        for name, window in configs:
            store = work / f"store-{window}"
            shutil.copytree(warm_store, store)
            with ServerProcess(
                model, (*common, "--pcr-ssd-path", str(store), "--pcr-prefetch-window", str(window))
            ) as server:
                results = replay(server, prompts, args.max_new_tokens, args.rate, args.seed)
                ssd = server.pcr_state()["ssd"]
            shutil.rmtree(store)
            ttfts = [t for t, _ in results]
            c = ssd["counters"]
            rows.append(
                (
                    name,
                    statistics.mean(ttfts),
                    percentile(ttfts, 0.99),
                    ssd["prefetch_timeliness"],
                    c,
                    [ids for _, ids in results] == reference,
                )
            )
            print(f"  {name}: done", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{'config':7} {'TTFT mean':>10} {'P99':>9} {'timeliness':>11} {'issued':>7} {'in time':>8} "
        f"{'late':>5} {'on demand':>10} {'unused':>7}  outputs"
    )
    for name, mean, p99, timely, c, same in rows:
        timely_text = "-" if timely is None else f"{timely:.1%}"
        print(
            f"{name:7} {mean * 1000:>8.0f}ms {p99 * 1000:>7.0f}ms {timely_text:>11} {c['prefetch_issued']:>7} "
            f"{c['prefetch_in_time']:>8} {c['prefetch_late']:>5} {c['on_demand_reads']:>10} "
            f"{c['prefetch_unused']:>7}  {'same' if same else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    main()
