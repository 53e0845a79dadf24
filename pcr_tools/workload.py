"""Seeded RAG workloads over the offline Wikipedia corpus.

Each request is ``[system prompt][k documents][question]``: documents are drawn with a
Zipf-like popularity over a pool of articles, so popular documents recur and prompts
share prefixes the way RAG traffic does. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pcr_tools.data import Article, load_wiki_articles

SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using only the documents below. Be brief."


@dataclass(frozen=True)
class RagWorkloadParams:
    num_requests: int = 50
    doc_pool_size: int = 200
    min_docs: int = 3
    max_docs: int = 5
    zipf_exponent: float = 1.0
    max_doc_chars: Optional[int] = None
    seed: int = 0


@dataclass(frozen=True)
class RagRequest:
    rid: str
    system: str
    documents: tuple[Article, ...]
    question: str

    def user_message(self) -> str:
        docs = "\n\n".join(f"Document {i + 1} ({d.title}):\n{d.text}" for i, d in enumerate(self.documents))
        return f"{docs}\n\nQuestion: {self.question}"

    def chat_messages(self) -> list[dict[str, str]]:
        """The request as chat messages, for models with a chat template."""
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.user_message()},
        ]

    def plain_prompt(self) -> str:
        """The prompt as raw text, for models without a chat template."""
        return f"{self.system}\n\n{self.user_message()}\nAnswer:"


def chat_prompt(tokenizer: Any, request: RagRequest) -> str:
    """The request as text, through a Hugging Face tokenizer's chat template."""
    return tokenizer.apply_chat_template(request.chat_messages(), tokenize=False, add_generation_prompt=True)


def _truncate(article: Article, max_chars: Optional[int]) -> Article:
    if max_chars is None or len(article.text) <= max_chars:
        return article
    cut = article.text[:max_chars]
    # End on a sentence boundary when there is one, so the model reads whole sentences.
    end = cut.rfind(". ")
    text = cut[: end + 1] if end > max_chars // 2 else cut
    return Article(title=article.title, text=text, topic=article.topic)


def zipf_weights(n: int, exponent: float) -> list[float]:
    return [1.0 / (rank**exponent) for rank in range(1, n + 1)]


def make_rag_workload(params: RagWorkloadParams, articles: Optional[Sequence[Article]] = None) -> list[RagRequest]:
    if params.min_docs < 1 or params.max_docs < params.min_docs:
        raise ValueError("need 1 <= min_docs <= max_docs")
    corpus = list(articles if articles is not None else load_wiki_articles())
    rng = random.Random(params.seed)
    pool = rng.sample(corpus, min(params.doc_pool_size, len(corpus)))
    pool = [_truncate(a, params.max_doc_chars) for a in pool]
    weights = zipf_weights(len(pool), params.zipf_exponent)
    requests = []
    for i in range(params.num_requests):
        k = rng.randint(params.min_docs, min(params.max_docs, len(pool)))
        chosen: list[Article] = []
        while len(chosen) < k:
            doc = rng.choices(pool, weights=weights)[0]
            if doc not in chosen:
                chosen.append(doc)
        asked = rng.choice(chosen)
        question = f"What is {asked.title}, according to the documents?"
        requests.append(
            RagRequest(rid=f"rag-{params.seed}-{i}", system=SYSTEM_PROMPT, documents=tuple(chosen), question=question)
        )
    return requests


def working_set_tokens(prompts: Sequence[Sequence[int]], chunk_size: int) -> int:
    """Tokens in the distinct chunk-aligned prefixes of ``prompts``: what a prefix cache
    must hold to never recompute a whole chunk it has seen."""
    seen: set[tuple[int, ...]] = set()
    for ids in prompts:
        for end in range(chunk_size, len(ids) + 1, chunk_size):
            seen.add(tuple(ids[:end]))
    return len(seen) * chunk_size
