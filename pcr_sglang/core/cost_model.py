"""Load or recompute: whether reading chunks from SSD beats prefilling their tokens again.

Loading is not always faster. Reading a chunk costs its bytes over the disk's bandwidth;
recomputing it costs its tokens over the prefill speed. KV bytes per token grow with
layers x KV heads x head size while prefill speed is set by the accelerator, so a slow
disk (network storage, a busy SSD) behind a fast GPU can make recomputation the faster
path; on this project's CPU test machine the disk wins by two orders of magnitude.

Both rates are measured while serving (exponential moving averages). Prefills of fewer
than ``MIN_TIMED_TOKENS`` tokens are not counted: they time the forward's fixed cost, not
its per-token one (a server's warm-up request of a few tokens measured tens of tokens per
second, and the next 700-token request then waited seconds for reads it could have
recomputed in a fraction of that). Until both rates are known the model says load; while it says recompute, one in ``probe_every`` decisions
loads anyway, so a disk that got faster is noticed. With tensor parallelism each rank
measures its own rates; the scheduler agrees the verdict across ranks (the minimum)
before it changes any request's prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# How long a request may wait for SSD reads when no prefill has been timed yet (just
# after a start or a restart): about what a small GPU prefill of a few chunks costs.
DEFAULT_WAIT_S = 0.25
MIN_WAIT_S = 0.005
# Smaller prefills are not timed into the prefill speed (see the module's docstring).
MIN_TIMED_TOKENS = 128


@dataclass
class LoadOrRecompute:
    alpha: float = 0.2  # weight of a new sample in the moving averages
    probe_every: int = 16
    read_seconds_per_chunk: Optional[float] = None
    prefill_tokens_per_second: Optional[float] = None
    decisions_to_recompute: int = 0

    def observe_read(self, seconds: float) -> None:
        self.read_seconds_per_chunk = self._ewma(self.read_seconds_per_chunk, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_TIMED_TOKENS and seconds > 0:
            self.prefill_tokens_per_second = self._ewma(self.prefill_tokens_per_second, tokens / seconds)

    def prefers_load(self, chunk_tokens: int) -> bool:
        """This rank's measured verdict (no probing): is reading a chunk faster?"""
        if self.read_seconds_per_chunk is None or self.prefill_tokens_per_second is None:
            return True
        return self.read_seconds_per_chunk <= chunk_tokens / self.prefill_tokens_per_second

    def decide(self, prefers_load: bool) -> bool:
        """A decision from a verdict (possibly agreed across ranks), with probing."""
        if prefers_load:
            return True
        self.decisions_to_recompute += 1
        return self.decisions_to_recompute % self.probe_every == 0

    def recompute_seconds(self, tokens: int) -> float:
        """About what prefilling ``tokens`` costs: how long waiting for their KV is worth."""
        if self.prefill_tokens_per_second is None:
            return DEFAULT_WAIT_S
        return max(tokens / self.prefill_tokens_per_second, MIN_WAIT_S)

    def _ewma(self, old: Optional[float], sample: float) -> float:
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample
