"""Side by side on one RAG trace: SGLang's radix cache, PCR with a host tier, and the oracle.

* ``radix``  SGLang's default radix cache with a device KV pool far smaller than the
             trace's working set (``--pool-fraction`` of it, default 1/7);
* ``pcr-C``  PCR with chunks of C tokens (one run per ``--chunk-sizes`` entry), the same
             device pool plus ``--dram-gb`` of host memory and ``--layerwise`` copies;
* ``oracle`` SGLang's radix cache with a pool large enough never to evict: the most any
             prefix cache can reuse on this trace.

The trace: seeded RAG requests over the offline Wikipedia articles (3-5 documents drawn
with Zipf popularity, chat template applied), sent one at a time and streamed, so TTFT
is measured without queueing. Prints reused tokens, mean/P50/P99 TTFT and the ratios,
PCR's hits by tier, and whether the three configurations' greedy outputs agree.

Usage: python bench/tier_compare.py [--requests 48] [--chunk-sizes 8,32] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from pcr_tools.launcher import ServerProcess
from pcr_tools.workload import RagWorkloadParams, chat_prompt, make_rag_workload, working_set_tokens


@dataclass
class Result:
    ttft_s: float
    cached: int
    host_cached: int  # of ``cached``, tokens copied back from PCR's host tier
    prompt: int
    output_ids: list


def stream(server: ServerProcess, ids: list[int], max_new_tokens: int) -> Result:
    response = server.generate_stream(
        {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    )
    meta = response.final["meta_info"]
    host = (meta.get("cached_tokens_details") or {}).get("host", 0)
    return Result(
        response.ttft_s, meta["cached_tokens"], host, meta["prompt_tokens"], response.final.get("output_ids", [])
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--docs", type=int, default=24, help="document pool size")
    parser.add_argument(
        "--pool-fraction", type=float, default=1 / 7, help="device KV pool as a fraction of the trace's working set"
    )
    parser.add_argument("--dram-gb", type=float, default=2.0)
    parser.add_argument(
        "--chunk-sizes", default="8,32", help="PCR chunk sizes to run, comma-separated; the first sizes the pool"
    )
    parser.add_argument("--layerwise", default="both", choices=["off", "load", "offload", "both"])
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--seed", type=int, default=0)
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
    prompts = [tok.encode(chat_prompt(tok, req), add_special_tokens=False) for req in workload]
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    working_set = working_set_tokens(prompts, chunk_sizes[0])
    longest = max(len(p) for p in prompts)
    pool = max(int(working_set * args.pool_fraction), 2 * longest + 256)
    common = ("--context-length", str(longest + 512), "--log-level", "warning", "--sleep-on-idle")
    configs = {"radix": ("--max-total-tokens", str(pool), *common)}
    for chunk in chunk_sizes:
        configs[f"pcr-{chunk}"] = (
            "--max-total-tokens",
            str(pool),
            "--enable-pcr",
            "--pcr-chunk-size",
            str(chunk),
            "--pcr-dram-gb",
            str(args.dram_gb),
            "--pcr-layerwise",
            args.layerwise,
            *common,
        )
    configs["oracle"] = ("--max-total-tokens", str(2 * working_set + 4 * longest), *common)
    print(
        f"trace: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, working set "
        f"{working_set} tokens; device pool {pool} tokens ({pool / working_set:.0%} of it) for radix and pcr"
    )
    results, pcr_states = {}, {}
    for name, server_args in configs.items():
        with ServerProcess(model, server_args) as server:
            results[name] = [stream(server, ids, args.max_new_tokens) for ids in prompts]
            if name.startswith("pcr"):
                pcr_states[name] = server.pcr_state()
        print(f"  {name}: done", flush=True)

    oracle = results["oracle"]
    print(
        f"\n{'config':8} {'reused tokens':>14} {'vs oracle':>10} {'computed':>9} {'TTFT mean':>10} {'P50':>8} "
        f"{'P99':>8} {'mean vs oracle':>15} {'mean vs radix':>14}"
    )
    mean = {n: statistics.mean(r.ttft_s for r in rs) for n, rs in results.items()}
    for name, rs in results.items():
        reused = sum(r.cached for r in rs)
        ttfts = [r.ttft_s for r in rs]
        computed = sum(r.prompt - r.cached for r in rs)
        print(
            f"{name:8} {reused:>14} {reused / max(sum(r.cached for r in oracle), 1):>10.1%} {computed:>9} "
            f"{mean[name] * 1000:>8.0f}ms {statistics.median(ttfts) * 1000:>6.0f}ms "
            f"{percentile(ttfts, 0.99) * 1000:>6.0f}ms {mean[name] / mean['oracle']:>15.2f} "
            f"{mean[name] / mean['radix']:>14.2f}"
        )
    print()
    for name, state in pcr_states.items():
        counters = state["counters"]
        host = sum(r.host_cached for r in results[name])
        device = sum(r.cached for r in results[name]) - host
        print(
            f"{name} reused tokens by tier: device {device}, host {host} "
            f"({host / max(device + host, 1):.0%} from host memory); chunks offloaded during prefill "
            f"{counters['offloaded_chunks']}, demoted at eviction {counters['demoted_chunks']}, "
            f"host evictions {counters['host_evicted_chunks']}; layerwise={state['layerwise']}"
        )
    same = all([r.output_ids for r in rs] == [r.output_ids for r in oracle] for rs in results.values())
    print(f"greedy outputs identical across configurations: {same}")


if __name__ == "__main__":
    main()
