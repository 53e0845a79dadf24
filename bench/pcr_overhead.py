"""What PCR costs a request that reuses nothing: TTFT beside SGLang's radix cache.

Prompts share only their system prompt (every document appears once), so no
configuration can reuse more than that; a device pool of two prompts makes every
prefill evict. Requests go one at a time (no queueing), so the TTFT difference is PCR's
per-request work: matching, offloading the new chunks to host memory layer by layer,
writing them to SSD (the I/O process, on the same cores), the scheduler hooks.

* ``radix``          SGLang's radix cache;
* ``pcr``            PCR as the demo runs it: host tier, SSD tier, ``--pcr-layerwise both``;
* ``pcr-no-ssd``     PCR with the host tier only (no I/O process writes);
* ``pcr-layerwise-off``: host and SSD tiers, chunks copied to host memory at eviction only.

Rounds interleave the configurations (one server at a time); each round's median TTFT
is divided by radix's of the same round, and the report gives the median over rounds.
The CPU seconds each server's processes used while the requests ran show where a
two-core machine's time goes.

Usage: python -m bench.pcr_overhead [--requests 12] [--rounds 2] [--configs ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pcr_tools.launcher import ServerProcess

CONFIGS = ("radix", "pcr", "pcr-no-ssd", "pcr-layerwise-off")
SYSTEM = "You are a helpful assistant. Answer the question from the documents."


@dataclass
class RunResult:
    config: str
    ttfts_s: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process role

    @property
    def median_s(self) -> float:
        return statistics.median(self.ttfts_s)


def unique_prompts(tokenizer, count: int, docs_per_prompt: int = 3, max_chars: int = 600) -> list[list[int]]:
    """``count`` chat prompts over disjoint Wikipedia articles (plus one warm-up prompt)."""
    from pcr_tools.data import load_wiki_articles

    articles = load_wiki_articles()
    needed = (count + 1) * docs_per_prompt
    if len(articles) < needed:
        raise SystemExit(f"the corpus has {len(articles)} articles; {needed} are needed")
    prompts = []
    for i in range(count + 1):
        group = articles[i * docs_per_prompt : (i + 1) * docs_per_prompt]
        documents = "\n\n".join(f"Document: {a.title}\n{a.text[:max_chars]}" for a in group)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{documents}\n\nQuestion: What is {group[0].title} known for?"},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def server_args(config: str, pool_tokens: int, context: int, store: Path) -> tuple[str, ...]:
    common = (
        "--max-total-tokens",
        str(pool_tokens),
        "--context-length",
        str(context),
        "--log-level",
        "warning",
        "--sleep-on-idle",
    )
    if config == "radix":
        return common
    pcr = (*common, "--enable-pcr", "--pcr-chunk-size", "16", "--pcr-dram-gb", "0.5")
    ssd = ("--pcr-ssd-path", str(store), "--pcr-ssd-gb", "1", "--pcr-ssd-reserve-gb", "0")
    if config == "pcr":
        return (*pcr, *ssd)
    if config == "pcr-no-ssd":
        return pcr
    if config == "pcr-layerwise-off":
        return (*pcr, *ssd, "--pcr-layerwise", "off")
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def _role(process: psutil.Process) -> str:
    try:
        line = " ".join(process.cmdline())
    except psutil.Error:
        return "other"
    if "pcr_sglang.io" in line or "pcr-io" in line:
        return "pcr I/O process"
    if "scheduler" in line or "scheduler" in process.name():
        return "scheduler"
    return "tokenizer/http/other"


def cpu_seconds(server: ServerProcess) -> dict[str, float]:
    """CPU seconds (user + system) of the server's process tree, by role."""
    assert server._proc is not None
    root = psutil.Process(server._proc.pid)
    totals: dict[str, float] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        role = _role(process)
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def run_config(
    model: str, config: str, prompts: list[list[int]], pool: int, context: int, max_new_tokens: int
) -> RunResult:
    result = RunResult(config)
    with tempfile.TemporaryDirectory(prefix="pcr-overhead-") as store:
        with ServerProcess(model, server_args(config, pool, context, Path(store))) as server:
            sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
            server.generate_stream({"input_ids": prompts[0], "sampling_params": sampling})  # warm-up
            before = cpu_seconds(server)
            for ids in prompts[1:]:
                result.ttfts_s.append(server.generate_stream({"input_ids": ids, "sampling_params": sampling}).ttft_s)
            after = cpu_seconds(server)
            result.cpu_s = {role: after[role] - before.get(role, 0.0) for role in after}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pcr_overhead",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--requests", type=int, default=12, help="measured requests per configuration and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the configurations (medians over them)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct (built offline)")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "radix" not in configs:
        parser.error(f"--configs must include radix and name only {', '.join(CONFIGS)} (got {args.configs!r})")
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be >= 1")

    from transformers import AutoTokenizer

    from pcr_tools.models.smollm2 import build_smollm2

    model = args.model_path or str(build_smollm2())
    prompts = unique_prompts(AutoTokenizer.from_pretrained(model), args.requests)
    longest = max(len(p) for p in prompts)
    pool, context = 2 * longest + 256, longest + 64
    print(
        f"{args.requests} prompts of {min(map(len, prompts[1:]))}-{longest} tokens sharing only the system "
        f"prompt; device pool {pool} tokens; {args.rounds} round(s) of {', '.join(configs)}",
        flush=True,
    )
    rounds: list[dict[str, RunResult]] = []
    for index in range(args.rounds):
        results = {}
        for config in configs:
            results[config] = run_config(model, config, prompts, pool, context, args.max_new_tokens)
            print(f"  round {index + 1} {config}: median TTFT {results[config].median_s * 1000:.0f} ms", flush=True)
        rounds.append(results)

    print(
        "\n| config | TTFT median (median of rounds) | vs radix (median of rounds' ratios) | per-round ratios "
        "| CPU s per request: scheduler / I/O process / other |"
    )
    print("| --- | --- | --- | --- | --- |")
    for config in configs:
        medians = [r[config].median_s for r in rounds]
        ratios = [r[config].median_s / r["radix"].median_s for r in rounds]
        cpu = {
            role: statistics.median(r[config].cpu_s.get(role, 0.0) for r in rounds) / args.requests
            for role in ("scheduler", "pcr I/O process", "tokenizer/http/other")
        }
        print(
            f"| {config} | {statistics.median(medians) * 1000:.0f} ms | {statistics.median(ratios):.2f}x | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | {cpu['scheduler']:.2f} / {cpu['pcr I/O process']:.2f} / "
            f"{cpu['tokenizer/http/other']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
