"""Look-ahead retrieval (TeleRAG): fetch the clusters a search will probe while the LLM
still writes its query, then search them where they landed and the rest with faiss.

* :meth:`LookaheadRetriever.lookahead` (non-blocking beyond embedding and ranking): ranks
  the clusters for the stage's *input* (the question a HyDE passage or sub-question is
  written from) and queues the top ones, within the budget, for the fast tier; it also
  predicts the documents (the input's own top ``predict_k`` over its probe), which the KV
  hints use to warm the KV cache.
* :meth:`LookaheadRetriever.search`: probes the real query's clusters; the landed ones are
  searched in the fast tier while faiss searches the others (``search_preassigned``, in a
  thread: faiss releases the GIL), and the two top-k lists are merged.

``mode="exact"`` (the default) returns what faiss's IVF search returns at the same
``nprobe``: the same clusters are searched, only where differs (a cluster still copying
counts as a miss). ``mode="superset"`` (TeleRAG's) also searches every other landed
cluster: recall is never below IVF's, results may differ from it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from pcr_client.rag.budget import BudgetModel, fill_budget
from pcr_client.rag.fast_host import HostClusterTier, top_k
from pcr_client.rag.ivf import IVFDatastore, normalized

logger = logging.getLogger(__name__)

SEARCH_MODES = ("exact", "superset")
Texts = Union[str, Sequence[str]]


@dataclass
class Ticket:
    """What one look-ahead ordered and predicted."""

    stage: str
    ranked: np.ndarray  # [n, prefetch_nprobe] clusters by the input's similarity
    submitted: list[int]  # clusters queued for the fast tier (already resident ones not)
    budget_bytes: int
    predicted_ids: np.ndarray  # [n, predict_k] documents the input itself retrieves (-1: not predicted)
    predicted_scores: np.ndarray
    started: float = field(default_factory=time.monotonic)


@dataclass
class SearchStats:
    probed: int = 0  # (query, cluster) pairs probed
    hits: int = 0  # of those, landed in the fast tier
    in_flight: int = 0  # resident but still copying: searched by faiss
    from_ticket: int = 0  # hits on clusters the search's own look-ahead ordered
    fast_s: float = 0.0
    slow_s: float = 0.0
    merge_s: float = 0.0
    total_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.probed if self.probed else 0.0


@dataclass
class SearchResult:
    distances: np.ndarray  # [n, k], -inf where fewer than k were found
    ids: np.ndarray  # [n, k] document ids, -1 where fewer than k were found
    stats: SearchStats


class LookaheadRetriever:
    def __init__(
        self,
        datastore: IVFDatastore,
        embed: Callable[[list[str]], np.ndarray],
        nprobe: int,
        k: int,
        tier: Optional[HostClusterTier] = None,
        prefetch_nprobe: Optional[int] = None,
        predict_k: Optional[int] = None,
        mode: str = "exact",
        budget: Optional[BudgetModel] = None,
    ):
        if mode not in SEARCH_MODES:
            raise ValueError(f"mode must be one of {', '.join(SEARCH_MODES)}, got {mode!r}")
        if not 1 <= nprobe <= datastore.nlist:
            raise ValueError(f"nprobe must be in [1, {datastore.nlist}], got {nprobe}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.datastore = datastore
        self.embed = embed
        self.nprobe = nprobe
        self.k = k
        self.tier = tier
        # TeleRAG ranks 4x the search's nprobe for the prefetch; the budget decides how many go.
        self.prefetch_nprobe = min(prefetch_nprobe or 4 * nprobe, datastore.nlist)
        self.predict_k = predict_k or 2 * k
        self.mode = mode
        self.budget = budget or BudgetModel()
        self._slow = ThreadPoolExecutor(1, thread_name_prefix="pcr-rag-faiss")
        # Hugging Face fast tokenizers refuse concurrent calls ("Already borrowed"): pipelines
        # running in threads embed one at a time.
        self._embed_lock = threading.Lock()

    # ------------------------------------------------------------------ look-ahead
    def lookahead(self, inputs: Texts, stage: str = "default", prefetch: bool = True, predict: bool = True) -> Ticket:
        """Rank clusters for ``inputs``, (``prefetch``) queue the top ones for the fast tier
        and (``predict``: what KV hints need) search them for the documents ``inputs``
        itself retrieves. The prediction is a faiss search: on a datastore memory-mapped
        from disk it reads the input's clusters, which also leaves them in the page cache
        for the real search."""
        return self.lookahead_vectors(self._embed(inputs), stage, prefetch, predict)

    def lookahead_vectors(
        self, vectors: np.ndarray, stage: str = "default", prefetch: bool = True, predict: bool = True
    ) -> Ticket:
        x = normalized(vectors)
        _, ranked = self.datastore.probe(x, self.prefetch_nprobe)
        submitted: list[int] = []
        budget = 0
        if self.tier is not None and prefetch:
            self.budget.observe_bandwidth(self.tier.stats.bandwidth_bytes_s)
            budget = min(self.budget.budget_bytes(stage), self.tier.capacity_bytes)
            chosen = fill_budget(ranked, self.tier.cost, budget, self.tier.is_resident)
            protect = {int(c) for c in ranked[:, : self.nprobe].ravel() if c >= 0}
            submitted = self.tier.submit(chosen, protect=protect)
        if predict:
            scores, ids = self.datastore.search(x, self.predict_k, self.nprobe)
        else:
            ids = np.full((len(x), self.predict_k), -1, dtype=np.int64)
            scores = np.full((len(x), self.predict_k), -np.inf, dtype=np.float32)
        return Ticket(stage, ranked, submitted, budget, ids, scores)

    def observe_stage(self, stage: str, seconds: float) -> None:
        """Report a stage's pre-retrieval generation time (the budget's ``t_pre``)."""
        self.budget.observe_stage(stage, seconds)

    # ------------------------------------------------------------------ search
    def search(self, queries: Texts, ticket: Optional[Ticket] = None) -> SearchResult:
        """Search ``queries`` (texts); ``ticket``, the look-ahead made for them, only
        attributes hits in the stats (any landed cluster serves any search)."""
        return self.search_vectors(self._embed(queries), ticket)

    def search_vectors(self, vectors: np.ndarray, ticket: Optional[Ticket] = None) -> SearchResult:
        start = time.perf_counter()
        x = normalized(vectors)
        probe_scores, probe = self.datastore.probe(x, self.nprobe)
        stats = SearchStats(probed=int((probe >= 0).sum()))
        if self.tier is None:
            slow_start = time.perf_counter()
            distances, ids = self.datastore.search_preassigned(x, self.k, probe, probe_scores)
            stats.slow_s = time.perf_counter() - slow_start
            stats.total_s = time.perf_counter() - start  # the probe included, as with a tier
            return SearchResult(distances, ids, stats)
        wanted = {int(c) for c in probe.ravel() if c >= 0}
        with self.tier.pinned(wanted if self.mode == "exact" else self._all_resident()) as landed:
            hit = np.isin(probe, list(landed)) & (probe >= 0)
            stats.hits = int(hit.sum())
            if ticket is not None:
                stats.from_ticket = int(np.isin(probe[hit], ticket.submitted).sum())
            stats.in_flight = sum(
                1 for c in probe.ravel() if c >= 0 and c not in landed and self.tier.is_resident(int(c))
            )
            misses = np.where(hit, -1, probe)
            slow = self._slow.submit(self._timed_preassigned, x, misses, probe_scores)
            fast_start = time.perf_counter()
            # mutant: rag-exact-mode-searches-every-landed-cluster
            if self.mode == "exact":
                mine = [[int(c) for c in row[h]] for row, h in zip(probe, hit)]
            else:  # every landed cluster, probed or not
                mine = [sorted(landed)] * len(x)
            fast = self.tier.search(x, mine, self.k, landed)
            stats.fast_s = time.perf_counter() - fast_start
            (slow_d, slow_i), stats.slow_s = slow.result()
        merge_start = time.perf_counter()
        distances, ids = merge_top_k((fast[0], slow_d), (fast[1], slow_i), self.k)
        stats.merge_s = time.perf_counter() - merge_start
        stats.total_s = time.perf_counter() - start
        return SearchResult(distances, ids, stats)

    def _timed_preassigned(self, x: np.ndarray, clusters: np.ndarray, scores: np.ndarray):
        start = time.perf_counter()
        result = self.datastore.search_preassigned(x, self.k, clusters, scores)
        return result, time.perf_counter() - start

    def _all_resident(self) -> list[int]:
        return [c for c in range(self.datastore.nlist) if self.tier.is_landed(c)]

    def _embed(self, texts: Texts) -> np.ndarray:
        batch = [texts] if isinstance(texts, str) else list(texts)
        with self._embed_lock:
            return np.asarray(self.embed(batch), dtype=np.float32)

    def close(self) -> None:
        self._slow.shutdown(wait=True)
        if self.tier is not None:
            self.tier.close()


def merge_top_k(distances: Sequence[np.ndarray], ids: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query, the top ``k`` of several top-k lists (``-1`` entries dropped), highest
    score first, ties by smaller id."""
    d = np.concatenate(distances, axis=1)
    i = np.concatenate(ids, axis=1)
    n = len(d)
    out_d = np.full((n, k), -np.inf, np.float32)
    out_i = np.full((n, k), -1, np.int64)
    for row in range(n):
        valid = i[row] >= 0
        top_d, top_i = top_k(d[row][valid], i[row][valid], k)
        out_d[row, : len(top_d)] = top_d
        out_i[row, : len(top_i)] = top_i
    return out_d, out_i
