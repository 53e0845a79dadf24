"""TTFT of a long prompt cold and fully cached, torch_native extend padded vs extend rows only.

SGLang 0.5.23's torch_native backend (the CPU attention backend) computed attention for
every row of a request's sequence in an extend, cached or not; patch 03 computes only the
extend rows. This starts servers on SmolLM2-135M-Instruct (the bench model; ``--model-path``
for another) from the same install, with and without ``SGLANG_TORCH_NATIVE_PADDED_EXTEND=1``
(the original padded computation), for SGLang's radix cache and for ``--enable-pcr``, all
at once. For each repeat it sends, to each server in turn, a new prompt of
``--prompt-tokens`` tokens (cold: its own start, so nothing is cached) and then the same
prompt again (fully cached: radix reuses all but the last token, PCR the whole chunks), and
a short prompt (cold) as the floor of what one forward costs. It prints median TTFTs side by
side, the cached tokens, and whether both computations gave the same tokens.

Usage: python bench/cpu_extend_attention.py [--repeats 5] [--prompt-tokens 755] [--cache radix pcr]
       [--model-path DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field

from pcr_tools.launcher import ServerProcess

PADDED_ENV = "SGLANG_TORCH_NATIVE_PADDED_EXTEND"
SHORT_PROMPT_TOKENS = 29
MAX_NEW_TOKENS = 4


@dataclass
class Timings:
    cold_s: list[float] = field(default_factory=list)
    cached_s: list[float] = field(default_factory=list)
    short_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def corpus_token_ids(model_path: str, needed: int) -> list[int]:
    """Token ids of Wikipedia text (the workloads' corpus), at least ``needed`` of them."""
    from transformers import AutoTokenizer

    from pcr_tools.workload import RagWorkloadParams, make_rag_workload

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids: list[int] = []
    for request in make_rag_workload(RagWorkloadParams(num_requests=40, doc_pool_size=40, seed=3)):
        ids += tokenizer.encode(request.plain_prompt())
        if len(ids) >= needed:
            return ids
    raise RuntimeError(f"the corpus gave only {len(ids)} tokens, {needed} needed")


def ttft(server: ServerProcess, ids: list[int]) -> tuple[float, int, list[int]]:
    r = server.generate_stream({"input_ids": ids,
                                "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}})
    return r.ttft_s, int(r.final["meta_info"]["cached_tokens"]), list(r.final.get("output_ids", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="Prompts per server (default 5).")
    parser.add_argument("--prompt-tokens", type=int, default=755, help="Long prompt length (default 755).")
    parser.add_argument("--cache", nargs="+", choices=("radix", "pcr"), default=["radix", "pcr"])
    parser.add_argument("--model-path", default=None, help="Serve this model instead of SmolLM2-135M.")
    args = parser.parse_args(argv)

    from pcr_tools.models.smollm2 import build_smollm2

    model_path = args.model_path or str(build_smollm2())
    # Prompt k starts 37 tokens after prompt k-1: no two share a prefix, so each is cold once.
    stride = 37
    ids = corpus_token_ids(model_path, args.prompt_tokens + stride * (args.repeats + 1) + SHORT_PROMPT_TOKENS)
    long_prompts = [ids[stride * (k + 1): stride * (k + 1) + args.prompt_tokens] for k in range(args.repeats)]
    short_prompts = [ids[-SHORT_PROMPT_TOKENS - k:len(ids) - k] for k in range(args.repeats)]

    common = ("--max-total-tokens", "16384", "--context-length", "4096", "--log-level", "warning",
              "--attention-backend", "torch_native", "--sleep-on-idle")
    cache_args = {"radix": (), "pcr": ("--enable-pcr", "--pcr-chunk-size", "16")}
    servers: dict[tuple[str, str], ServerProcess] = {}
    for cache in args.cache:
        for extend in ("padded", "rows"):
            servers[(cache, extend)] = ServerProcess(
                model_path, (*common, *cache_args[cache]), env={PADDED_ENV: "1" if extend == "padded" else "0"})
    print(f"[bench] model {model_path}; {args.repeats} repeats of a {args.prompt_tokens}-token prompt "
          f"(cold, then replayed) and a {SHORT_PROMPT_TOKENS}-token prompt, per server")
    timings = {key: Timings() for key in servers}
    with ExitStack() as stack:
        for key, server in servers.items():  # one at a time: each start keeps the cores busy
            stack.enter_context(server)
            print(f"[bench] {key[0]}/{key[1]} ready in {server.startup_seconds:.0f} s", flush=True)
        for server in servers.values():  # the first forward of a server is slower
            ttft(server, ids[:64])
        # Servers take turns on each prompt, so drift in the machine's load hits all alike.
        for k in range(args.repeats):
            for key, server in servers.items():
                t = timings[key]
                cold, cold_cached, out = ttft(server, long_prompts[k])
                cached, cached_tokens, replay_out = ttft(server, long_prompts[k])
                short, _, _ = ttft(server, short_prompts[k])
                if cold_cached:
                    print(f"[bench] warning: {key} found {cold_cached} tokens cached on a cold prompt")
                t.cold_s.append(cold)
                t.cached_s.append(cached)
                t.short_s.append(short)
                t.cached_tokens.append(cached_tokens)
                t.outputs += [out, replay_out]

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:.0f}"

    print(f"\n| cache | extend attention | cold {args.prompt_tokens} tok (ms) | fully cached (ms) "
          f"| cached tokens | cold {SHORT_PROMPT_TOKENS} tok (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (cache, extend), t in timings.items():
        print(f"| {cache} | {extend} | {ms(t.cold_s)} | {ms(t.cached_s)} | {statistics.median(t.cached_tokens):.0f} "
              f"| {ms(t.short_s)} |")
    print("\nmedians of", args.repeats, "repeats")
    same = all(timings[(c, "padded")].outputs == timings[(c, "rows")].outputs for c in args.cache)
    print(f"same output tokens, padded vs rows: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
