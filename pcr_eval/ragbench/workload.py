"""Seeded RAG traces: which documents each request carries, in what order, and when it arrives.

Two document sources:

* ``retrieval`` (default): the offline Wikipedia lead extracts. Each question is written
  from a *topic* article drawn with Zipf popularity (exponent calibrated so that about 3%
  of topics draw about 60% of the questions, the skew reported for RAG corpora), and the
  k documents are chosen by a real embedding model (:mod:`pcr_eval.ragbench.retrieval`), in
  retrieval order. Which documents appear together is therefore retrieval's doing.
* ``synthetic``: documents of lognormal length (default 300-1,500 tokens) made of corpus
  words, drawn directly with Zipf popularity; for sweeps over shapes the corpus lacks.

Requests are ``[system prompt][k documents][question]`` with k from ``min_docs`` to
``max_docs``. Arrivals are a Poisson process stored at one request per second and scaled
at replay, so one trace serves a whole rate sweep. With ``followups`` > 0 a request opens
a session: each follow-up asks about the same documents after the previous answer and a
think time, so its prompt extends the previous turn's (the model's answer included).

Traces are JSONL: a header line (parameters, documents, skew achieved), then one line per
request. :func:`load_trace` reads them back; the runner replays them.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pcr_client.prompt import DocPrompt, build_doc_prompt
from pcr_tools.data import Article, load_wiki_articles

logger = logging.getLogger(__name__)

TRACE_VERSION = 1
SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using only the documents below. Be brief."
# One retrieved document in a prompt (document-reuse prompts: no position number).
DOC_FORMAT = "Document ({title}):\n{text}\n\n"
# The skew reported for RAG corpora: about 3% of documents draw about 60% of retrievals.
HOT_FRACTION = 0.03
HOT_SHARE = 0.60

_QUESTIONS = (
    "What is {title}?",
    "Why is {title} notable?",
    "Summarize what the documents say about {title}.",
    "What do the documents say about {word} in connection with {title}?",
    "How is {word} related to {title}?",
)
_FOLLOWUPS = (
    "Can you say more about {word}?",
    "What else do the documents say about {title}?",
    "Which document mentions {word}, and what does it say?",
)


@dataclass(frozen=True)
class WorkloadParams:
    source: str = "retrieval"  # "retrieval" or "synthetic"
    num_requests: int = 64  # first turns; follow-ups come on top
    corpus_docs: int = 1000  # articles retrieval searches (retrieval) or documents made (synthetic)
    min_docs: int = 3
    max_docs: int = 5
    zipf_exponent: Optional[float] = None  # None: calibrated to HOT_FRACTION / HOT_SHARE
    max_doc_chars: Optional[int] = None  # retrieval: cut long extracts (whole sentences)
    synthetic_min_tokens: int = 300
    synthetic_max_tokens: int = 1500
    followups: int = 0  # follow-up turns per session
    think_time_s: float = 2.0  # mean pause before a follow-up
    max_new_tokens: int = 16
    seed: int = 0
    # How a request lists its documents: as retrieved (a topic's neighbours in the same
    # order every time), or "shuffled" (the same documents, each request in its own order:
    # documents recur in random order, the demo's kind of traffic).
    doc_order: str = "retrieval"
    # No document in two sessions: each first turn takes its best retrieved documents no
    # earlier one used (a trace where only the system prompt recurs; follow-ups keep their
    # session's documents).
    unique_docs: bool = False

    def __post_init__(self) -> None:
        if self.source not in ("retrieval", "synthetic"):
            raise ValueError(f"source must be 'retrieval' or 'synthetic', got {self.source!r}")
        if not 1 <= self.min_docs <= self.max_docs:
            raise ValueError("need 1 <= min_docs <= max_docs")
        if self.num_requests < 1 or self.corpus_docs < self.max_docs:
            raise ValueError("need at least one request and corpus_docs >= max_docs")
        if self.zipf_exponent is not None and self.zipf_exponent < 0:
            raise ValueError("zipf_exponent must be >= 0")
        if not 0 < self.synthetic_min_tokens <= self.synthetic_max_tokens:
            raise ValueError("need 0 < synthetic_min_tokens <= synthetic_max_tokens")
        if self.followups < 0 or self.think_time_s < 0 or self.max_new_tokens < 1:
            raise ValueError("followups and think_time_s must be >= 0, max_new_tokens >= 1")
        if self.doc_order not in ("retrieval", "shuffled"):
            raise ValueError(f"doc_order must be 'retrieval' or 'shuffled', got {self.doc_order!r}")
        if self.unique_docs and self.source != "retrieval":
            raise ValueError("unique_docs needs the retrieval source")


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class TraceRequest:
    rid: str
    doc_ids: tuple[str, ...]
    question: str
    max_new_tokens: int
    arrival: Optional[float] = None  # seconds at 1 request/s; None for a follow-up
    parent: Optional[str] = None  # the previous turn of the session
    think_s: float = 0.0  # pause after the parent's answer
    session: str = ""
    turn: int = 0


@dataclass
class Trace:
    params: WorkloadParams
    documents: dict[str, Document]
    requests: list[TraceRequest]
    stats: dict[str, float] = field(default_factory=dict)
    _index: dict[str, TraceRequest] = field(default_factory=dict, init=False, repr=False, compare=False)

    def first_turns(self) -> list[TraceRequest]:
        return [r for r in self.requests if r.parent is None]

    def messages(self, request: TraceRequest, answers: dict[str, str]) -> list[dict[str, str]]:
        """Chat messages for ``request``; a follow-up carries its session's earlier turns,
        with the answers the server gave (``answers`` by rid)."""
        chain = [request]
        while chain[-1].parent is not None:
            chain.append(self._by_rid()[chain[-1].parent])
        chain.reverse()
        docs = "".join(
            DOC_FORMAT.format(title=self.documents[d].title, text=self.documents[d].text) for d in chain[0].doc_ids
        )
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{docs}Question: {chain[0].question}"},
        ]
        for earlier, later in zip(chain, chain[1:]):
            messages.append({"role": "assistant", "content": answers[earlier.rid]})
            messages.append({"role": "user", "content": f"Question: {later.question}"})
        return messages

    def doc_prompt(self, request: TraceRequest, tokenizer: Any) -> DocPrompt:
        """A first turn's prompt as token ids with its documents marked: each document is
        tokenized alone and carries no position of its own (no "Document 3"), so the same
        document is the same tokens wherever retrieval puts it (what document reuse needs;
        every configuration is sent these same tokens)."""
        if request.parent is not None:
            raise ValueError("doc_prompt builds first turns; follow-ups extend them")
        documents = [
            DOC_FORMAT.format(title=self.documents[d].title, text=self.documents[d].text) for d in request.doc_ids
        ]  # the same text as messages(), tokenized piece by piece
        return build_doc_prompt(
            tokenizer,
            SYSTEM_PROMPT,
            documents,
            request.question,
            doc_format="{doc}",
            question_format="Question: {question}",
        )

    def _by_rid(self) -> dict[str, TraceRequest]:
        if len(self._index) != len(self.requests):
            self._index = {r.rid: r for r in self.requests}
        return self._index


# ---------------------------------------------------------------------------- popularity
def zipf_weights(n: int, exponent: float) -> list[float]:
    return [1.0 / rank**exponent for rank in range(1, n + 1)]


def hot_share(n: int, exponent: float, hot_fraction: float = HOT_FRACTION) -> float:
    """Share of draws that land on the most popular ``hot_fraction`` of ``n`` items."""
    weights = zipf_weights(n, exponent)
    hot = max(1, round(n * hot_fraction))
    return sum(weights[:hot]) / sum(weights)


def calibrated_exponent(n: int, hot_fraction: float = HOT_FRACTION, share: float = HOT_SHARE) -> float:
    """The Zipf exponent under which ``hot_fraction`` of ``n`` items draw ``share`` of draws."""
    low, high = 0.0, 4.0
    for _ in range(60):
        mid = (low + high) / 2
        if hot_share(n, mid, hot_fraction) < share:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def poisson_arrivals(count: int, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process at one request per second, the first at 0."""
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(1.0)
    return times


# ---------------------------------------------------------------------------- generation
def _trim(text: str, max_chars: Optional[int]) -> str:
    if max_chars is None or len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    end = cut.rfind(". ")
    return cut[: end + 1] if end > max_chars // 2 else cut


def _content_word(text: str, title: str, rng: random.Random) -> str:
    """A content word of ``text`` not in its title, for a question that is about the text."""
    title_words = {w.lower() for w in re.findall(r"[A-Za-z]+", title)}
    words = [w for w in re.findall(r"[A-Za-z][a-z]{5,}", text) if w.lower() not in title_words]
    return rng.choice(words) if words else title


def _synthetic_documents(
    params: WorkloadParams, articles: Sequence[Article], rng: random.Random, count_tokens: Callable[[str], int]
) -> list[Document]:
    vocabulary = sorted({w for a in articles[:2000] for w in re.findall(r"[A-Za-z]{3,}", a.text)})
    mu = math.log(math.sqrt(params.synthetic_min_tokens * params.synthetic_max_tokens))
    sigma = math.log(params.synthetic_max_tokens / params.synthetic_min_tokens) / 4
    documents = []
    for i in range(params.corpus_docs):
        target = min(
            max(round(rng.lognormvariate(mu, sigma)), params.synthetic_min_tokens), params.synthetic_max_tokens
        )
        words = rng.choices(vocabulary, k=target)  # at least one token per word: enough
        low, high = 1, len(words)  # the most words that stay within the target
        while low < high:
            mid = (low + high + 1) // 2
            if count_tokens(" ".join(words[:mid])) <= target:
                low = mid
            else:
                high = mid - 1
        title = f"Synthetic {i:05d} {words[0].capitalize()}"
        documents.append(Document(doc_id=f"s{i:05d}", title=title, text=" ".join(words[:low]) + "."))
    return documents


def make_trace(
    params: WorkloadParams,
    retriever: Optional[Callable[[list[str], int], list[list[int]]]] = None,
    count_tokens: Optional[Callable[[str], int]] = None,
    articles: Optional[Sequence[Article]] = None,
) -> Trace:
    """Build a trace. ``retriever(questions, k)`` returns, per question, indices into the
    corpus documents in retrieval order (``retrieval`` source; default: the packaged
    embedder over this corpus). ``count_tokens`` sizes synthetic documents."""
    rng = random.Random(params.seed)
    corpus_articles = list(articles if articles is not None else load_wiki_articles())
    exponent = params.zipf_exponent if params.zipf_exponent is not None else calibrated_exponent(params.corpus_docs)
    if params.source == "synthetic":
        if count_tokens is None:
            raise ValueError("the synthetic source needs count_tokens (the model's tokenizer)")
        documents = _synthetic_documents(params, corpus_articles, rng, count_tokens)
    else:
        chosen = rng.sample(corpus_articles, min(params.corpus_docs, len(corpus_articles)))
        documents = [
            Document(doc_id=f"w{i:05d}", title=a.title, text=_trim(a.text, params.max_doc_chars))
            for i, a in enumerate(chosen)
        ]
    popularity_order = list(range(len(documents)))
    rng.shuffle(popularity_order)  # which document is most popular: seeded, not corpus order
    weights = zipf_weights(len(documents), exponent)
    ks = [rng.randint(params.min_docs, params.max_docs) for _ in range(params.num_requests)]
    topics = [popularity_order[i] for i in rng.choices(range(len(documents)), weights=weights, k=params.num_requests)]
    if params.source == "retrieval":
        questions = []
        for topic in topics:
            doc = documents[topic]
            word = _content_word(doc.text, doc.title, rng)
            questions.append(rng.choice(_QUESTIONS).format(title=doc.title, word=word))
        if retriever is None:
            from pcr_eval.ragbench.retrieval import EmbeddingIndex

            retriever = EmbeddingIndex([f"{d.title}. {d.text}" for d in documents]).search
        if params.unique_docs:
            retrieved = retriever(questions, min(len(documents), params.max_docs * (params.num_requests + 1)))
            used: set[int] = set()
            doc_lists = []
            for hits, k in zip(retrieved, ks):
                picked = [d for d in hits if d not in used][:k]
                if len(picked) < k:
                    raise ValueError(
                        f"unique_docs: the corpus of {len(documents)} documents has too few left "
                        f"for {params.num_requests} requests of up to {params.max_docs}"
                    )
                used.update(picked)
                doc_lists.append(picked)
        else:
            retrieved = retriever(questions, params.max_docs)
            doc_lists = [hits[:k] for hits, k in zip(retrieved, ks)]
    else:
        doc_lists = []
        for topic, k in zip(topics, ks):
            picked = [topic]
            while len(picked) < k:
                extra = popularity_order[rng.choices(range(len(documents)), weights=weights)[0]]
                if extra not in picked:
                    picked.append(extra)
            doc_lists.append(picked)
        questions = [
            rng.choice(_QUESTIONS).format(title=documents[t].title, word=_content_word(documents[t].text, "", rng))
            for t in topics
        ]
    if params.doc_order == "shuffled":  # its own generator: the rest of the trace is unchanged
        order_rng = random.Random(params.seed + 7919)
        doc_lists = [order_rng.sample(list(docs), len(docs)) for docs in doc_lists]
    arrivals = poisson_arrivals(params.num_requests, rng)
    requests: list[TraceRequest] = []
    for i, (docs, question, arrival, topic) in enumerate(zip(doc_lists, questions, arrivals, topics)):
        session = f"r{params.seed}-{i:05d}"
        doc_ids = tuple(documents[d].doc_id for d in docs)
        requests.append(
            TraceRequest(
                rid=session,
                doc_ids=doc_ids,
                question=question,
                max_new_tokens=params.max_new_tokens,
                arrival=arrival,
                session=session,
            )
        )
        parent = session
        for turn in range(1, params.followups + 1):
            doc = documents[topic]
            followup = rng.choice(_FOLLOWUPS).format(title=doc.title, word=_content_word(doc.text, doc.title, rng))
            rid = f"{session}-t{turn}"
            requests.append(
                TraceRequest(
                    rid=rid,
                    doc_ids=doc_ids,
                    question=followup,
                    max_new_tokens=params.max_new_tokens,
                    parent=parent,
                    think_s=(rng.expovariate(1 / params.think_time_s) if params.think_time_s else 0.0),
                    session=session,
                    turn=turn,
                )
            )
            parent = rid
    trace = Trace(params=params, documents={d.doc_id: d for d in documents}, requests=requests)
    trace.stats = skew_stats(trace, exponent)
    return trace


def skew_stats(trace: Trace, exponent: float) -> dict[str, float]:
    """How skewed the trace came out: the share of document uses that fall on its most
    used ``HOT_FRACTION`` of the corpus, and how many distinct documents it uses."""
    uses: dict[str, int] = {}
    for request in trace.first_turns():
        for doc_id in request.doc_ids:
            uses[doc_id] = uses.get(doc_id, 0) + 1
    counts = sorted(uses.values(), reverse=True)
    hot = max(1, round(len(trace.documents) * HOT_FRACTION))
    total = sum(counts)
    return {
        "zipf_exponent": exponent,
        "hot_doc_share": sum(counts[:hot]) / total if total else 0.0,
        "distinct_docs_used": len(uses),
        "doc_uses": total,
    }


# ---------------------------------------------------------------------------- JSONL
def save_trace(trace: Trace, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        header = {
            "type": "header",
            "version": TRACE_VERSION,
            "params": asdict(trace.params),
            "stats": trace.stats,
            "documents": [asdict(d) for d in trace.documents.values()],
        }
        f.write(json.dumps(header) + "\n")
        for request in trace.requests:
            f.write(json.dumps({"type": "request", **asdict(request)}) + "\n")
    tmp.replace(path)


def load_trace(path: Path) -> Trace:
    """Read a trace written by :func:`save_trace`; a malformed file names its bad line."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty trace")
    try:
        header = json.loads(lines[0])
        if header.get("type") != "header" or header.get("version") != TRACE_VERSION:
            raise ValueError(f"not a version-{TRACE_VERSION} trace header")
        params = WorkloadParams(**header["params"])
        documents = {d["doc_id"]: Document(**d) for d in header["documents"]}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:1: bad trace header: {e}") from e
    requests = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            raw = json.loads(line)
            raw.pop("type", None)
            raw["doc_ids"] = tuple(raw["doc_ids"])
            request = TraceRequest(**raw)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: bad request line: {e}") from e
        missing = [d for d in request.doc_ids if d not in documents]
        if missing:
            raise ValueError(f"{path}:{number}: unknown documents {missing}")
        requests.append(request)
    rids = {r.rid for r in requests}
    for request in requests:
        if request.parent is not None and request.parent not in rids:
            raise ValueError(f"{path}: request {request.rid} follows unknown {request.parent}")
    return Trace(params=params, documents=documents, requests=requests, stats=header.get("stats", {}))
