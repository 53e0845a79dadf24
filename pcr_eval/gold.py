"""Questions about re-placed documents as token prompts, with their gold answers: the
unit every questions measurement (the accuracy benchmark, its TTFT companion, pooling,
calibration) works on. Each prompt keeps its documents shuffled too (the noise floor, and
``reorder``'s warm-up order), by a seeded generator so a rerun asks the same."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from pcr_tools.tune.questions import Question


@dataclass
class GoldPrompt:
    """One question as token prompts: as asked, and with its documents shuffled."""

    index: int
    rid: str
    question: Question
    input_ids: list[int]
    doc_bounds: list[int]
    shuffled_ids: list[int]
    gold_ids: list[int]
    shuffled_bounds: list[int] = field(default_factory=list)  # the documents of shuffled_ids

    @property
    def kind(self) -> str:
        return self.question.kind

    @property
    def last_doc_end(self) -> int:
        return self.doc_bounds[-1]

    @property
    def doc_tokens(self) -> int:
        return sum(e - s for s, e in zip(self.doc_bounds[::2], self.doc_bounds[1::2]))


def gold_prompts(questions: Sequence[Question], tokenizer: Any, seed: int) -> list[GoldPrompt]:
    """``questions`` as token prompts, each with its documents shuffled by a generator of
    ``seed``'s (the same questions and seed give the same shuffles) and its id
    ``kind-seed-index``, by which pooled runs match questions."""
    rng = random.Random(f"shuffle:{seed}")
    out = []
    for i, q in enumerate(questions):
        prompt, shuffled = q.prompt(tokenizer), q.shuffled(rng).prompt(tokenizer)
        gold_ids = list(tokenizer.encode(q.gold, add_special_tokens=False))
        out.append(
            GoldPrompt(
                i,
                f"{q.kind}-{seed}-{i}",
                q,
                list(prompt.input_ids),
                list(prompt.doc_bounds),
                list(shuffled.input_ids),
                gold_ids,
                list(shuffled.doc_bounds),
            )
        )
    return out
