"""RAG pipelines with pre-retrieval generation, as SGLang frontend DSL programs, with the
look-ahead overlapping each generation.

SGLang's ``SglFunction.run()`` hands the program to a worker thread and returns at once;
reading a variable (``state["passage"]``) waits for it. So Python between ``run()`` and
that read overlaps the generation: that is where the look-ahead starts copying clusters
and the KV hint goes out (TeleRAG's overlap, on SGLang's own frontend).

* :func:`hyde`: the LLM writes a passage answering the question (HyDE); the question
  with the passage is the search query. The look-ahead ranks clusters by the *question* while the passage is
  written.
* :func:`iter_retgen`: Iter-RetGen; round 0 retrieves for the question, each later round
  for the question plus the previous round's draft answer. The draft of round i is
  generated while the look-ahead for round i + 1 (on round i's query) runs.
* :func:`run_batch`: several questions at once, grouped by similarity (TeleRAG's prefetch
  scheduler, greedy over cosine similarity), one look-ahead per group.

The final prompt is rendered once, in Python (:func:`render_rag_prompt`), and sent as raw
text: the KV hint sends the same text, so the server tokenizes both alike and the hinted
chain is the final request's (the DSL's chat-role wrappers would template it their own way).

With ``PipelineConfig(mark_documents=True)`` (for a server with ``--pcr-doc-reuse``) each
document of the final prompt is marked (:func:`pcr_client.frontend.doc`) and the backend
must be a :class:`~pcr_client.frontend.DocReuseEndpoint`, which sends the prompt as token
ids with the documents' bounds: the server reuses each document's KV wherever it appears.
The hint is the same marked prompt, tokenized alike by the hinter, so besides the prompt's
own chain the server reads each predicted document's canonical chain ahead, order-free:
the final request reuses them whatever order the real search puts them in.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import requests

from pcr_client.hints import hint_envelope
from pcr_client.rag.ivf import normalized
from pcr_client.rag.lookahead import LookaheadRetriever, SearchResult, SearchStats
from pcr_wire import DOC_BOUNDS_PARAM

logger = logging.getLogger(__name__)

SYSTEM = "Answer the question using only the documents below. Be brief.\n\n"


def render_rag_prompt(documents: Sequence[str], question: str, mark_documents: bool = False) -> str:
    """The final prompt: system text, the documents in retrieval order, the question.
    ``mark_documents``: each document's block marked for document reuse (the same text
    once the markers are stripped)."""
    blocks = [f"Document: {d.strip()}\n\n" for d in documents]
    if mark_documents:
        from pcr_client.frontend import doc

        blocks = [doc(block) for block in blocks]
    return f"{SYSTEM}{''.join(blocks)}Question: {question}\nAnswer:"


# ---------------------------------------------------------------- the DSL programs
@functools.lru_cache(maxsize=1)
def programs():
    """Built on first use: importing SGLang's frontend costs seconds."""
    import sglang as sgl

    @sgl.function
    def hyde_passage(s, question, max_tokens):
        s += f"Write a short encyclopedia passage that answers the question.\nQuestion: {question}\nPassage:"
        s += sgl.gen("passage", max_tokens=max_tokens, temperature=0)

    @sgl.function
    def draft_answer(s, prompt, max_tokens):
        s += prompt + sgl.gen("draft", max_tokens=max_tokens, temperature=0)

    @sgl.function
    def final_answer(s, prompt, max_tokens):
        s += prompt + sgl.gen("answer", max_tokens=max_tokens, temperature=0)

    return hyde_passage, draft_answer, final_answer


# ---------------------------------------------------------------- KV hints
@dataclass
class HintStats:
    sent: int = 0
    registered: int = 0
    failed: int = 0


class KVHinter:
    """Sends the prompt a pipeline expects to send next as a hint-only ``/generate``
    request (``kv_hints`` action ``pcr.lookahead_prefetch``), from a thread of its own:
    the pipeline never waits for it, and a failed hint only costs its prefetch.
    ``cache_salt`` must be the final request's (a hint reaches only its tenant's chains);
    SGLang's DSL ``RuntimeEndpoint`` sends none, so leave it unset with the DSL.
    ``tokenizer``: the one a ``DocReuseEndpoint`` uses; needed to hint prompts with marked
    documents, which go as token ids with their bounds, exactly as the final request."""

    def __init__(
        self,
        url: str,
        ttl_s: float = 15.0,
        cache_salt: Optional[str] = None,
        timeout_s: float = 10.0,
        tokenizer: Any = None,
    ):
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.ttl_s = ttl_s
        self.cache_salt = cache_salt
        self.timeout_s = timeout_s
        self.stats = HintStats()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="pcr-rag-hints")
        self._session = requests.Session()

    def send(self, prompts: Sequence[str], group: Optional[str] = None) -> Future:
        group = group or uuid.uuid4().hex
        return self._pool.submit(self._send, list(prompts), group)

    def _send(self, prompts: list[str], group: str) -> int:
        registered = 0
        for rank, prompt in enumerate(prompts):
            payload: dict[str, Any] = {
                **self._prompt_fields(prompt),
                "kv_hints": hint_envelope(
                    {"hint_only": True, "ttl_s": self.ttl_s, "group": group, "rank": rank}, uuid.uuid4().hex
                ),
            }
            if self.cache_salt is not None:
                payload["cache_salt"] = self.cache_salt
            self.stats.sent += 1
            try:
                response = self._session.post(f"{self.url}/generate", json=payload, timeout=self.timeout_s)
                response.raise_for_status()
                finish = response.json().get("meta_info", {}).get("finish_reason") or {}
                registered += finish.get("pcr_hint") == "registered"
            except (requests.RequestException, ValueError) as e:
                self.stats.failed += 1
                logger.warning("a KV hint failed (its prefetch is lost, nothing else): %s", e)
        self.stats.registered += registered
        return registered

    def _prompt_fields(self, prompt: str) -> dict[str, Any]:
        from pcr_client.frontend import DOC_OPEN, marked_input

        if DOC_OPEN not in prompt:
            return {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
        if self.tokenizer is None:
            raise ValueError("a prompt with marked documents needs KVHinter(tokenizer=...)")
        ids, bounds = marked_input(self.tokenizer, prompt)
        return {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "custom_params": {DOC_BOUNDS_PARAM: bounds}}}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._session.close()


# ---------------------------------------------------------------- pipelines
@dataclass
class PipelineResult:
    question: str
    answer: str
    doc_ids: list[int]
    queries: list[str] = field(default_factory=list)  # what each search searched for
    searches: list[SearchStats] = field(default_factory=list)
    generation_s: float = 0.0  # pre-retrieval generation (what the look-ahead overlaps)
    retrieval_s: float = 0.0
    answer_s: float = 0.0  # the final request, end to end
    answer_ttft_s: Optional[float] = None
    total_s: float = 0.0
    cached_tokens: Optional[int] = None  # of the final request
    cached_details: dict = field(default_factory=dict)

    @property
    def cluster_hit_rate(self) -> float:
        probed = sum(s.probed for s in self.searches)
        return sum(s.hits for s in self.searches) / probed if probed else 0.0


@dataclass
class PipelineConfig:
    k: int = 3  # documents in the final prompt
    hyde_tokens: int = 48
    draft_tokens: int = 32
    answer_tokens: int = 32
    rounds: int = 2  # iter_retgen
    lookahead: bool = True  # clusters into the fast tier during generation
    hints: bool = True  # the predicted final prompt's KV read ahead (needs a KVHinter)
    # Final prompts with marked documents, for --pcr-doc-reuse (needs a DocReuseEndpoint,
    # and a KVHinter with its tokenizer).
    mark_documents: bool = False


class Pipelines:
    """The pipelines over one retriever, corpus and SGLang backend."""

    def __init__(
        self,
        retriever: LookaheadRetriever,
        texts: Sequence[str],
        backend: Any,
        hinter: Optional[KVHinter] = None,
        config: PipelineConfig = PipelineConfig(),
    ):
        self.retriever = retriever
        self.texts = list(texts)
        self.backend = backend
        self.hinter = hinter
        self.config = config
        if config.mark_documents:
            from pcr_client.frontend import DocReuseEndpoint

            if not isinstance(backend, DocReuseEndpoint):
                raise ValueError(
                    "PipelineConfig(mark_documents=True) needs a "
                    "pcr_client.frontend.DocReuseEndpoint backend: a RuntimeEndpoint would send "
                    "the markers as text"
                )
            if hinter is not None and config.hints and hinter.tokenizer is None:
                raise ValueError(
                    "PipelineConfig(mark_documents=True) with hints needs KVHinter(tokenizer=backend.tokenizer)"
                )

    def _docs(self, result: SearchResult, row: int = 0) -> list[int]:
        return [int(i) for i in result.ids[row] if i >= 0][: self.config.k]

    def _hint(self, predicted_ids: np.ndarray, question: str) -> None:
        if self.hinter is None or not self.config.hints:
            return
        docs = [self.texts[int(i)] for i in predicted_ids if i >= 0][: self.config.k]
        self.hinter.send([render_rag_prompt(docs, question, self.config.mark_documents)])

    def _answer(self, result: PipelineResult, docs: list[int], question: str, start: float) -> PipelineResult:
        _, _, final_answer = programs()
        prompt = render_rag_prompt([self.texts[i] for i in docs], question, self.config.mark_documents)
        answer_start = time.perf_counter()
        state = final_answer.run(prompt=prompt, max_tokens=self.config.answer_tokens, backend=self.backend)
        result.answer = state["answer"].strip()
        result.answer_s = time.perf_counter() - answer_start
        meta = state.get_meta_info("answer") or {}
        result.cached_tokens = meta.get("cached_tokens")
        result.cached_details = meta.get("cached_tokens_details") or {}
        result.doc_ids = docs
        result.total_s = time.perf_counter() - start
        return result

    def _lookahead(self, query: str, stage: str):
        """Clusters (``lookahead``) and the prediction the hint needs (``hints``)."""
        if not (self.config.lookahead or (self.config.hints and self.hinter is not None)):
            return None
        hinting = self.config.hints and self.hinter is not None
        return self.retriever.lookahead(query, stage=stage, prefetch=self.config.lookahead, predict=hinting)

    def hyde(self, question: str) -> PipelineResult:
        hyde_passage, _, _ = programs()
        start = time.perf_counter()
        result = PipelineResult(question, "", [])
        state = hyde_passage.run(question=question, max_tokens=self.config.hyde_tokens, backend=self.backend)
        ticket = self._lookahead(question, "hyde")
        if ticket is not None:
            self._hint(ticket.predicted_ids[0], question)
        passage = state["passage"]  # waits for the generation
        result.generation_s = time.perf_counter() - start
        self.retriever.observe_stage("hyde", result.generation_s)
        search_start = time.perf_counter()
        result.queries.append(f"{question} {passage}")
        found = self.retriever.search(result.queries[-1], ticket)
        result.retrieval_s = time.perf_counter() - search_start
        result.searches.append(found.stats)
        return self._answer(result, self._docs(found), question, start)

    def iter_retgen(self, question: str) -> PipelineResult:
        _, draft_answer, _ = programs()
        start = time.perf_counter()
        result = PipelineResult(question, "", [])
        query = question
        ticket = None
        docs: list[int] = []
        for round_no in range(self.config.rounds):
            search_start = time.perf_counter()
            result.queries.append(query)
            found = self.retriever.search(query, ticket)
            result.retrieval_s += time.perf_counter() - search_start
            result.searches.append(found.stats)
            docs = self._docs(found)
            if round_no == self.config.rounds - 1:
                break
            prompt = render_rag_prompt([self.texts[i] for i in docs], question, self.config.mark_documents)
            gen_start = time.perf_counter()
            state = draft_answer.run(prompt=prompt, max_tokens=self.config.draft_tokens, backend=self.backend)
            # While round i's draft is written: the look-ahead for round i + 1, on round i's query.
            ticket = self._lookahead(query, "iter-retgen")
            if ticket is not None and round_no == self.config.rounds - 2:
                self._hint(ticket.predicted_ids[0], question)
            draft = state["draft"]
            seconds = time.perf_counter() - gen_start
            result.generation_s += seconds
            self.retriever.observe_stage("iter-retgen", seconds)
            query = f"{question} {draft}"
        return self._answer(result, docs, question, start)

    def run(self, name: str, question: str) -> PipelineResult:
        return {"hyde": self.hyde, "iter-retgen": self.iter_retgen}[name](question)


PIPELINES = ("hyde", "iter-retgen")  # the names Pipelines.run takes


def group_queries(vectors: np.ndarray, group_size: int) -> list[list[int]]:
    """TeleRAG's prefetch scheduler: seed each group with the remaining query most similar
    to the rest (largest row sum of cosine similarities), add its ``group_size - 1`` most
    similar remaining queries; repeat. Deterministic (ties by index)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    x = normalized(vectors)
    similarity = x @ x.T
    remaining = list(range(len(x)))
    groups = []
    while remaining:
        sub = similarity[np.ix_(remaining, remaining)]
        seed = remaining[int(np.argmax(sub.sum(axis=1)))]
        others = [i for i in remaining if i != seed]
        others.sort(key=lambda i: (-similarity[seed, i], i))
        group = [seed] + others[: group_size - 1]
        groups.append(group)
        remaining = [i for i in remaining if i not in group]
    return groups


def run_batch(
    pipelines: Pipelines,
    name: str,
    questions: Sequence[str],
    group_size: int = 4,
    embed: Optional[Callable[[list[str]], np.ndarray]] = None,
) -> list[PipelineResult]:
    """Run ``questions`` a group at a time, each group's pipelines concurrently. Before a
    group starts, one look-ahead over all its questions fetches the clusters they share
    (round-robin by rank within one budget); each pipeline's own look-ahead then finds those
    resident (they cost nothing) and spends its budget further down its own ranking."""
    embed = embed or pipelines.retriever._embed
    vectors = np.asarray(embed(list(questions)), dtype=np.float32)
    results: list[Optional[PipelineResult]] = [None] * len(questions)
    for group in group_queries(vectors, group_size):
        if pipelines.config.lookahead:
            pipelines.retriever.lookahead_vectors(vectors[group], stage=name, predict=False)  # clusters only
        with ThreadPoolExecutor(len(group)) as pool:
            for i, result in zip(group, pool.map(lambda i: pipelines.run(name, questions[i]), group)):
                results[i] = result
    return [r for r in results if r is not None]
