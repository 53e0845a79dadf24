"""Is the installed SGLang the pinned release with pcr-sglang's patches applied?

``scripts/apply_patches.py`` records the SHA-256 of every file it patched in a stamp
inside the SGLang package. Comparing those hashes is cheap enough for every process
start and catches an SGLang reinstalled or upgraded after the patches were applied.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

PINNED_SGLANG_VERSION = "0.5.23"
STAMP_NAME = ".pcr-sglang-patches.json"
FIX_HINT = "Run `bash scripts/install.sh` (or `python scripts/apply_patches.py`) to fix it."


@dataclass(frozen=True)
class InstallProblem:
    message: str


def check_sglang_install() -> Optional[InstallProblem]:
    """None when SGLang is the pinned version with our patches intact."""
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return InstallProblem(f"SGLang is not installed. {FIX_HINT}")
    if version != PINNED_SGLANG_VERSION:
        return InstallProblem(
            f"pcr-sglang needs sglang=={PINNED_SGLANG_VERSION} but {version} is installed. {FIX_HINT}"
        )
    root = Path(str(metadata.distribution("sglang").locate_file("")))  # a SimplePath: its str is the path
    stamp_path = root / "sglang" / STAMP_NAME
    if not stamp_path.is_file():
        return InstallProblem(f"SGLang {version} is installed without pcr-sglang's patches. {FIX_HINT}")
    try:
        stamp = json.loads(stamp_path.read_text())
        files = dict(stamp["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return InstallProblem(f"pcr-sglang's patch stamp {stamp_path} is unreadable ({e}). {FIX_HINT}")
    for rel_path, digest in files.items():
        path = root / rel_path
        try:
            actual = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as e:
            return InstallProblem(f"Patched file {path} is unreadable ({e}). {FIX_HINT}")
        if actual != digest:
            return InstallProblem(
                f"{path} changed after pcr-sglang's patches were applied (SGLang reinstalled or edited). {FIX_HINT}"
            )
    return None
