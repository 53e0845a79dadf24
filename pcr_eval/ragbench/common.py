"""What the benchmark's commands share: workload flags, the served model's tokenizer, the
trace's shape and the budgets every configuration gets."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pcr_eval.ragbench.runner import CONFIG_NAMES, Budgets
from pcr_eval.ragbench.workload import Trace, TraceRequest, WorkloadParams
from pcr_tools.launcher import cpu_only

SLACK_TOKENS = 256  # room above the longest prompt in every device pool


def float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def config_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown configurations {unknown}; known: {', '.join(CONFIG_NAMES)}")
    return names


def workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--source",
        choices=["retrieval", "synthetic"],
        default="retrieval",
        help="retrieval: Wikipedia extracts chosen by the embedder; synthetic: lognormal-length documents",
    )
    g.add_argument("--requests", type=int, default=20, help="first turns in the headline trace")
    g.add_argument(
        "--corpus-docs", type=int, default=1000, help="articles retrieval searches (or synthetic documents made)"
    )
    g.add_argument("--min-docs", type=int, default=3, help="documents per request, at least")
    g.add_argument("--max-docs", type=int, default=5, help="documents per request, at most")
    g.add_argument(
        "--zipf",
        type=float,
        default=None,
        help="topic popularity exponent (default: calibrated so 3%% of topics draw 60%%)",
    )
    g.add_argument(
        "--max-doc-chars",
        type=int,
        default=600,
        help="cut Wikipedia extracts to this many characters (whole sentences); 0: no cut",
    )
    g.add_argument("--followups", type=int, default=0, help="follow-up turns per session")
    g.add_argument("--max-new-tokens", type=int, default=8, help="output tokens per request (greedy)")
    g.add_argument("--seed", type=int, default=0, help="seeds documents, questions and arrivals")
    g.add_argument(
        "--doc-order",
        choices=["retrieval", "shuffled"],
        default="retrieval",
        help="retrieval: each request lists its documents as retrieved (a topic's neighbours in "
        "the same order); shuffled: each request in its own order (documents recur in random order)",
    )
    g.add_argument(
        "--unique-docs",
        action="store_true",
        help="no document in two first turns (retrieval source): only the system prompt recurs "
        "(follow-ups keep their session's documents)",
    )


def workload_params(args: argparse.Namespace, **overrides) -> WorkloadParams:
    params = WorkloadParams(
        source=args.source,
        num_requests=args.requests,
        corpus_docs=args.corpus_docs,
        min_docs=args.min_docs,
        max_docs=args.max_docs,
        zipf_exponent=args.zipf,
        max_doc_chars=args.max_doc_chars or None,
        followups=args.followups,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        doc_order=args.doc_order,
        unique_docs=args.unique_docs,
    )
    return replace(params, **overrides)


class Model:
    """The served model's tokenizer: chat template in, token ids out."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._first_turns: dict[tuple[int, str], Any] = {}

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self._render(messages), add_special_tokens=False)

    def _render(self, messages: list[dict[str, str]]) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # A model without a chat template (the tests' tiny Llama): plain turns.
        return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"

    def prompt(self, trace: Trace, request: TraceRequest, answers: dict[str, str]) -> tuple[list[int], list[int]]:
        """Token ids and document bounds. A first turn is its documents tokenized one by one
        (:meth:`Trace.doc_prompt`: what document reuse needs, and what every configuration is
        sent); a follow-up is its first turn's ids followed by the rest of the conversation
        as the chat template renders it (the same bounds)."""
        root = request
        while root.parent is not None:
            root = trace._by_rid()[root.parent]
        key = (id(trace), root.rid)
        first = self._first_turns.get(key)
        if first is None:
            first = self._first_turns[key] = trace.doc_prompt(root, self.tokenizer)
        if request is root:
            return list(first.input_ids), list(first.doc_bounds)
        head = self._render(trace.messages(root, {}))
        whole = self._render(trace.messages(request, answers))
        if not whole.startswith(head):  # a template that re-renders earlier turns: no shared prefix
            return self.encode(trace.messages(request, answers)), []
        return list(first.input_ids) + self.tokenizer.encode(whole[len(head) :], add_special_tokens=False), list(
            first.doc_bounds
        )

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token as served: layers x (K, V) x KV heads x head dim x the
        element size (float32 on CPU, the model's 16-bit dtype on GPU)."""
        config = json.loads((Path(self.path) / "config.json").read_text())
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return config["num_hidden_layers"] * 2 * heads * head_dim * (4 if cpu_only() else 2)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def trace_shape(trace: Trace, model: Model, chunk_size: int) -> dict[str, int]:
    """Token counts of the trace's first turns: the longest prompt, the total, and the
    working set (distinct chunk-aligned prefixes; follow-ups add to it at run time)."""
    from pcr_tools.workload import working_set_tokens

    prompts = [model.prompt(trace, r, {})[0] for r in trace.first_turns()]
    turns = 1 + trace.params.followups
    # A follow-up's prompt: its first turn's, plus each earlier answer and question.
    per_turn = trace.params.max_new_tokens + 64
    return {
        "longest": max(map(len, prompts)) + (turns - 1) * per_turn,
        "total": sum(map(len, prompts)) * turns + sum(range(turns)) * per_turn * len(prompts),
        "working_set": working_set_tokens(prompts, chunk_size),
    }


def budgets_for(
    shape: dict[str, int], pool_fraction: float, host_fraction: float, chunk_size: int, bytes_per_token: int
) -> Budgets:
    """Device pool at ``pool_fraction`` of the working set (never below one longest prompt
    plus slack), host memory at ``host_fraction`` of it, disk enough for all of it."""
    pool = max(int(shape["working_set"] * pool_fraction), shape["longest"] + SLACK_TOKENS)
    host_gb = max(shape["working_set"] * host_fraction * bytes_per_token / 2**30, 0.05)
    ssd_gb = max(4 * shape["working_set"] * bytes_per_token / 2**30, 1.0)
    return Budgets(
        device_pool_tokens=pool,
        oracle_pool_tokens=2 * shape["total"] + 4 * shape["longest"],
        host_gb=round(host_gb, 3),
        ssd_gb=round(ssd_gb, 2),
        context_length=shape["longest"] + SLACK_TOKENS,
        kv_bytes_per_token=bytes_per_token,
        chunk_size=chunk_size,
        page_size=chunk_size,
    )


def batch_pool_budgets(
    shape: dict[str, int], batch_prompts: int, host_fraction: float, chunk_size: int, bytes_per_token: int
) -> tuple[Budgets, float]:
    """Budgets whose device pool holds ``batch_prompts`` of the trace's longest prompts (plus
    slack), so several requests batch while the working set stays larger; and that pool as
    a fraction of the working set."""
    pool_tokens = batch_prompts * shape["longest"] + SLACK_TOKENS
    fraction = pool_tokens / shape["working_set"]
    budgets = budgets_for(shape, fraction, host_fraction, chunk_size, bytes_per_token)
    return replace(budgets, device_pool_tokens=pool_tokens), fraction


def machine() -> str:
    """The machine a run's figures come from, as the reports print it."""
    import os
    import platform

    cores = len(os.sched_getaffinity(0))
    return f"{platform.machine()}, {cores} CPU cores, no GPU" if cpu_only() else platform.machine()
