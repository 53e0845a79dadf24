"""How many bytes of clusters a look-ahead copies, and which clusters.

TeleRAG's rule: the budget is what the link moves while the pre-retrieval generation runs,
``b = B_link x t_pre``, so the copies land before the search that needs them. Both are
measured here: ``B_link`` from the fast tier's own copies (until one has been measured, a
startup read of the table, or a static override), ``t_pre`` as a moving average of each
pipeline stage's generation time (seeded by a default until the stage has run once).
A static per-stage byte budget overrides both, like TeleRAG's offline-tuned tables.

The fill walks each query's ranked clusters by rank, round-robin across the queries of a
group (rank i of every query before rank i + 1), as TeleRAG's ``prefetch_batch`` does:
clusters already resident cost nothing, one that does not fit is skipped and smaller
later ones may still go in, and the budget is never exceeded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_STAGE_S = 1.0  # a stage's generation time before it has been measured once
EWMA_WEIGHT = 0.3  # of the newest sample


def fill_budget(
    ranked: Sequence[Sequence[int]], cost: Callable[[int], int], budget_bytes: int, resident: Callable[[int], bool]
) -> list[int]:
    """The clusters to copy, in copy order (see the module docstring)."""
    chosen: list[int] = []
    seen: set[int] = set()
    left = int(budget_bytes)
    depth = max((len(r) for r in ranked), default=0)
    for rank in range(depth):
        for clusters in ranked:
            if rank >= len(clusters):
                continue
            cluster = int(clusters[rank])
            if cluster < 0 or cluster in seen:
                continue
            seen.add(cluster)
            if resident(cluster):
                continue
            size = cost(cluster)
            if size <= left:
                chosen.append(cluster)
                left -= size
    return chosen


@dataclass
class BudgetModel:
    """``bytes(stage) = bandwidth x t_pre(stage)``, each measured, each overridable."""

    bandwidth_bytes_s: Optional[float] = None  # static override of the measured link
    stage_bytes: dict[str, int] = field(default_factory=dict)  # static per-stage budgets
    default_stage_s: float = DEFAULT_STAGE_S
    _stage_s: dict[str, float] = field(default_factory=dict)
    _measured_bandwidth: Optional[float] = None

    def budget_bytes(self, stage: str) -> int:
        if stage in self.stage_bytes:
            return int(self.stage_bytes[stage])
        bandwidth = self.bandwidth()
        if bandwidth is None:
            return 0
        return int(bandwidth * self.stage_seconds(stage))

    def bandwidth(self) -> Optional[float]:
        return self.bandwidth_bytes_s if self.bandwidth_bytes_s is not None else self._measured_bandwidth

    def stage_seconds(self, stage: str) -> float:
        return self._stage_s.get(stage, self.default_stage_s)

    def observe_stage(self, stage: str, seconds: float) -> None:
        """A pre-retrieval generation of ``stage`` took ``seconds``."""
        if seconds <= 0:
            return
        old = self._stage_s.get(stage)
        self._stage_s[stage] = seconds if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * seconds

    def observe_bandwidth(self, bytes_s: Optional[float]) -> None:
        if bytes_s is not None and bytes_s > 0:
            self._measured_bandwidth = bytes_s


def measure_read_bandwidth(codes: np.ndarray, sample_bytes: int = 64 << 20) -> float:
    """Bytes per second copying the table's first ``sample_bytes`` (as the tier would):
    from a memory-mapped table, what the disk (or the page cache) delivers."""
    rows = max(1, min(len(codes), sample_bytes // max(1, codes.shape[1] * 4)))
    out = np.empty((rows, codes.shape[1]), np.float32)
    start = time.perf_counter()
    out[:] = codes[:rows]
    seconds = max(time.perf_counter() - start, 1e-9)
    return rows * codes.shape[1] * 4 / seconds
