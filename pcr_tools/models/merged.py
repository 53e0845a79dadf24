"""A base checkpoint with a committed LoRA adapter merged in: a plain safetensors folder
SGLang serves like any model (no adapter at serving time, and new weights, so a cache
namespace of its own).

The adapter folder holds PEFT's ``adapter_config.json``, ``adapter_model.safetensors`` and
the tuning's ``recipe.json`` (:mod:`pcr_tools.tune.train`), whose ``adapter_sha256`` and
``adapter_config_sha256`` the two adapter files must match and whose ``base_model_sha256``
the base's weights must match: a changed or truncated adapter, an edited config (its
``lora_alpha`` and ``r`` are the merge's scaling, its target modules what is merged), or a
base other than the one it was tuned on, is refused, never merged. Both checksums are in
the merged folder's stamp, so a merged folder built from other adapter files is rebuilt,
never returned stale.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from pcr_tools.models import build_cached, weights_sha256

logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
RECIPE_FILE = "recipe.json"
# Each adapter file and the recipe field holding its SHA-256.
# mutant: merged-model-ignores-the-adapter-config
_CHECKED_FILES = ((ADAPTER_FILE, "adapter_sha256"), (CONFIG_FILE, "adapter_config_sha256"))
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def adapter_checksum(adapter_dir: Path) -> dict[str, str]:
    """The SHA-256 of the adapter's weights and of its config (by recipe field), after
    checking each against the recipe's."""
    adapter_dir = Path(adapter_dir)
    recipe_path = adapter_dir / RECIPE_FILE
    missing = [name for name, _ in _CHECKED_FILES if not (adapter_dir / name).is_file()]
    if missing or not recipe_path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {', '.join(missing + [RECIPE_FILE])}")
    result = json.loads(recipe_path.read_text())["result"]
    checksums = {}
    for name, field in _CHECKED_FILES:
        actual = hashlib.sha256((adapter_dir / name).read_bytes()).hexdigest()
        expected = result.get(field)
        if actual != expected:
            raise ValueError(
                f"{adapter_dir / name} has SHA-256 {actual}, its recipe's {field} is {expected}: refusing to merge it"
            )
        checksums[field] = actual
    return checksums


def build_merged(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """``out_dir`` holding ``base_dir``'s model with ``adapter_dir`` merged (built once, cached)."""
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    stamp = base_dir / "pcr_recipe.json"
    base_stamp = json.loads(stamp.read_text()) if stamp.is_file() else None
    recipe = {
        "base": base_stamp,
        "base_dir": base_dir.name,
        **adapter_checksum(adapter_dir),
        "merge": "peft merge_and_unload, float32",
        "version": 1,
    }

    def merge(folder: Path) -> None:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        expected_base = json.loads((adapter_dir / RECIPE_FILE).read_text()).get("base_model_sha256")
        actual_base = weights_sha256(base_dir)
        if expected_base != actual_base:
            raise ValueError(
                f"{adapter_dir} was tuned on a base with weights SHA-256 {expected_base}; {base_dir}'s "
                f"are {actual_base}: refusing to merge it into other weights"
            )
        logger.info("Merging %s into %s (once)", adapter_dir, base_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        merged.save_pretrained(folder, safe_serialization=True)
        for name in _TOKENIZER_FILES:
            if (base_dir / name).is_file():
                shutil.copy2(base_dir / name, folder / name)

    return build_cached(Path(out_dir), recipe, merge)
