"""How long the scheduler's steps take: a cumulative log-scale histogram per measure.

Cumulative counts (like a Prometheus histogram) let a client take two ``/server_info``
snapshots and get the distribution of the steps in between: the benchmark that stops the
I/O process compares the step times before and during the stop that way. Buckets grow
by 2**(1/4) (19% wide) from 10 microseconds to about two minutes.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Optional, Sequence

_FIRST_S = 1e-5
_GROWTH = 2**0.25
_BUCKETS = 96
UPPER_EDGES_S = [_FIRST_S * _GROWTH**i for i in range(_BUCKETS)]


class StepHistogram:
    def __init__(self) -> None:
        self.counts = [0] * (_BUCKETS + 1)  # the last bucket: beyond the largest edge
        self.total = 0
        self.max_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(UPPER_EDGES_S, seconds)] += 1
        self.total += 1
        self.max_s = max(self.max_s, seconds)

    def report(self) -> dict[str, Any]:
        return {
            "p50_ms": percentile_ms(self.counts, 0.50),
            "p99_ms": percentile_ms(self.counts, 0.99),
            "max_ms": round(self.max_s * 1000, 3),
            "samples": self.total,
            "counts": list(self.counts),
        }


def percentile_ms(counts: Sequence[int], q: float) -> Optional[float]:
    """The ``q`` quantile of a histogram's counts (the upper edge of its bucket), in ms."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = max(math.ceil(q * total), 1)
    seen = 0
    for index, count in enumerate(counts):
        seen += count
        if seen >= rank:
            edge = UPPER_EDGES_S[index] if index < _BUCKETS else math.inf
            return round(edge * 1000, 3)
    return None


def between(before: Sequence[int], after: Sequence[int]) -> list[int]:
    """The counts of the steps between two snapshots."""
    return [a - b for a, b in zip(after, before)]
