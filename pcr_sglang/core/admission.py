"""The admission verdict: whether a waiting request goes now, waits for its reads, or recomputes.

A request's way to admission is one explicit :class:`AdmissionPhase`, kept by request id in
the adapter (``sglang_adapter/requests.py``), never a set of flags: a remote-tier probe may
hold it first (``PROBING`` until ``PROBED``), then reads of its SSD chunks may hold it once
(``HOLDING``, until they land or the TP ranks agree it waited long enough, ``EXPIRED``), and
after that it is never held again (``WAITED``: what has not landed is recomputed, so a
request cannot starve on reads).

The functions here are pure: they read the phase and what the cache state says, and return
a :class:`Decision` (the verdict and the phase from here); the adapter's
:class:`~pcr_sglang.sglang_adapter.admission.Admission` gathers those facts, orders the reads
the verdict asks for, and stores the phase. The same inputs give the same verdict on every
TP rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

__all__ = ["AdmissionPhase", "Decision", "Timeliness", "Verdict", "after_reads", "at_gate", "read_or_recompute"]


class AdmissionPhase(enum.Enum):
    NEW = "new"  # nothing asked yet: no probe sent, never held
    PROBING = "probing"  # its remote-tier probe is out (held while it is, up to its timeout)
    PROBED = "probed"  # the probe was answered, timed out, or had nothing to ask
    HOLDING = "holding"  # held while its SSD chunks are read into host memory
    EXPIRED = "expired"  # agreed across ranks: it waited long enough, admitted at its next pass
    WAITED = "waited"  # it was held once: never again

    @property
    def held(self) -> bool:
        """Waiting for reads (its chain's reads stay wanted; they are abandoned if it leaves)."""
        return self in (AdmissionPhase.HOLDING, AdmissionPhase.EXPIRED)


class Verdict(enum.Enum):
    ADMIT = "admit"  # now, with what is on the device and in host memory
    HOLD = "hold"  # not this pass
    CONSIDER = "consider"  # match its chains and decide on its reads (read_or_recompute)
    RECOMPUTE = "recompute"  # admit now; the cost model left its SSD chunks to recomputation
    READ = "read"  # order its SSD reads, then hold it while they land (after_reads)


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    phase: AdmissionPhase  # the request's phase from here


@dataclass(frozen=True)
class Timeliness:
    """How timely the SSD chunks a request needed were when it was first considered."""

    in_time: int  # read from SSD before it was first considered
    late: int  # being read then
    on_demand: int  # only on SSD then, not being read


def at_gate(phase: AdmissionPhase, *, tier_on: bool, still_reading: Callable[[], bool]) -> Decision:
    """Before any match: a held request goes once its reads have landed (``still_reading``,
    asked only while it is held) or its wait expired, and is never held again; without an
    SSD tier (or with its I/O stopped) every request goes."""
    if not tier_on:
        return Decision(Verdict.ADMIT, phase)
    if phase.held:
        if phase is AdmissionPhase.EXPIRED or not still_reading():
            return Decision(Verdict.ADMIT, AdmissionPhase.WAITED)
        return Decision(Verdict.HOLD, phase)
    if phase is AdmissionPhase.WAITED:
        return Decision(Verdict.ADMIT, phase)  # one wait per request: what has not landed is recomputed
    return Decision(Verdict.CONSIDER, phase)


def read_or_recompute(*, ssd_chunks: int, io_healthy: bool, choose_load: Callable[[], bool]) -> Verdict:
    """Its chains matched with ``ssd_chunks`` chunks only on the SSD level: nothing to read
    (or no healthy I/O) admits it; otherwise the cost model (``choose_load``, asked only
    then: it counts its decisions) reads them or leaves them to recomputation."""
    if not ssd_chunks or not io_healthy:
        return Verdict.ADMIT
    return Verdict.READ if choose_load() else Verdict.RECOMPUTE


def after_reads(phase: AdmissionPhase, *, reading: bool) -> Decision:
    """Its reads were ordered: held while any is in flight (its one wait), else admitted
    (nothing could be ordered, no host slot: recompute), its phase unchanged."""
    if reading:
        return Decision(Verdict.HOLD, AdmissionPhase.HOLDING)
    return Decision(Verdict.ADMIT, phase)
