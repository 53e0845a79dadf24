"""Answer scores of every accuracy measurement (the benchmarks, calibration, the demo):
SQuAD-style token F1, ROUGE-L and exact match (the answer contains the gold value), all over
SQuAD's normalization, and a question's gold scores by its kind."""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import Optional

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> list[str]:
    """SQuAD's answer normalization, as tokens: lowercase, punctuation removed (ASCII, as
    SQuAD, and any Unicode punctuation), the articles a/an/the removed, split on
    whitespace."""
    text = text.lower()
    text = "".join(" " if ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P") else ch for ch in text)
    return _ARTICLES.sub(" ", text).split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style bag-of-tokens F1 of ``prediction`` against ``reference``. Two answers
    that normalize to nothing agree (1.0); one empty answer against a non-empty one
    scores 0.0."""
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if not pred and not ref:
        return 1.0
    if not pred or not ref:
        return 0.0
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (beta 1) over normalized tokens: the longest common subsequence."""
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if not pred or not ref:
        return float(pred == ref)
    previous = [0] * (len(ref) + 1)
    for p in pred:
        current = [0]
        for j, r in enumerate(ref):
            current.append(previous[j] + 1 if p == r else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def contains_answer(prediction: str, gold: str) -> bool:
    """Exact match for a short planted value: its normalized tokens appear, in order and
    adjacent, in the normalized answer."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if not ref:
        return False
    return any(pred[i : i + len(ref)] == ref for i in range(len(pred) - len(ref) + 1))


def gold_score(scores: dict[str, Optional[float]]) -> float:
    """One number per question from :func:`gold_scores`: lead F1 for ``lead`` questions,
    exact match for the others."""
    value = scores["lead_f1"] if scores.get("lead_f1") is not None else scores.get("em")
    return float(value or 0.0)


def gold_scores(kind: str, answer: str, gold: str) -> dict[str, Optional[float]]:
    """``lead``: token F1 and ROUGE-L against the lead sentence; ``needle`` and ``two_hop``:
    exact match (the answer contains the planted value)."""
    if kind == "lead":
        return {"lead_f1": token_f1(answer, gold), "lead_rouge_l": rouge_l(answer, gold), "em": None}
    return {"lead_f1": None, "lead_rouge_l": None, "em": float(contains_answer(answer, gold))}
