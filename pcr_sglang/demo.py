"""Demo: serve a RAG workload over real Wikipedia documents with PCR on SmolLM2-135M.

Prepares the model (once), launches ``python -m sglang.launch_server --enable-pcr
--pcr-doc-reuse concat --pcr-doc-warmup-after 1`` (on the CPU when there is no GPU), sends a seeded stream of RAG
requests one after another, and prints each request's time to first token, its cached
(reused) tokens and the model's answer, then the hit ratio and cold-vs-cached TTFT.

Then a second pass asks the same questions with each request's documents in another
order, marking the documents (``custom_params["pcr_doc_bounds"]``): a prefix cache can
reuse little of a reordered prompt, document reuse reuses every document already seen.
Each answer is compared with full prefill's (concat mode recomputes nothing, so some
differ: see the README's accuracy table). ``--no-doc-reuse`` skips that pass.

Usage: ``python -m pcr_sglang.demo [--requests N] [--chunk-size N] [--seed N]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Optional

from pcr_sglang.doc_prompt import DocPrompt, build_doc_prompt
from pcr_sglang.launcher import ServerProcess
from pcr_sglang.workload import RagRequest, RagWorkloadParams, chat_prompt, make_rag_workload


@dataclass
class DemoResult:
    rid: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    answer: str


def stream_generate(server: ServerProcess, text: str, max_new_tokens: int) -> DemoResult:
    response = server.generate_stream(
        {"text": text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    )
    meta = response.final.get("meta_info", {})
    return DemoResult(
        rid=meta.get("id", ""),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        ttft_s=response.ttft_s,
        latency_s=response.latency_s,
        answer=response.final.get("text", "").strip(),
    )


def generate_ids(server: ServerProcess, prompt: DocPrompt, max_new_tokens: int, marked: bool) -> DemoResult:
    sampling: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    response = server.generate_stream(
        {"input_ids": prompt.input_ids, "sampling_params": prompt.sampling_params(**sampling) if marked else sampling})
    meta = response.final.get("meta_info", {})
    return DemoResult(rid=meta.get("id", ""), prompt_tokens=int(meta.get("prompt_tokens", 0)),
                      cached_tokens=int(meta.get("cached_tokens", 0)), ttft_s=response.ttft_s,
                      latency_s=response.latency_s, answer=response.final.get("text", "").strip())


def reordered_prompt(tokenizer: Any, request: RagRequest, rng: random.Random) -> DocPrompt:
    documents = list(request.documents)
    while len(documents) > 1 and tuple(documents) == request.documents:
        rng.shuffle(documents)
    return build_doc_prompt(tokenizer, request.system, [f"{d.title}:\n{d.text}" for d in documents],
                            request.question)


def doc_reuse_pass(server: ServerProcess, tokenizer: Any, workload: list[RagRequest], max_new_tokens: int,
                   seed: int) -> Optional[dict[str, Any]]:
    """The same questions, documents reordered and marked; then each prompt without marks
    (full prefill's answer, from the exact prefix cache) to compare the answers."""
    rng = random.Random(seed)
    prompts = [reordered_prompt(tokenizer, request, rng) for request in workload]
    print("\n[demo] second pass: the same questions, documents reordered and marked for document reuse")
    reused = []
    for i, (request, prompt) in enumerate(zip(workload, prompts)):
        result = generate_ids(server, prompt, max_new_tokens, marked=True)
        reused.append(result)
        print(f"[{i + 1:2d}] prompt {result.prompt_tokens} tokens, documents end at {prompt.doc_bounds[-1]}, "
              f"cached {result.cached_tokens}, TTFT {result.ttft_s * 1000:.0f} ms")
        print(f"     A: {result.answer.splitlines()[0] if result.answer else '(empty)'}")
    exact = [generate_ids(server, prompt, max_new_tokens, marked=False) for prompt in prompts]
    return {"reused": reused, "exact": exact, "prompts": prompts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="Number of RAG requests (default 16).")
    parser.add_argument("--chunk-size", type=int, default=32, help="--pcr-chunk-size (default 32).")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Answer length (default 32).")
    parser.add_argument("--seed", type=int, default=0, help="Workload seed (default 0).")
    parser.add_argument("--model-path", default=None, help="Serve this model instead of SmolLM2-135M.")
    parser.add_argument("--no-doc-reuse", action="store_true",
                        help="Skip the second pass (documents reordered, reused with --pcr-doc-reuse concat).")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from pcr_sglang.models.smollm2 import build_smollm2

    model_path = args.model_path or str(build_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # A handful of popular documents, trimmed to a paragraph each, so that the CPU run
    # stays short while prompts still share documents the way RAG traffic does.
    workload = make_rag_workload(
        RagWorkloadParams(num_requests=args.requests, doc_pool_size=12, min_docs=3, max_docs=5,
                          zipf_exponent=1.1, max_doc_chars=600, seed=args.seed)
    )
    server_args = ("--enable-pcr", "--pcr-debug-checks", "--pcr-chunk-size", str(args.chunk_size),
                   "--max-total-tokens", "16384", "--context-length", "4096", "--log-level", "warning",
                   # Every document of the second pass was seen in the first (unmarked, so not
                   # counted): warm each at its first marked sighting.
                   *(() if args.no_doc_reuse else ("--pcr-doc-reuse", "concat", "--pcr-doc-warmup-after", "1")))
    print(f"[demo] model: {model_path}")
    print(f"[demo] starting SGLang with: {' '.join(server_args)}")
    results: list[DemoResult] = []
    with ServerProcess(model_path, server_args) as server:
        print(f"[demo] server ready in {server.startup_seconds:.1f} s; sending {len(workload)} requests")
        for i, request in enumerate(workload):
            result = stream_generate(server, chat_prompt(tokenizer, request), args.max_new_tokens)
            results.append(result)
            docs = ", ".join(d.title for d in request.documents)
            print(f"\n[{i + 1:2d}] docs: {docs}")
            print(f"     Q: {request.question}")
            print(f"     A: {result.answer.splitlines()[0] if result.answer else '(empty)'}")
            print(f"     prompt {result.prompt_tokens} tokens, cached {result.cached_tokens}, "
                  f"TTFT {result.ttft_s * 1000:.0f} ms")
        # The cleanest cold-vs-cached comparison: the first prompt again, now cached.
        replay = stream_generate(server, chat_prompt(tokenizer, workload[0]), args.max_new_tokens)
        second = None if args.no_doc_reuse else doc_reuse_pass(server, tokenizer, workload, args.max_new_tokens,
                                                                args.seed)
        state = server.pcr_state(check_invariants=True)
    prompt_total = sum(r.prompt_tokens for r in results)
    cached_total = sum(r.cached_tokens for r in results)
    cold = [r.ttft_s for r in results if r.cached_tokens == 0]
    warm = [r.ttft_s for r in results if r.cached_tokens > 0]
    print("\n[demo] summary")
    print(f"  requests: {len(results)}, with a cache hit: {len(warm)}")
    print(f"  hit ratio: {cached_total}/{prompt_total} prompt tokens reused "
          f"({100 * cached_total / max(prompt_total, 1):.1f}%)")
    if cold:
        print(f"  TTFT, no reuse:   median {statistics.median(cold) * 1000:.0f} ms over {len(cold)} requests")
    if warm:
        print(f"  TTFT, with reuse: median {statistics.median(warm) * 1000:.0f} ms over {len(warm)} requests")
    print(f"  request 1 replayed: TTFT {replay.ttft_s * 1000:.0f} ms with {replay.cached_tokens} of "
          f"{replay.prompt_tokens} tokens cached, vs {results[0].ttft_s * 1000:.0f} ms cold; "
          f"same answer: {replay.answer == results[0].answer}")
    if second is not None:
        reused, exact = second["reused"], second["exact"]
        doc_tokens = sum(p.doc_bounds[-1] for p in second["prompts"])
        same = sum(r.answer == e.answer for r, e in zip(reused, exact))
        print("  second pass (documents reordered): "
              f"document reuse {sum(r.cached_tokens for r in reused)}/{sum(r.prompt_tokens for r in reused)} "
              f"prompt tokens reused ({doc_tokens} tokens before the questions), "
              f"TTFT median {statistics.median(r.ttft_s for r in reused) * 1000:.0f} ms; "
              f"answers equal to full prefill's: {same}/{len(reused)}")
        counters = state["doc_reuse"]["counters"]
        print(f"  document reuse: {counters['docs_reused']} documents reused, {counters['tokens_rotated']} tokens "
              f"moved to another position, {counters['canonical_requests']} documents computed on first sight")
    print(f"  PCR tree: {state['tree']['num_chunks']} chunks of {state['chunk_size']} tokens cached, "
          f"{state['tree']['locked_chunks']} locked, invariants ok: {state['invariants']['ok']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
