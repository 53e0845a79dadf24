"""Pool several runs of the questions workload into one report, with intervals over all their questions.

    python -m bench.reuse_pool --out DIR \\
        --base RUN0.json:base --base RUN1.json:SmolLM2-135M-Instruct \\
        --series "tuned/gradual=RUN0.json:tuned:blend:0.15:gradual,RUN1.json:SmolLM2-135M-Instruct-doc-reuse:blend"

A run of ``python -m bench.doc_reuse_accuracy`` over 36 questions takes minutes a model on
two cores, and one question more or less moves a kind's exact match by 8 points at 12 a
kind: one run cannot separate two adapters or tell a loss from noise. Runs over other seeds
(``--seeds``) ask other questions; this pools them. Each run's JSON result
(``<stamp>.json``) keeps every question's rows; questions are matched across runs by their
id (``kind-seed-index``), so a question asked in two runs is an error, not counted twice.

``--base FILE:MODEL`` (repeatable): the base model's full-prefill rows, the gold reference
of every "% of base full prefill" column. ``--series LABEL=FILE:MODEL:MODE[,FILE:MODEL:MODE...]``
(repeatable): one row of the tables, ``LABEL`` as ``model/mode``, pooled from the named
runs' rows; a mode is named as that run named it (``blend`` was the ``deviation`` selector
before 2026-12-06 03:37, ``gradual`` after: say which in the label). Each series' fidelity
and noise floor come from the full-prefill rows of the same run and model. A series only
counts the questions the base reference has.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pcr_eval.gold import GoldPrompt, gold_prompts
from pcr_eval.questions_report import FULL, markdown_tables, summarize_full, summarize_mode, target_lines

logger = logging.getLogger(__name__)

PromptsFor = Callable[[int, int], list[GoldPrompt]]  # (seed, questions per seed) -> that run's prompts


@dataclass(frozen=True)
class Source:
    """One run's (model, mode) rows."""

    path: Path
    model: str
    mode: str = FULL

    @classmethod
    def parse(cls, text: str, with_mode: bool) -> Source:
        parts = text.split(":")
        if len(parts) < (3 if with_mode else 2) or not all(parts[: 3 if with_mode else 2]):
            shape = "FILE:MODEL:MODE" if with_mode else "FILE:MODEL"
            raise ValueError(f"expected {shape}, got {text!r}")
        if not with_mode:
            if len(parts) != 2:
                raise ValueError(f"expected FILE:MODEL, got {text!r}")
            return cls(Path(parts[0]), parts[1])
        return cls(Path(parts[0]), parts[1], ":".join(parts[2:]))  # a mode may hold colons (blend:0.15:gradual)


@dataclass(frozen=True)
class Series:
    model_label: str
    mode_label: str
    sources: tuple[Source, ...]

    @classmethod
    def parse(cls, text: str) -> Series:
        label, sep, sources = text.partition("=")
        model_label, slash, mode_label = label.partition("/")
        if not sep or not slash or not model_label or not mode_label or not sources:
            raise ValueError(f"expected MODEL/MODE=FILE:MODEL:MODE[,...], got {text!r}")
        return cls(model_label, mode_label, tuple(Source.parse(s, True) for s in sources.split(",")))


class Runs:
    """The runs' results, read once, and their prompts rebuilt by question id."""

    def __init__(self, prompts_for: PromptsFor):
        self.prompts_for = prompts_for
        self.results: dict[Path, dict[str, Any]] = {}
        self.prompts: dict[str, GoldPrompt] = {}

    def rows(self, source: Source) -> dict[str, dict[str, Any]]:
        """``source``'s rows by question id."""
        result = self._load(source.path)
        out = {}
        for row in result["rows"]:
            by_mode = row["models"].get(source.model)
            if by_mode is None:
                raise ValueError(f"{source.path} has no model {source.model!r} (it has {sorted(row['models'])})")
            if source.mode not in by_mode:
                raise ValueError(
                    f"{source.path} has no mode {source.mode!r} for {source.model} (it has {sorted(by_mode)})"
                )
            out[row["rid"]] = by_mode[source.mode]
        return out

    def _load(self, path: Path) -> dict[str, Any]:
        if path not in self.results:
            try:
                result = json.loads(path.read_text())
                seeds, questions = result["meta"]["seeds"], int(result["meta"]["questions"])
                rows = result["rows"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} is not a questions-workload result of bench.doc_reuse_accuracy: {e}") from e
            if not seeds or questions % len(seeds):
                raise ValueError(f"{path}: {questions} questions over seeds {seeds}")
            for seed in seeds:
                for p in self.prompts_for(seed, questions // len(seeds)):
                    self.prompts.setdefault(p.rid, p)
            unknown = [
                r["rid"]
                for r in rows
                if r["rid"] not in self.prompts
                or r.get("question", self.prompts[r["rid"]].question.question)
                != self.prompts[r["rid"]].question.question
            ]
            if unknown:
                raise ValueError(
                    f"{path}: questions {unknown[:3]} are not what its seeds ask now (was the "
                    "question set changed since?)"
                )
            self.results[path] = result
        return self.results[path]


def _seed_and_index(rid: str) -> tuple[int, int]:
    """``kind-seed-index`` -> (seed, index): the runs' question order."""
    seed, index = rid.rsplit("-", 2)[1:]
    return int(seed), int(index)


def _gather(runs: Runs, sources: Sequence[Source], what: str) -> dict[str, dict[str, Any]]:
    """Rows by question id over ``sources``; a question in two of them is an error."""
    out: dict[str, dict[str, Any]] = {}
    where: dict[str, Path] = {}
    for source in sources:
        for rid, row in runs.rows(source).items():
            if rid in out:
                raise ValueError(f"{what}: question {rid} is in two runs ({where[rid]} and {source.path})")
            out[rid], where[rid] = row, source.path
    return out


def pool(
    base: Sequence[Source], series: Sequence[Series], prompts_for: PromptsFor, seed: int = 0
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, int], dict[str, int]]:
    """The tables' summaries ({model label: {mode label: summary}}), the questions each
    series pooled and those it left out for want of a base reference (by ``model/mode``)."""
    runs = Runs(prompts_for)
    base_full = _gather(runs, base, "--base")
    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    left_out: dict[str, int] = {}
    for s in series:
        label = f"{s.model_label}/{s.mode_label}"
        if label in counts:
            raise ValueError(f"two series are labelled {label}")
        if len({src.mode == FULL for src in s.sources}) > 1:
            raise ValueError(f"{label} mixes full prefill with other modes")
        mine = _gather(runs, s.sources, label)
        own = _gather(runs, [Source(src.path, src.model) for src in s.sources], f"{s.model_label} full prefill")
        rids = sorted((rid for rid in mine if rid in base_full), key=_seed_and_index)
        dropped = len(mine) - len(rids)
        if dropped:
            logger.warning("%s: %d questions have no base reference and are left out", label, dropped)
        if not rids:
            raise ValueError(f"{label}: no question in common with --base")
        prompts = [runs.prompts[r] for r in rids]
        rows, base_rows, own_rows = [mine[r] for r in rids], [base_full[r] for r in rids], [own[r] for r in rids]
        full = all(src.mode == FULL for src in s.sources)
        summaries.setdefault(s.model_label, {})[s.mode_label] = (
            summarize_full(rows, prompts, base_rows, seed)
            if full
            else summarize_mode(rows, prompts, base_rows, own_rows, seed)
        )
        counts[label] = len(rids)
        left_out[label] = dropped
    return summaries, counts, left_out


def targets(summaries: dict[str, dict[str, dict[str, Any]]], default_mode: str) -> list[str]:
    """Issue 28's targets, which need ``base/full prefill`` and ``tuned/full prefill`` series."""
    if any(FULL not in summaries.get(model, {}) for model in ("base", "tuned")):
        return [f"targets: need series labelled base/{FULL} and tuned/{FULL} (and tuned/<mode>)"]
    return target_lines(summaries, default_mode)


def _tokenizer_prompts(tokenizer_path: str) -> PromptsFor:
    from transformers import AutoTokenizer

    from pcr_tools.tune.questions import question_set

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda seed, count: gold_prompts(question_set("test", count, seed), tokenizer, seed)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reuse_pool",
        description=__doc__.split("\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--base",
        action="append",
        required=True,
        metavar="FILE:MODEL",
        help="a run's base-model full-prefill rows (repeatable)",
    )
    parser.add_argument(
        "--series",
        action="append",
        required=True,
        metavar="MODEL/MODE=FILE:MODEL:MODE[,...]",
        help="one row of the tables, pooled from the named runs (repeatable); "
        "MODEL/MODE 'tuned/<mode>' and 'base/<mode>' also get the targets checked",
    )
    parser.add_argument(
        "--default-mode",
        default=None,
        help="the mode label the targets check (default: the first series' mode that is not full prefill)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="rebuilds the questions' prompts (default: the base SmolLM2-135M-Instruct, built offline)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the report here (.md and .json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        base = [Source.parse(b, with_mode=False) for b in args.base]
        series = [Series.parse(s) for s in args.series]
    except ValueError as e:
        parser.error(str(e))
    if args.tokenizer is None:
        from pcr_tools.models.smollm2 import build_smollm2

        args.tokenizer = str(build_smollm2())
    try:
        summaries, counts, left_out = pool(base, series, _tokenizer_prompts(args.tokenizer))
    except ValueError as e:
        print(f"bench.reuse_pool: {e}", file=sys.stderr)
        return 2
    default_mode = args.default_mode or next((s.mode_label for s in series if s.mode_label != FULL), FULL)
    command = "python -m bench.reuse_pool " + shlex.join(list(argv if argv is not None else sys.argv[1:]))
    lines = [
        "# Document-reuse accuracy, pooled runs",
        "",
        f"`{command}`",
        "",
        "Pooled: "
        + ", ".join(
            f"{k} {v} questions" + (f" ({left_out[k]} without a base reference left out)" if left_out[k] else "")
            for k, v in counts.items()
        ),
        "",
        markdown_tables(summaries),
        "",
        "Targets:",
        "",
        *[f"    {line}" for line in targets(summaries, default_mode)],
        "",
    ]
    report = "\n".join(lines)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pooled.md").write_text(report)
        (args.out / "pooled.json").write_text(
            json.dumps({"command": command, "questions": counts, "summary": summaries}, indent=1, default=str)
        )
    return 0
