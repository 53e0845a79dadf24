"""The answer scores every accuracy measurement uses (pcr_eval/scores.py): ROUGE-L and the
exact match of a planted value, over SQuAD's normalization (token F1 and the normalization
itself are checked beside the accuracy benchmark's metrics)."""

from __future__ import annotations

import pytest

from pcr_eval import scores


def test_scores():
    assert scores.rouge_l("the cat sat on the mat", "cat sat mat") == pytest.approx(6 / 7)  # LCS 3 of 4 and 3
    assert scores.rouge_l("The cat, sat mat.", "cat sat mat") == pytest.approx(1.0)
    assert scores.rouge_l("mat sat cat", "cat sat mat") == pytest.approx(1 / 3)
    assert scores.contains_answer("The number is 48213.", "48213")
    assert not scores.contains_answer("The number is 482130.", "48213")
    assert scores.contains_answer("It was Priya Abernathy, I think", "priya abernathy")
    assert not scores.contains_answer("Abernathy Priya", "Priya Abernathy")
