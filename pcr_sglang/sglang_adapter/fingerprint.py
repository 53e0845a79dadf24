"""A model fingerprint for cache keys: same fingerprint, same KV for the same tokens.

Hashing every weight byte of a multi-GB checkpoint at each start is too slow, so the
fingerprint covers the full model config plus, for each weight file, its name, size and
the bytes at its head and tail. Two checkpoints differing only in the middle of one file
with identical sizes would collide; fine-tunes change every tensor, so they do not.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _config_text(model_config: Any) -> str:
    hf_config = getattr(model_config, "hf_config", None)
    to_json = getattr(hf_config, "to_json_string", None)
    if to_json is not None:
        try:
            return to_json(use_diff=False)
        except TypeError:
            return to_json()
    return repr(hf_config)


def _weight_files(model_path: str) -> list[Path]:
    path = Path(model_path)
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())


def model_fingerprint(model_config: Any, model_path: str, revision: str | None = None) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(_config_text(model_config).encode())
    h.update(f"|revision={revision}".encode())
    files = _weight_files(model_path)
    if not files:
        # A hub id or unusual layout: fall back to the name, which is what SGLang loads.
        h.update(f"|path={os.path.normpath(model_path)}".encode())
    for f in files:
        size = f.stat().st_size
        h.update(f"|{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE_BYTES))
            if size > _SAMPLE_BYTES:
                fh.seek(max(size - _SAMPLE_BYTES, _SAMPLE_BYTES))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()
