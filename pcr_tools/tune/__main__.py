"""``python -m pcr_tools.tune``: fine-tune a model for ``--pcr-doc-reuse`` (see :mod:`.train`).

    python -m pcr_tools.tune --out adapters/mine                 # SmolLM2-135M-Instruct, CPU
    python -m pcr_tools.tune --base-model /models/Llama-3.2-1B-Instruct --out adapters/llama1b

On a machine with CUDA the same command trains there (the model is moved to the GPU);
the committed SmolLM2 adapter was trained on 2 CPU cores (its ``recipe.json`` says how long).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, fields

from pcr_tools.tune.train import TuneParams, parse_kinds, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = TuneParams(base_model="", out_dir="")
    parser = argparse.ArgumentParser(prog="python -m pcr_tools.tune", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-model",
        default=None,
        help="Hugging Face folder of the model to tune (default: SmolLM2-135M-Instruct, built locally).",
    )
    parser.add_argument("--out", required=True, help="Folder for the adapter, its PEFT config and recipe.json.")
    help_text = {
        "seed": "Seed of the questions, their documents and the full-attention draws.",
        "samples": "Training samples (each one question, one forward and backward).",
        "max_minutes": "Stop early after this many minutes (the recipe records the samples done).",
        "grad_accum": "Samples per optimizer step.",
        "lr": "AdamW learning rate (linear warm-up, then linear decay to 10%%).",
        "warmup_steps": "Optimizer steps of learning-rate warm-up.",
        "rank": "LoRA rank (q, k, v and o projections of every layer).",
        "alpha": "LoRA alpha.",
        "full_share": "Share of samples trained under full prefill (keeps unmarked requests' behaviour).",
        "gold_share": "Share of the --gold-kinds questions' samples trained on the gold answer "
        "(cross-entropy) instead of distilled.",
        "gold_weight": "Weight of the gold cross-entropy against the distillation KL.",
        "gold_kinds": "Comma-separated kinds of question (lead, needle, two_hop) whose samples may train on "
        "the gold answer; the others are all distilled.",
        "answer_tokens": "Longest teacher answer distilled, in tokens.",
        "min_documents": "Fewest documents per training prompt.",
        "max_documents": "Most documents per training prompt.",
        "validation_questions": "Held-out train-split questions scored before and after.",
        "threads": "torch CPU threads (default: torch's).",
        "log_every": "Log the mean loss every this many samples.",
    }
    for f in fields(TuneParams):
        if f.name in ("base_model", "out_dir"):
            continue
        default = getattr(defaults, f.name)
        kind = int if f.name == "threads" else type(default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=default,
            help=f"{help_text[f.name]} (default: {default})",
        )
    args = parser.parse_args(argv)
    try:
        parse_kinds(args.gold_kinds)
    except ValueError as exc:
        parser.error(f"--gold-kinds: {exc}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[tune] %(message)s")
    if args.base_model is None:
        from pcr_tools.models.smollm2 import build_smollm2

        args.base_model = str(build_smollm2())
    values = {f.name: getattr(args, f.name) for f in fields(TuneParams) if f.name not in ("base_model", "out_dir")}
    result = train(TuneParams(base_model=args.base_model, out_dir=args.out, **values))
    print(json.dumps(asdict(result), indent=1))


if __name__ == "__main__":
    main()
