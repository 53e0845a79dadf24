"""What marking documents by structure adds to a request in the tokenizer process.

A chat request with ``documents`` (``pcr_sglang.reuse.documents.render_chat``) is rendered
around a sentinel and tokenized in pieces, each document alone, instead of SGLang's one
render and one encode of the whole prompt. This times both on the same conversation and
documents, with the model's real tokenizer and chat template, no server:

* ``plain``: what SGLang does for the same prompt without marking (the documents written
  into the user message by the client): ``apply_chat_template``, then SGLang's own
  ``parallel_prompt_encode`` of the rendered text;
* ``marked``: the server's path for ``documents``: parse them, render around the sentinel,
  encode the leading part, each document alone (one batched call) and the rest, assemble
  the bounds and check the limits.

The figure is the median over repeats of ``marked - plain`` (and each alone), for 16
documents of about 300 tokens (target: at most 5 ms added). Run:
``python -m bench.doc_marking_time [--model PATH] [--documents 16] [--tokens 300]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pcr_sglang.flags import DEFAULT_DOC_MAX_DOCUMENTS, DEFAULT_DOC_MIN_TOKENS
from pcr_sglang.reuse.bounds import DocLimits
from pcr_sglang.reuse.documents import DEFAULT_DOC_FORMAT, MarkingRules, parse_documents, render_chat

TARGET_MS = 5.0


@dataclass(frozen=True)
class Timing:
    plain_ms: float
    marked_ms: float
    added_ms: float
    prompt_tokens: int


def default_model() -> str:
    """SmolLM2 (a real chat template) where it was fetched, else the tiny test model."""
    from pcr_client.paths import cache_root

    smol = cache_root() / "models" / "SmolLM2-135M-Instruct"
    if smol.exists():
        return str(smol)
    from pcr_tools.models.tiny_llama import build_tiny_llama

    return str(build_tiny_llama())


def documents_of(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """``count`` distinct Wikipedia passages cut to about ``tokens`` tokens each."""
    from pcr_tools.data import load_wiki_articles

    out = []
    for article in load_wiki_articles():
        ids = tokenizer.encode(article.text, add_special_tokens=False)
        if len(ids) >= tokens:
            out.append(tokenizer.decode(ids[:tokens]))
        if len(out) == count:
            return out
    raise RuntimeError(f"fewer than {count} articles of {tokens} tokens")


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def measure(tokenizer: Any, documents: list[str], repeats: int = 50) -> Timing:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = (Path(__file__).parents[1] / "tests" / "e2e" / "data" / "chatml.jinja").read_text()
    system, question = "Answer from the documents.", "Which documents mention a year, and which year?"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    written = "".join(DEFAULT_DOC_FORMAT.format(doc=d) for d in documents) + question
    plain_messages = [messages[0], {"role": "user", "content": written}]
    rules = MarkingRules(limits=DocLimits(DEFAULT_DOC_MAX_DOCUMENTS, DEFAULT_DOC_MIN_TOKENS), context_len=1 << 20)

    from sglang.srt.entrypoints.openai.parallel_prompt_encode import parallel_prompt_encode

    def plain() -> list[int]:  # SGLang's chat path: render, then its parallel encode of the rendered text
        text = tokenizer.apply_chat_template(plain_messages, tokenize=False, add_generation_prompt=True)
        return parallel_prompt_encode(tokenizer, text, {})

    def marked() -> list[int]:
        docs = parse_documents(documents, rules.limits)
        return render_chat(tokenizer, messages, docs, rules, add_generation_prompt=True).input_ids

    prompt = marked()
    for fn in (plain, marked):  # warm caches (the template's compilation) before timing
        fn()
    plain_ms, marked_ms, added = [], [], []
    for _ in range(5):  # interleaved rounds: a machine's drift moves both alike
        p, m = _median_ms(plain, repeats), _median_ms(marked, repeats)
        plain_ms.append(p)
        marked_ms.append(m)
        added.append(m - p)
    return Timing(statistics.median(plain_ms), statistics.median(marked_ms), statistics.median(added), len(prompt))


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=None,
        help="a model folder with its tokenizer (default: SmolLM2 if fetched, else the tiny test model)",
    )
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=300, help="tokens per document")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model = args.model or default_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    documents = documents_of(tokenizer, args.documents, args.tokens)
    timing = measure(tokenizer, documents, args.repeats)
    print(f"model: {model}")
    print(f"{args.documents} documents of {args.tokens} tokens, prompt {timing.prompt_tokens} tokens")
    print(f"plain render + encode (SGLang without documents): {timing.plain_ms:.2f} ms")
    print(f"documents marked by structure:                  {timing.marked_ms:.2f} ms")
    verdict = "meets" if timing.added_ms <= TARGET_MS else "misses"
    print(
        f"added by marking: {timing.added_ms:.2f} ms (median of 5 rounds of {args.repeats}; target <= "
        f"{TARGET_MS:.0f} ms: {verdict})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
