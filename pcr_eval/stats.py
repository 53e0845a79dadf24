"""Bootstrap intervals over questions: one question more or less moves a kind's score by
points at the sizes these benchmarks afford, so every mean is reported with its 95%
interval (seeded, so a rerun of the same rows gives the same interval)."""

from __future__ import annotations

import math
import random
import statistics
from typing import Optional, Sequence

BOOTSTRAP_RESAMPLES = 1000


def mean_ci(values: Sequence[float], seed: int = 0) -> dict[str, Optional[float]]:
    """Mean and a 95% percentile-bootstrap interval over the values (questions)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"mean": None, "low": None, "high": None, "n": 0}
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_RESAMPLES))
    return {
        "mean": statistics.fmean(values),
        "low": means[int(0.025 * len(means))],
        "high": means[int(0.975 * len(means)) - 1],
        "n": len(values),
    }


def ratio_ci(
    numerator: Sequence[Optional[float]], denominator: Sequence[Optional[float]], seed: int = 0
) -> dict[str, Optional[float]]:
    """mean(numerator) / mean(denominator) over the questions both have, with a paired
    95% bootstrap interval (the field's "% of full prefill")."""
    pairs = [(a, b) for a, b in zip(numerator, denominator) if a is not None and b is not None]
    if not pairs or not sum(b for _, b in pairs):
        return {"mean": None, "low": None, "high": None, "n": len(pairs)}
    rng = random.Random(seed)
    ratios = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        sample = rng.choices(pairs, k=len(pairs))
        den = sum(b for _, b in sample)
        if den:
            ratios.append(sum(a for a, _ in sample) / den)
    ratios.sort()
    return {
        "mean": sum(a for a, _ in pairs) / sum(b for _, b in pairs),
        "low": ratios[int(0.025 * len(ratios))],
        "high": ratios[int(0.975 * len(ratios)) - 1],
        "n": len(pairs),
    }
