"""Answer scores shared by the tuning's evaluation and the accuracy benchmark: SQuAD-style
token F1, ROUGE-L and exact match (the answer contains the gold value), all over SQuAD's
normalization."""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> list[str]:
    """SQuAD's answer normalization, as tokens: lowercase, punctuation removed (ASCII, as
    SQuAD, and any Unicode punctuation), the articles a/an/the removed, split on
    whitespace."""
    text = text.lower()
    text = "".join(" " if ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P") else ch
                   for ch in text)
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
