"""Each scheduler step's agreement across TP ranks, and applying what was agreed.

The ranks agree (:func:`pcr_sglang.core.agreement.agree`, a pure function over each rank's
:class:`~pcr_sglang.core.agreement.LocalView` and a MIN all-reduce) on which I/O orders
finished and how, on I/O health, write-back and the load-or-recompute verdict, on which
requests waiting for reads have waited long enough, and on the clock KV hints live by;
then every rank applies the same facts to its cache state. On one rank the agreement is
this rank's own view.

A collaborator of the scheduler loop: it writes what was agreed into the step's
:class:`Effects` through :class:`CacheState` and never calls back into the loop.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from pcr_sglang.core.admission import AdmissionPhase
from pcr_sglang.core.agreement import LocalView, agree
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.residency import CacheState
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.sglang_adapter.executor import EffectsExecutor
from pcr_sglang.sglang_adapter.hints import KvHints
from pcr_sglang.sglang_adapter.requests import RequestRegistry
from pcr_sglang.sglang_adapter.tp_group import TpGroup

logger = logging.getLogger(__name__)


class StepAgreement:
    def __init__(
        self,
        state: CacheState,
        executor: EffectsExecutor,
        io: Optional[IOSupervisor],
        tp: Optional[TpGroup],
        requests: RequestRegistry,
        hints: KvHints,
    ):
        self.state = state
        self.executor = executor
        self.io = io
        self.tp = tp
        self.requests = requests
        self.hints = hints
        self.broken: Optional[str] = None  # the ranks' views were inconsistent: the SSD tier stopped
        self.rounds = 0
        self.digest_mismatches = 0
        self._writes_were_enabled = True

    def run(self, queue_nonempty: bool, admission_digest: int, effects: Effects) -> None:
        finished = self.executor.finished
        if self.io is not None:
            for seq, outcome, seconds in self.io.poll():
                finished[seq] = (outcome, seconds)
            self.state.note_io_process(self.io.failures, self.io.restarts)
        holds = self.requests.holds()
        outstanding = self.state.outstanding()
        if self.tp is not None and not (outstanding or holds or queue_nonempty or len(self.hints.book)):
            return  # nothing to agree on (and the same on every rank)
        if self.broken is not None:
            self.hints.expire_unagreed()
            return
        now = time.monotonic()
        chunk = self.state.chunk_size
        view = LocalView(
            healthy=self.io is not None and self.io.healthy,
            prefers_load=self.state.cost_model.prefers_load(chunk),
            outstanding=outstanding,
            finished=finished,
            still_waiting=[now < entry.deadline for entry in holds],
            admission_digest=admission_digest,
            hint_clock_ms=self.hints.clock_ms(),
        )
        agreed = agree(view, self.tp.reduce_min if self.tp is not None else None)
        self.rounds += 1
        if not agreed.digests_match:
            self.digest_mismatches += 1
            logger.error(
                "PCR: the TP ranks admitted requests with different prefix lengths (a bug: please "
                "report it); outputs may be wrong"
            )
        if not agreed.consistent:
            self.broken = agreed.error
            self.state.stop_io()
            for entry in holds:  # nothing the SSD tier was reading will be applied any more
                entry.phase, entry.held_chain = AdmissionPhase.WAITED, []
            logger.error("PCR: %s; the SSD tier stops on every rank (a bug: please report it)", agreed.error)
            return
        self.state.apply_agreement(agreed.healthy, agreed.prefers_load)
        self.hints.agreed(agreed.hint_clock_ms)
        for seq, _, _ in agreed.outcomes:
            del finished[seq]
        self.state.apply_outcomes(agreed.outcomes, effects)
        if self._writes_were_enabled and not self.state.writes_enabled:
            logger.warning(
                "PCR SSD tier: a write failed (on this or another TP rank); SSD write-back is "
                "stopped, serving continues from device and host memory (chunks already on SSD "
                "stay readable)"
            )
        self._writes_were_enabled = self.state.writes_enabled
        for entry, still in zip(holds, agreed.still_waiting):
            if not still:
                entry.phase = AdmissionPhase.EXPIRED
