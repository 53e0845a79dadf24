"""TP agreement: every input that can differ between tensor-parallel ranks, agreed as the
minimum over the ranks before it changes any request's prefix length.

Each rank has its own I/O process, disk, clock and cost model, so which reads have
landed, which writes succeeded, whether the I/O process is alive and whether reading
beats recomputing are rank-local facts. Everything else the cache decides is computed
from the same inputs on every rank (the waiting queue, the batch, and the agreed facts),
so it is the same everywhere. SGLang's HiCache does the same with a MIN all-reduce of
finished operations; here the agreed facts are, once per scheduler step:

* a header: how many orders are outstanding and how many requests are waiting for
  reads (both must be equal on every rank: a difference is a bug, reported, after which
  the SSD tier stops), whether the I/O process is healthy, whether this rank's cost
  model prefers loading to recomputing;
* the outcome of every outstanding order, in sequence order (an order the cache state
  numbered the same way on every rank): ``PENDING`` < ``BAD`` < ``CANCELLED`` < ``OK``,
  so an order is applied once it finished everywhere, as the worst of its outcomes (a
  write that failed on one rank failed everywhere, and write-back stops on all);
* for each request waiting for reads, whether every rank is still willing to wait
  (its deadline not passed);
* a digest of the prefix lengths this rank admitted requests with: a canary, not an
  input. Equal everywhere unless a decision escaped agreement (a bug); a mismatch is
  counted and logged;
* the clock KV hints live by (``hint_clock_ms``): each rank's monotonic clock, agreed as
  the earliest, so a hint expires in the same step on every rank and the hinted reads
  every rank orders stay the same (each rank's own clock could expire a hint between
  two ranks' steps, after which their orders would differ).

Pure logic: the collective itself (``reduce_min``) is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from pcr_sglang.core.orders import IoOutcome

ReduceMin = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class LocalView:
    """What this rank knows at the start of a scheduler step."""

    healthy: bool
    prefers_load: bool
    outstanding: Sequence[int]  # ascending sequence numbers of orders not yet applied
    finished: dict[int, tuple[IoOutcome, float]]  # of those, what this rank's process returned
    still_waiting: Sequence[bool] = ()  # per request waiting for reads, in a rank-independent order
    admission_digest: int = 0  # of (request, prefix length) admitted so far, < 2**52
    hint_clock_ms: int = 0  # this rank's clock for KV hints


@dataclass
class Agreed:
    healthy: bool
    prefers_load: bool
    outcomes: list[tuple[int, IoOutcome, float]] = field(default_factory=list)
    still_waiting: list[bool] = field(default_factory=list)
    consistent: bool = True
    error: Optional[str] = None
    digests_match: bool = True
    hint_clock_ms: int = 0  # the earliest rank's


def agree(view: LocalView, reduce_min: Optional[ReduceMin]) -> Agreed:
    """The step's agreed facts; with ``reduce_min`` None (one rank) this rank's own."""
    if reduce_min is None:
        outcomes = [(seq, *view.finished[seq]) for seq in view.outstanding if seq in view.finished]
        return Agreed(
            view.healthy, view.prefers_load, outcomes, list(view.still_waiting), hint_clock_ms=view.hint_clock_ms
        )
    orders, waiting = len(view.outstanding), len(view.still_waiting)
    digest = view.admission_digest
    header = reduce_min(
        [
            orders,
            -orders,
            waiting,
            -waiting,
            int(view.healthy),
            int(view.prefers_load),
            digest,
            -digest,
            view.hint_clock_ms,
        ]
    )
    digests_match = header[6] == -header[7]
    if header[0] != -header[1] or header[2] != -header[3] or header[0] != orders or header[2] != waiting:
        return Agreed(
            False,
            False,
            consistent=False,
            digests_match=digests_match,
            error=(
                f"TP ranks disagree on the SSD tier's outstanding orders ({header[0]}..{-header[1]}, "
                f"this rank {orders}) or waiting requests ({header[2]}..{-header[3]}, this rank {waiting})"
            ),
        )
    # mutant: hint-clock-is-each-ranks-own
    agreed = Agreed(bool(header[4]), bool(header[5]), digests_match=digests_match, hint_clock_ms=header[8])
    if not orders and not waiting:
        return agreed
    body = [int(view.finished[seq][0]) if seq in view.finished else int(IoOutcome.PENDING) for seq in view.outstanding]
    body += [int(w) for w in view.still_waiting]
    body = reduce_min(body)
    for seq, code in zip(view.outstanding, body[:orders]):
        if code != IoOutcome.PENDING:
            seconds = view.finished[seq][1] if seq in view.finished else 0.0
            agreed.outcomes.append((seq, IoOutcome(code), seconds))
    agreed.still_waiting = [bool(w) for w in body[orders:]]
    return agreed
