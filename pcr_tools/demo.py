"""Demo: serve a RAG workload over real Wikipedia documents with PCR on SmolLM2-135M.

Prepares the model (once), launches ``python -m sglang.launch_server --enable-pcr``
(on the CPU when there is no GPU), sends a seeded stream of RAG requests one after
another, and prints each request's time to first token, its cached (reused) tokens and
the model's answer, then the hit ratio and cold-vs-cached TTFT. Prefix caching is exact:
these answers are full prefill's.

Then a second pass, on a server with ``--pcr-doc-reuse`` (default ``blend``) and the
document-reuse tuned SmolLM2 (``pcr_tools.tune``), asks questions about documents that
are never first in their prompt, as an application would: through ``/v1/chat/completions``
with the OpenAI client, the retrieved documents in the request's ``documents`` field (no
tokenizer on the client; the server marks them). A prefix cache reuses only up to the
first document, document reuse reuses them all.
**Document reuse changes answers**: the pass prints, per question, the gold answer, the
answer with reuse and the full-prefill answer, each gold score, and whether they are
equal. ``--no-doc-reuse`` skips that pass.

Usage: ``python -m pcr_tools.demo [--requests N] [--chunk-size N] [--seed N]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pcr_client.prompt import DEFAULT_QUESTION_FORMAT, DocPrompt
from pcr_tools.launcher import ServerProcess
from pcr_tools.workload import SYSTEM_PROMPT, RagWorkloadParams, chat_prompt, make_rag_workload


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
        {"input_ids": prompt.input_ids, "sampling_params": prompt.sampling_params(**sampling) if marked else sampling}
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


def chat_with_documents(
    server: ServerProcess, system: str, user: str, documents: list[str], max_new_tokens: int
) -> DemoResult:
    """A chat request as a RAG application sends it (the OpenAI client, streaming, the
    documents in ``extra_body``); TTFT to the first content token, the usage from the
    last chunk (the server runs ``--enable-cache-report``)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    start = time.perf_counter()
    ttft, text, usage, rid = None, [], None, ""
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=max_new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"documents": documents},
    )
    for chunk in stream:
        rid = rid or chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - start
    details = getattr(usage, "prompt_tokens_details", None)
    return DemoResult(
        rid=rid,
        prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
        cached_tokens=int(getattr(details, "cached_tokens", 0) or 0),
        ttft_s=ttft if ttft is not None else latency,
        latency_s=latency,
        answer="".join(text).strip(),
    )


@dataclass
class ReuseAnswer:
    """One question of the document-reuse pass: the answer with the documents reused and
    the same model's full-prefill answer, each with its gold score."""

    kind: str
    question: str
    gold: str
    reused: DemoResult
    full: DemoResult

    def score(self, answer: str) -> float:
        from pcr_eval.scores import gold_score, gold_scores

        return gold_score(gold_scores(self.kind, answer, self.gold))


def doc_reuse_pass(
    model_path: str,
    tokenizer: Any,
    questions: int,
    mode: str,
    max_new_tokens: int,
    chunk_size: int,
    seed: int,
    calibration: Optional[Path] = None,
) -> list[ReuseAnswer]:
    """Questions about documents that are never first in their prompt (test-split articles,
    ``pcr_tools.tune.questions``), on ``model_path`` with ``--pcr-doc-reuse``: each prompt's
    documents are warmed (their canonical KV computed, as a precomputed corpus would have
    it), then the question is answered with them reused, as a chat request with the
    documents in its ``documents`` field, then as the same prompt's token ids without marks
    (full prefill and exact prefix caching: the answer to compare with). With ``calibration`` (the tuned
    model's committed file) the server takes the K or R it found and says whether the mode
    met its accuracy target; a mode that missed it is served with a warning."""
    from pcr_tools.launcher import cpu_only
    from pcr_tools.tune.questions import question_set

    flags = (
        "--enable-pcr",
        "--pcr-chunk-size",
        str(chunk_size),
        "--pcr-doc-reuse",
        mode,
        "--pcr-doc-warmup-after",
        "1",
        "--max-total-tokens",
        "16384",
        "--context-length",
        "4096",
        "--enable-cache-report",
        "--log-level",
        "warning",
    )
    if calibration is not None and not cpu_only():
        # Measured with float32 KV on the CPU; a GPU server's KV dtype may differ, and the
        # server refuses a calibration measured under other conditions.
        print("[demo] the committed calibration was measured on the CPU (float32 KV): not used on the GPU")
        calibration = None
    if calibration is not None:
        flags += ("--pcr-doc-reuse-calibration", str(calibration), "--pcr-doc-reuse-calibration-warn")
    if mode != "concat" and not cpu_only():
        # Recompute modes need an attention backend that takes permuted rows, and no
        # prefill CUDA graph (docs/flags.md: --pcr-doc-reuse).
        flags += ("--attention-backend", "triton", "--disable-prefill-cuda-graph")
    print(f"\n[demo] document reuse: {questions} questions about re-placed documents, on {model_path}")
    print(f"[demo] starting SGLang with: {' '.join(flags)}")
    answers = []
    with ServerProcess(model_path, flags) as server:
        verdict = server.pcr_state()["doc_reuse"]["calibration"]
        if verdict.get("measured"):
            setting = "" if verdict["value"] is None else f" at {'K' if mode == 'lego' else 'R'}={verdict['value']:g}"
            target = verdict["target"]
            print(
                f"[demo] calibrated on this model ({verdict['questions']} questions): {mode}{setting} "
                f"{'meets' if verdict['meets_target'] else 'MISSES'} the target (top-1 agreement >= "
                f"{target['top1_min']:.0%}, gold answers >= {target['gold_ratio_min']:.0%} of full prefill's)"
            )
        else:
            print(f"[demo] {mode}'s accuracy on this model is unmeasured (no calibration)")
        for i, q in enumerate(question_set("test", questions, seed)):
            prompt = q.prompt(tokenizer)  # the same tokens the server renders for the chat request
            user = DEFAULT_QUESTION_FORMAT.format(question=q.question)
            documents = list(q.documents)
            chat_with_documents(server, SYSTEM_PROMPT, user, documents, 1)  # warm: the documents' canonical KV
            reused = chat_with_documents(server, SYSTEM_PROMPT, user, documents, max_new_tokens)
            full = generate_ids(server, prompt, max_new_tokens, marked=False)
            if reused.prompt_tokens != len(prompt.input_ids):
                print(
                    f"[demo] note: the chat request's prompt is {reused.prompt_tokens} tokens, the token-id "
                    f"prompt {len(prompt.input_ids)}: the answers below are not of the same prompt"
                )
            answer = ReuseAnswer(q.kind, q.question, q.gold, reused, full)
            answers.append(answer)
            print(
                f"\n[{i + 1:2d}] {q.kind}: {q.question}  (asked-about document at position "
                f"{', '.join(str(t + 1) for t in q.targets)} of {len(q.documents)})"
            )
            print(f"     gold: {q.gold}")
            print(
                f"     reused       ({reused.cached_tokens} of {reused.prompt_tokens} tokens cached, TTFT "
                f"{reused.ttft_s * 1000:.0f} ms, gold score {answer.score(reused.answer):.2f}): "
                f"{_first_line(reused.answer)}"
            )
            print(
                f"     full prefill ({full.cached_tokens} cached by the exact prefix cache, "
                f"TTFT {full.ttft_s * 1000:.0f} ms, gold score "
                f"{answer.score(full.answer):.2f}): {_first_line(full.answer)}"
            )
            print(f"     same answer as full prefill: {reused.answer == full.answer}")
    return answers


def _first_line(answer: str) -> str:
    return answer.splitlines()[0] if answer else "(empty)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="Number of RAG requests (default 16).")
    parser.add_argument("--chunk-size", type=int, default=32, help="--pcr-chunk-size (default 32).")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Answer length (default 32).")
    parser.add_argument("--seed", type=int, default=0, help="Workload seed (default 0).")
    parser.add_argument("--model-path", default=None, help="Serve this model instead of SmolLM2-135M.")
    parser.add_argument(
        "--no-doc-reuse",
        action="store_true",
        help="Skip the second pass (questions about re-placed documents with --pcr-doc-reuse).",
    )
    parser.add_argument(
        "--doc-reuse-mode",
        default="blend",
        choices=("concat", "lego", "blend"),
        help="--pcr-doc-reuse of the second pass (default blend: CacheBlend; on the tuned model "
        "at the committed calibration's R, else 15%% of moved tokens recomputed). Document "
        "reuse changes answers: the pass prints how much.",
    )
    parser.add_argument(
        "--no-doc-reuse-calibration",
        action="store_true",
        help="Serve the tuned model without its committed calibration (blend at R=15%%).",
    )
    parser.add_argument("--doc-reuse-questions", type=int, default=6, help="Questions of the second pass (default 6).")
    parser.add_argument(
        "--base-model-for-reuse",
        action="store_true",
        help="Run the second pass on the base SmolLM2 instead of the document-reuse tuned one.",
    )
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from pcr_tools.models.smollm2 import TUNED_CALIBRATION, build_smollm2

    model_path = args.model_path or str(build_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # A handful of popular documents, trimmed to a paragraph each, so that the CPU run
    # stays short while prompts still share documents the way RAG traffic does.
    workload = make_rag_workload(
        RagWorkloadParams(
            num_requests=args.requests,
            doc_pool_size=12,
            min_docs=3,
            max_docs=5,
            zipf_exponent=1.1,
            max_doc_chars=600,
            seed=args.seed,
        )
    )
    server_args = (
        "--enable-pcr",
        "--pcr-debug-checks",
        "--pcr-chunk-size",
        str(args.chunk_size),
        "--max-total-tokens",
        "16384",
        "--context-length",
        "4096",
        "--log-level",
        "warning",
    )
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
            print(
                f"     prompt {result.prompt_tokens} tokens, cached {result.cached_tokens}, "
                f"TTFT {result.ttft_s * 1000:.0f} ms"
            )
        # The cleanest cold-vs-cached comparison: the first prompt again, now cached.
        replay = stream_generate(server, chat_prompt(tokenizer, workload[0]), args.max_new_tokens)
        state = server.pcr_state(check_invariants=True)
    second = None
    if not args.no_doc_reuse:
        # The tuned model (pcr_tools.tune: trained on the pattern document reuse serves) unless
        # another model was asked for.
        reuse_model = (
            model_path if (args.model_path or args.base_model_for_reuse) else str(build_smollm2(doc_reuse_tuned=True))
        )
        tuned = not (args.model_path or args.base_model_for_reuse)
        calibration = TUNED_CALIBRATION if tuned and not args.no_doc_reuse_calibration else None
        second = doc_reuse_pass(
            reuse_model,
            tokenizer,
            args.doc_reuse_questions,
            args.doc_reuse_mode,
            args.max_new_tokens,
            args.chunk_size,
            args.seed,
            calibration,
        )
    prompt_total = sum(r.prompt_tokens for r in results)
    cached_total = sum(r.cached_tokens for r in results)
    cold = [r.ttft_s for r in results if r.cached_tokens == 0]
    warm = [r.ttft_s for r in results if r.cached_tokens > 0]
    print("\n[demo] summary")
    print(f"  requests: {len(results)}, with a cache hit: {len(warm)}")
    print(
        f"  hit ratio: {cached_total}/{prompt_total} prompt tokens reused "
        f"({100 * cached_total / max(prompt_total, 1):.1f}%)"
    )
    if cold:
        print(f"  TTFT, no reuse:   median {statistics.median(cold) * 1000:.0f} ms over {len(cold)} requests")
    if warm:
        print(f"  TTFT, with reuse: median {statistics.median(warm) * 1000:.0f} ms over {len(warm)} requests")
    print(
        f"  request 1 replayed: TTFT {replay.ttft_s * 1000:.0f} ms with {replay.cached_tokens} of "
        f"{replay.prompt_tokens} tokens cached, vs {results[0].ttft_s * 1000:.0f} ms cold; "
        f"same answer: {replay.answer == results[0].answer}"
    )
    print(
        f"  PCR tree: {state['tree']['num_chunks']} chunks of {state['chunk_size']} tokens cached, "
        f"{state['tree']['locked_chunks']} locked, invariants ok: {state['invariants']['ok']}"
    )
    if second:
        same = sum(a.reused.answer == a.full.answer for a in second)
        gold_reused = statistics.fmean(a.score(a.reused.answer) for a in second)
        gold_full = statistics.fmean(a.score(a.full.answer) for a in second)
        print(
            f"  document reuse ({args.doc_reuse_mode}, questions about re-placed documents): "
            f"{sum(a.reused.cached_tokens for a in second)}/{sum(a.reused.prompt_tokens for a in second)} prompt "
            f"tokens reused vs {sum(a.full.cached_tokens for a in second)} by the prefix cache; TTFT median "
            f"{statistics.median(a.reused.ttft_s for a in second) * 1000:.0f} ms reused vs "
            f"{statistics.median(a.full.ttft_s for a in second) * 1000:.0f} ms with the prefix cache alone"
        )
        print(
            f"  accuracy: mean gold score {gold_reused:.2f} reused vs {gold_full:.2f} full prefill (F1 against "
            f"the lead sentence, exact match for planted facts); answers equal to full prefill's: "
            f"{same}/{len(second)}. Document reuse changes answers: bench/doc_reuse_accuracy.py measures how much."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
