"""``python -m pcr_tools.calibrate --url URL``: measure document reuse's accuracy on the model
a running server serves, and write the calibration file ``--pcr-doc-reuse-calibration`` takes.

The server must run ``--pcr-doc-reuse`` (``lego`` or ``blend`` to calibrate those modes:
``concat`` is always measured). On a sample of questions about re-placed documents
(``pcr_tools.tune.questions``, test split, a calibration seed of its own), each prompt is
sent unmarked (full prefill's answer: the exact prefix cache gives full prefill's tokens)
and then marked, under each setting (``concat``; ``lego`` K in ``--lego-tokens``; ``blend``
R in ``--blend-ratios``). A setting meets the target when full prefill's answers,
teacher-forced under it, keep their top-1 token at least ``--top1-min`` of the time, and
its gold-answer score (lead-sentence F1, planted-fact exact match) is at least
``--gold-ratio-min`` of full prefill's. The file records every setting's figures, each
mode's smallest setting that met the target, the target, the serving conditions (the
server's selector, anchor tokens and KV dtype; the requests use the server's) and the
weights' fingerprint (the server refuses a calibration of other weights or conditions).

    python -m pcr_tools.calibrate --url http://127.0.0.1:30000 --out smollm2-calibration.json
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pcr_eval.calibration import measure_setting, unmarked_reference
from pcr_sglang.reuse.calibration import (
    CalibrationConditions,
    CalibrationTarget,
    DocReuseCalibration,
    smallest_meeting,
)

logger = logging.getLogger(__name__)

CALIBRATION_SEED = 1000  # the benchmark's questions use seeds 0, 1, ...
DEFAULT_LEGO_TOKENS = (16, 32, 64, 128)
DEFAULT_BLEND_RATIOS = (0.15, 0.3, 0.5, 0.7, 1.0)


def calibrate(
    server: Any,
    tokenizer: Any,
    *,
    questions: int,
    target: CalibrationTarget,
    lego_tokens: Sequence[int],
    blend_ratios: Sequence[float],
    max_new_tokens: int = 32,
    top_k: int = 10,
    progress: Callable[[str], None] = logger.info,
) -> DocReuseCalibration:
    from pcr_eval.gold import gold_prompts
    from pcr_eval.modes import ModeSpec
    from pcr_tools.tune.questions import question_set

    state = server.pcr_state()
    docs = state.get("doc_reuse") or {}
    server_mode = docs.get("mode")
    if not server_mode:
        raise RuntimeError("the server does not run --pcr-doc-reuse: nothing to calibrate")
    fingerprint = (state.get("namespace") or {}).get("model_fingerprint")
    if not fingerprint:
        raise RuntimeError("the server reports no model fingerprint (/server_info pcr.namespace)")
    if not docs.get("conditions"):
        raise RuntimeError("the server reports no document-reuse conditions (selector, anchors, KV dtype)")
    conditions = CalibrationConditions(**docs["conditions"])
    info = server.server_info()
    prompts = gold_prompts(question_set("test", questions, CALIBRATION_SEED), tokenizer, CALIBRATION_SEED)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    progress(f"full prefill's answers to {len(prompts)} questions (unmarked)")
    references = [unmarked_reference(server, p, max_new_tokens, top_k, decode) for p in prompts]
    plans: dict[str, list[Any]] = {"concat": [ModeSpec("concat")]}
    if server_mode in ("lego", "blend"):
        plans["lego"] = [ModeSpec("lego", float(k)) for k in sorted(lego_tokens)]
        plans["blend"] = [ModeSpec("blend", float(r)) for r in sorted(blend_ratios)]
    modes = {}
    for mode, specs in plans.items():
        results = []
        for spec in specs:
            result = measure_setting(server, prompts, references, spec, target, max_new_tokens, decode)
            results.append(result)
            progress(
                f"{spec.name}: top-1 {_fmt(result.top1)}, gold {_fmt(result.gold_ratio, pct=True)} of full "
                f"prefill's, KL {_fmt(result.kl)} -> {'meets' if result.meets else 'misses'} the target"
            )
            if result.meets:
                break  # the smallest setting that meets it: larger ones recompute more
        modes[mode] = smallest_meeting(mode, results)
    model = Path(str(info.get("model_path", ""))).name  # by name: the file is shared, the path is this machine's
    return DocReuseCalibration(
        model_fingerprint=fingerprint,
        model=model,
        target=target,
        questions=len(prompts),
        modes=modes,
        conditions=conditions,
        created=datetime.datetime.now().isoformat(timespec="seconds"),
    )


def _fmt(value: Optional[float], pct: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:.0%}" if pct else f"{value:.3f}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pcr_tools.calibrate",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--url", required=True, help="the running server (started with --pcr-doc-reuse)")
    parser.add_argument("--out", type=Path, required=True, help="the calibration file to write (JSON)")
    parser.add_argument("--tokenizer", default=None, help="default: the server's --model-path (a local folder)")
    parser.add_argument("--admin-api-key", default=None, help="the server's --admin-api-key, if it has one")
    parser.add_argument("--questions", type=int, default=24, help="calibration questions (default 24)")
    parser.add_argument(
        "--top1-min",
        type=float,
        default=CalibrationTarget.top1_min,
        help="target: teacher-forced top-1 agreement with full prefill (default %(default)s)",
    )
    parser.add_argument(
        "--gold-ratio-min",
        type=float,
        default=CalibrationTarget.gold_ratio_min,
        help="target: gold-answer score as a share of full prefill's (default %(default)s)",
    )
    parser.add_argument(
        "--lego-tokens",
        default=",".join(map(str, DEFAULT_LEGO_TOKENS)),
        help="lego K values tried, smallest first (default %(default)s)",
    )
    parser.add_argument(
        "--blend-ratios",
        default=",".join(map(str, DEFAULT_BLEND_RATIOS)),
        help="blend R values tried, smallest first (default %(default)s)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32, help="answer length (default 32)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[calibrate] %(message)s", stream=sys.stderr)
    try:
        lego = [int(x) for x in args.lego_tokens.split(",") if x.strip()]
        blend = [float(x) for x in args.blend_ratios.split(",") if x.strip()]
    except ValueError as e:
        parser.error(f"--lego-tokens / --blend-ratios: {e}")
    if args.questions < 1 or any(k < 0 for k in lego) or any(not 0 <= r <= 1 for r in blend):
        parser.error("--questions must be >= 1, K >= 0 and R in [0, 1]")
    from transformers import AutoTokenizer

    from pcr_tools.launcher import ServerClient

    server = ServerClient(args.url, args.admin_api_key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or server.server_info()["model_path"])
        calibration = calibrate(
            server,
            tokenizer,
            questions=args.questions,
            target=CalibrationTarget(args.top1_min, args.gold_ratio_min),
            lego_tokens=lego,
            blend_ratios=blend,
            max_new_tokens=args.max_new_tokens,
        )
    except Exception as e:  # noqa: BLE001 - a CLI: one clear line, not a traceback
        print(f"calibration failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    args.out.write_text(calibration.to_json())
    for mode, verdict in calibration.modes.items():
        value = "" if verdict.value is None else f" at {verdict.value:g}"
        print(f"{mode}: {'meets the target' + value if verdict.meets else 'misses the target'}")
    print(f"wrote {args.out}: start the server with --pcr-doc-reuse-calibration {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
