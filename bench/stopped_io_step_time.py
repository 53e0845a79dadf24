"""Scheduler step times while PCR's I/O process is stopped (SIGSTOP) for 30 s.

One PCR server with device, host and SSD tiers serves a RAG workload (the tiny test
model by default: the scheduler's own work is what is measured, not the model's) from
``--clients`` concurrent clients. A warm-up pass fills the SSD tier; then the same
prompts are replayed for ``--phase-s`` seconds with the I/O process running, then for
``--stop-s`` seconds with it stopped (SIGSTOP; the supervisor kills a process that
stays silent for 30 s with orders outstanding, and starts a new one). For each phase it
prints, side by side: P50/P99/max of PCR's own work per scheduler step and of the
scheduler's loop iterations (from ``/server_info``'s cumulative histograms, taken
between the phase's two snapshots), TTFT P50/P99, requests served and whether every
output equals the warm-up's.

What it guards: a scheduler that waits for the disk. Requests whose chunks are on SSD
wait in the queue for their reads (at most about what recomputing them costs), never
in a scheduler step; a stopped or dying I/O process costs hits, not step time.

Usage: python bench/stopped_io_step_time.py [--stop-s 30] [--phase-s 30] [--clients 8] [--model-path DIR]
       [--server-pythonpath DIR]  (serve with another checkout of pcr_sglang, to compare versions:
                                   step histograms are shown only where its server reports them)
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pcr_sglang.sglang_adapter.step_timing import between, percentile_ms
from pcr_tools.launcher import ServerProcess
from pcr_tools.workload import RagWorkloadParams, make_rag_workload


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def replay_for(server: ServerProcess, prompts: list[list[int]], seconds: float, clients: int,
               max_new_tokens: int) -> list[tuple[int, float, list[int]]]:
    """Clients send the prompts round-robin until ``seconds`` have passed: (prompt index,
    TTFT, output ids) per request."""
    stop = time.monotonic() + seconds
    lock, results, counter = threading.Lock(), [], [0]

    def client() -> None:
        while time.monotonic() < stop:
            with lock:
                index = counter[0] % len(prompts)
                counter[0] += 1
            r = server.generate_stream({"input_ids": prompts[index],
                                        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}})
            with lock:
                results.append((index, r.ttft_s, r.final.get("output_ids", [])))

    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    return results


def histograms(server: ServerProcess) -> dict:
    step = server.pcr_state().get("scheduler_step")
    if step is None:  # a version without step histograms (--server-pythonpath)
        return {"pcr": [], "iteration": []}
    return {name: step[name]["counts"] for name in ("pcr", "iteration")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop-s", type=float, default=30.0, help="how long the I/O process is stopped")
    parser.add_argument("--phase-s", type=float, default=30.0, help="how long the running phase replays")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=40, help="distinct prompts in the workload")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--model-path", default=None, help="default: the tiny test model (built offline)")
    parser.add_argument("--server-pythonpath", default=None,
                        help="put this checkout first on the server's PYTHONPATH (compare versions)")
    args = parser.parse_args()
    if args.model_path is None:
        from pcr_tools.models.tiny_llama import build_tiny_llama

        args.model_path = str(build_tiny_llama())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    workload = make_rag_workload(RagWorkloadParams(num_requests=args.requests, doc_pool_size=40, min_docs=3,
                                                   max_docs=5, max_doc_chars=700, seed=7))
    prompts = [tokenizer.encode(r.plain_prompt()) for r in workload]
    with tempfile.TemporaryDirectory(prefix="pcr-stopped-io-") as work:
        server = ServerProcess(args.model_path, (
            "--max-total-tokens", "2600", "--context-length", "2048", "--log-level", "warning",
            "--enable-pcr", "--pcr-debug-checks", "--pcr-chunk-size", "16", "--pcr-dram-gb", "0.003",
            "--pcr-ssd-path", str(Path(work) / "store"), "--pcr-ssd-gb", "0.5", "--pcr-ssd-reserve-gb", "0"),
            env={"PYTHONPATH": args.server_pythonpath} if args.server_pythonpath else {},
            cwd=args.server_pythonpath)
        with server:
            print(f"server ready in {server.startup_seconds:.0f} s; warm-up pass over {len(prompts)} prompts",
                  flush=True)
            reference = {}
            with ThreadPoolExecutor(4) as pool:
                for index, out in enumerate(pool.map(lambda p: server.generate(
                        {"input_ids": p, "sampling_params": {"temperature": 0.0,
                                                             "max_new_tokens": args.max_new_tokens}}), prompts)):
                    reference[index] = out["output_ids"]
            while server.pcr_state()["ssd"]["writes_in_flight"]:
                time.sleep(0.5)
            rows = []
            before = histograms(server)
            running = replay_for(server, prompts, args.phase_s, args.clients, args.max_new_tokens)
            middle = histograms(server)
            pid = server.pcr_state()["ssd"]["io_process"]["pid"]
            os.kill(pid, signal.SIGSTOP)
            print(f"I/O process {pid} stopped for {args.stop_s:.0f} s", flush=True)
            try:
                stopped = replay_for(server, prompts, args.stop_s, args.clients, args.max_new_tokens)
            finally:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # the supervisor killed it (silent for 30 s) and started another
            after = histograms(server)
            state = server.pcr_state(check_invariants=True)
            for name, results, start, end in (("running", running, before, middle),
                                              ("stopped", stopped, middle, after)):
                pcr = between(start["pcr"], end["pcr"])
                loop = between(start["iteration"], end["iteration"])
                ttfts = [t for _, t, _ in results]
                same = all(ids == reference[i] for i, _, ids in results)
                rows.append((name, percentile_ms(pcr, 0.5), percentile_ms(pcr, 0.99), percentile_ms(loop, 0.5),
                             percentile_ms(loop, 0.99), sum(loop), statistics.median(ttfts) * 1000,
                             percentile(ttfts, 0.99) * 1000, len(results), same))
    print(f"\n{'phase':8} {'PCR step P50':>12} {'P99':>8} {'loop P50':>9} {'P99':>8} {'steps':>7} "
          f"{'TTFT P50':>9} {'P99':>8} {'requests':>9}  outputs")
    ms = lambda v: f"{v:.2f}ms" if v is not None else "-"  # noqa: E731
    for name, p50, p99, l50, l99, steps, t50, t99, n, same in rows:
        print(f"{name:8} {ms(p50):>12} {ms(p99):>8} {ms(l50):>9} {ms(l99):>8} {steps:>7} "
              f"{t50:>7.0f}ms {t99:>6.0f}ms {n:>9}  {'same' if same else 'DIFFERENT'}")
    ssd = state["ssd"]
    print(f"\nI/O process: {ssd['io_process']}, failures {ssd['counters']['io_failures']}, "
          f"restarts {ssd['counters']['io_restarts']}; host slots {state.get('host_slots')}; "
          f"invariants ok: {state['invariants']['ok']}")
    print("Histogram buckets are 19% wide: a percentile is the upper edge of its bucket.")


if __name__ == "__main__":
    main()
