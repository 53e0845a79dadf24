"""Load or recompute: whether reading chunks from SSD beats prefilling their tokens again.

Loading is not always faster. Reading a chunk costs its bytes over the disk's bandwidth;
recomputing it costs its tokens over the prefill speed. The I/O process runs several
reads at once and times each as its share of the disk's busy time (``io.readers``), so
a read's time is what a chunk costs at the parallelism reached: a disk with high latency
but room for parallel reads can still beat recomputing. KV bytes per token grow with
layers x KV heads x head size while prefill speed is set by the accelerator, so a slow
disk (network storage, a busy SSD) behind a fast GPU can make recomputation the faster
path; on this project's CPU test machine the disk wins by two orders of magnitude.

The remote tier (``--pcr-remote``) is a third rate: a chunk only the remote tier holds
costs a network round trip and its bytes over the network, which can lose to
recomputation where the local SSD would win (or the other way round), so remote reads
are timed apart from local ones and decided on apart (:meth:`prefers_remote_load`).

The rates are measured while serving (exponential moving averages). The prefill speed is
first set by a prefill of at least ``FIRST_TIMED_TOKENS`` tokens, and from then on every
prefill counts: the prefills before it are a server's warm-up request (7 tokens, timing
mostly the first forward's one-off costs: 300-450 tokens per second on CPU, after which
the first 700-token request waited seconds for reads it could have recomputed in a
fraction of that). Short extends keep counting: they include the forward's fixed cost,
which makes recomputing look dearer than its marginal cost, so the model leans towards
loading. Until both rates are known it says load; while it says recompute, one in
``probe_every`` decisions loads anyway, so a disk that got faster is noticed. With
tensor parallelism each rank measures its own rates; the scheduler agrees the verdict
across ranks (the minimum) before it changes any request's prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# How long a request may wait for SSD reads when no prefill has been timed yet (just
# after a start or a restart): about what a small GPU prefill of a few chunks costs.
DEFAULT_WAIT_S = 0.25
MIN_WAIT_S = 0.005
# The prefill that first sets the prefill speed has at least this many tokens (see the
# module's docstring).
FIRST_TIMED_TOKENS = 128


@dataclass
class LoadOrRecompute:
    alpha: float = 0.2  # weight of a new sample in the moving averages
    probe_every: int = 16
    read_seconds_per_chunk: Optional[float] = None  # local SSD reads
    prefill_tokens_per_second: Optional[float] = None
    decisions_to_recompute: int = 0
    remote_read_seconds_per_chunk: Optional[float] = None  # remote-tier reads (their call alone)
    remote_decisions_to_recompute: int = 0

    def observe_read(self, seconds: float, remote: bool = False) -> None:
        if seconds <= 0:
            return
        if remote:
            self.remote_read_seconds_per_chunk = self._ewma(self.remote_read_seconds_per_chunk, seconds)
        else:
            self.read_seconds_per_chunk = self._ewma(self.read_seconds_per_chunk, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        if self.prefill_tokens_per_second is not None or tokens >= FIRST_TIMED_TOKENS:
            self.prefill_tokens_per_second = self._ewma(self.prefill_tokens_per_second, tokens / seconds)

    def prefers_load(self, chunk_tokens: int) -> bool:
        """This rank's measured verdict (no probing): is reading a chunk faster?"""
        return self._reading_wins(self.read_seconds_per_chunk, chunk_tokens)

    def decide(self, prefers_load: bool) -> bool:
        """A decision from a verdict (possibly agreed across ranks), with probing."""
        if prefers_load:
            return True
        self.decisions_to_recompute += 1
        return self.decisions_to_recompute % self.probe_every == 0

    def prefers_remote_load(self, chunk_tokens: int) -> bool:
        """Is reading a chunk from the remote tier faster than recomputing it? (The remote
        tier runs without TP, so this verdict needs no agreement across ranks.)"""
        return self._reading_wins(self.remote_read_seconds_per_chunk, chunk_tokens)

    def decide_remote(self, chunk_tokens: int) -> bool:
        """:meth:`decide` for the remote tier: one in ``probe_every`` of its recompute
        verdicts loads anyway, so a tier that got faster is noticed."""
        if self.prefers_remote_load(chunk_tokens):
            return True
        self.remote_decisions_to_recompute += 1
        return self.remote_decisions_to_recompute % self.probe_every == 0

    def recompute_seconds(self, tokens: int) -> float:
        """About what prefilling ``tokens`` costs: how long waiting for their KV is worth."""
        if self.prefill_tokens_per_second is None:
            return DEFAULT_WAIT_S
        return max(tokens / self.prefill_tokens_per_second, MIN_WAIT_S)

    def _reading_wins(self, read_seconds: Optional[float], chunk_tokens: int) -> bool:
        """Reading a chunk at ``read_seconds`` beats recomputing it (or a rate is unknown)."""
        if read_seconds is None or self.prefill_tokens_per_second is None:
            return True
        return read_seconds <= chunk_tokens / self.prefill_tokens_per_second

    def _ewma(self, old: Optional[float], sample: float) -> float:
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample
