"""Dense retrieval for the benchmark's traces, with the packaged embedder
(:mod:`pcr_client.rag.embedder`, all-MiniLM-L6-v2; corpus embeddings are cached on disk).
Search is exact cosine similarity (normalised vectors, one matrix product).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pcr_client.rag.embedder import embed_texts, load_embedder


class EmbeddingIndex:
    """Exact nearest-neighbour search over ``texts`` by cosine similarity."""

    def __init__(self, texts: Sequence[str], cache_dir: Optional[Path] = None):
        self.texts = list(texts)
        self.vectors = embed_texts(self.texts, cache_dir)

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        return load_embedder().encode(list(texts))

    def search(self, queries: Sequence[str], k: int) -> list[list[int]]:
        """For each query, the indices of the ``k`` most similar texts, most similar first
        (ties broken by index, so results are deterministic)."""
        scores = self._encode(queries) @ self.vectors.T
        order = np.arange(scores.shape[1])
        return [[int(i) for i in np.lexsort((order, -row))[:k]] for row in scores]
