"""Where pcr-sglang keeps what it builds or derives on disk (models, embeddings, bench data).

One function, here and not with the model builders (``pcr_tools.models``), because the
client's retrieval (:mod:`pcr_client.rag.embedder`) caches into it too and must not import
the tools.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where built models and derived data are cached (``PCR_SGLANG_CACHE`` overrides)."""
    root = os.environ.get("PCR_SGLANG_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pcr-sglang"
