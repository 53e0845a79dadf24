"""The scheduler's side of PCR: the loop that runs in SGLang's scheduler around the cache interface.

Once per scheduler step (``get_next_batch_to_run``), before any request is matched:

1. take the worker side's prefill timings and agree across TP ranks on what the I/O
   process finished (:class:`~pcr_sglang.sglang_adapter.step_agreement.StepAgreement`);
2. enter what remote-tier probes found (:class:`RemoteProbes`);
3. send I/O orders that waited for their host slot's copies to complete;
4. refresh the look-ahead protection for the first waiting requests, probe the remote
   tier for them, and plan prefetch reads for them and the live KV hints.

The loop owns no decision and no per-request fact: it hands keys
(:class:`~pcr_sglang.sglang_adapter.request_keys.RequestKeys`) to its collaborators:
:class:`~pcr_sglang.sglang_adapter.admission.Admission`, :class:`Offloads`,
:class:`RemoteProbes` and :class:`~pcr_sglang.sglang_adapter.hints.KvHints`; they
change residency only through :class:`CacheState` and return, or run through the one
:class:`~pcr_sglang.sglang_adapter.executor.EffectsExecutor`, the work it decided. None
of them calls back into the loop. Every per-request fact lives in one
:class:`~pcr_sglang.sglang_adapter.requests.RequestState` (document reuse keeps its plans
in its own wing). The scheduler never waits on a disk, a peer or a whole CUDA stream (but
for a ``blend`` admission, which reads its probe's scores back: docs/document-reuse.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from pcr_sglang.config import PCRConfig
from pcr_sglang.core.admission import AdmissionPhase
from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.hints import HintBook
from pcr_sglang.core.keys import ChainKeyer
from pcr_sglang.core.residency import CacheState
from pcr_sglang.flags import HINT_TO_DEVICE_FREE_SHARE
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.req import PcrReq
from pcr_sglang.reuse.disabled import NoDocReuse
from pcr_sglang.reuse.forward_plan import ForwardPlans
from pcr_sglang.reuse.rows import permute_extend_inputs
from pcr_sglang.reuse.seam import DocReuseSeam, DocReuseStatus
from pcr_sglang.sglang_adapter.admission import Admission, up_to_first_remote_only
from pcr_sglang.sglang_adapter.executor import EffectsExecutor
from pcr_sglang.sglang_adapter.hints import KvHints
from pcr_sglang.sglang_adapter.mask_admission import MaskAdmission
from pcr_sglang.sglang_adapter.offloads import Offloads
from pcr_sglang.sglang_adapter.remote_probes import NoRemoteProbes, RemoteProbes
from pcr_sglang.sglang_adapter.request_keys import RequestKeys
from pcr_sglang.sglang_adapter.requests import RequestRegistry
from pcr_sglang.sglang_adapter.step_agreement import StepAgreement
from pcr_sglang.sglang_adapter.step_timing import StepHistogram
from pcr_sglang.sglang_adapter.tp_group import TpGroup
from pcr_sglang.sglang_adapter.worker_side import WorkerSide
from pcr_sglang.tiers.remote_store import RemoteConfig

if TYPE_CHECKING:
    from pcr_sglang.reuse.placement import DocReuse


class SchedulerSide:
    def __init__(
        self,
        state: CacheState,
        config: PCRConfig,
        chain_digest: bytes,
        allocator: Any,
        *,
        worker: Optional[WorkerSide] = None,
        io: Optional[IOSupervisor] = None,
        tp: Optional[TpGroup] = None,
        remote: Optional[RemoteConfig] = None,
    ):
        self.state = state
        self.config = config
        self.chunk = config.chunk_size
        self.allocator = allocator
        self.worker = worker
        self.engine = worker.engine if worker is not None else None
        self.io = io
        self.tp = tp
        self.keyer = ChainKeyer(chain_digest, config.chunk_size)  # the one key derivation of this server
        self.keys = RequestKeys(self.keyer, state)
        self.requests = RequestRegistry()
        # Keys' generation: one more at every rekey (a weight update). A request admitted
        # under an older one computed KV with the old weights: its checkpoints insert nothing.
        self.generation = 0
        self._admitted_in: dict[str, int] = {}  # rid -> the generation it was admitted under
        self.executor = EffectsExecutor(state, allocator, self.engine, io)
        # Document reuse's permuted rows, from prepare time to the forward's attention,
        # found by the attention backends through the KV pool they hold.
        self.forward_plans = ForwardPlans()
        if hasattr(allocator, "get_kvcache"):
            self.forward_plans.attach(allocator.get_kvcache())
        self.offloads = Offloads(state, self.engine, self.requests, config.chunk_size)
        # The remote tier (--pcr-remote, parsed by the factory): probes in flight, by probe seq.
        self.probes: RemoteProbes | NoRemoteProbes = (
            RemoteProbes(state, io, self.requests, remote.probe_timeout_ms / 1000)
            if remote is not None and io is not None
            else NoRemoteProbes()
        )
        self.hints = HintBook(config.hint_limits())
        # --pcr-hint-to-device: 'auto' is on where the KV pool is on a GPU.
        on_gpu = str(getattr(allocator, "device", "cpu")).startswith("cuda")
        promote = config.hint_to_device == "on" or (config.hint_to_device == "auto" and on_gpu)
        self.kv_hints = KvHints(
            state,
            self.hints,
            self.keys,
            self.executor,
            tp,
            promote=promote,
            free_floor_tokens=int(HINT_TO_DEVICE_FREE_SHARE * getattr(allocator, "size", 0)),
        )
        self.agreement = StepAgreement(state, self.executor, io, tp, self.requests, self.kv_hints)
        self.admission = Admission(
            state,
            self.executor,
            self.keys,
            self.requests,
            self.hints,
            self.probes,
            self.agreement,
            tensor_parallel=tp is not None,
        )
        # The position mask's budget over each batch SGLang's prefill adder forms (``add_one_req``).
        self.batch_masks = MaskAdmission()
        self._docs: DocReuseSeam = NoDocReuse()
        self.doc_status: Optional[DocReuseStatus] = None  # what is reported of document reuse, where it is on
        self.step_time = StepHistogram()  # PCR's own work per scheduler step
        self.iteration_time = StepHistogram()  # the scheduler loop's iterations while busy
        self._last_step_start: Optional[float] = None

    def use_probes(self, probes: RemoteProbes | NoRemoteProbes) -> None:
        """The remote tier's probes from now on (none under an in-memory update's namespace,
        :mod:`remote_follow`): the loop and its admission hold the same one, or admission
        would keep probing a tier the I/O process no longer has and hold every request
        until the probe times out."""
        self.probes = probes
        # mutant: admission-keeps-probing-after-an-in-memory-update
        self.admission.probes = probes

    @property
    def docs(self) -> DocReuseSeam:
        """Document reuse through its seam (:mod:`pcr_sglang.reuse.seam`): with
        ``--pcr-doc-reuse`` a :class:`~pcr_sglang.reuse.placement.DocReuse`, attached by the
        factory once the model is loaded, else its null collaborator
        (:class:`~pcr_sglang.reuse.disabled.NoDocReuse`). The collaborators that ask it
        hold its scheduler half."""
        return self._docs

    @docs.setter
    def docs(self, docs: Optional[DocReuse]) -> None:
        self.doc_status = docs
        seam: DocReuseSeam = docs if docs is not None else NoDocReuse()
        self._docs = self.keys.docs = self.admission.docs = self.kv_hints.docs = self.batch_masks.docs = seam
        self.batch_masks.stats = docs.stats if docs is not None else None

    # ------------------------------------------------------------------ per step
    def step(self, waiting_queue: Sequence[PcrReq], busy: bool = True) -> None:
        """Before each scheduling pass (every rank, every loop iteration). ``busy``: the
        scheduler has requests waiting or running (idle iterations may sleep, and are
        not counted in the iteration times)."""
        start = time.perf_counter()
        if self._last_step_start is not None:
            self.iteration_time.observe(start - self._last_step_start)
        self._last_step_start = start if busy else None
        if self.worker is not None:
            for tokens, seconds in self.worker.take_prefill_timings():
                self.state.cost_model.observe_prefill(tokens, seconds)
        effects = Effects()
        if self.io is not None or self.tp is not None:
            self.agreement.run(bool(waiting_queue), self.admission.digest, effects)
        if self.probes.enabled:
            assert self.io is not None
            for seconds in self.io.take_remote_read_seconds():
                self.state.cost_model.observe_read(seconds, remote=True)
            self.probes.collect(effects)
        self.executor.execute(effects)
        self.executor.send_deferred()
        self._update_window(waiting_queue)
        self.step_time.observe(time.perf_counter() - start)

    def _update_window(self, waiting_queue: Sequence[PcrReq]) -> None:
        lookahead, prefetch = self.config.lookahead_window, self.config.prefetch_window
        ssd = self.state.ssd_enabled
        window = list(waiting_queue[: max(lookahead, prefetch if ssd else 0)])
        self.keys.refresh_window(window)
        # Per request: its own prefix, then (document reuse) its documents' canonical chains.
        chains = [self.keys.needed_chains(req) for req in window]
        if lookahead:  # one entry per request: the window counts requests
            self.state.protect([[n for chain in per_req for n in chain] for per_req in chains[:lookahead]])
        if self.probes.enabled and self.state.io_healthy:
            for req in window[:prefetch]:  # probed ahead of admission, so the answer is in by then
                entry = self.requests.get(req.rid)
                if entry.phase is AdmissionPhase.NEW:
                    self.probes.send(req.rid, entry, self.keys.needed(req))
        if ssd:
            held = [n for s in self.requests.holds() for n in s.held_chain]
            effects = Effects()
            healthy = self.state.io_healthy
            wanted: list[Sequence[ChunkNode]] = [c for per_req in chains[:prefetch] for c in per_req] if healthy else []
            if self.probes.enabled and not self.state.cost_model.prefers_remote_load(self.chunk):
                wanted = [up_to_first_remote_only(c) for c in wanted]  # not worth reading ahead either
            hinted = self.kv_hints.live() if healthy else ()
            self.state.plan_prefetch(wanted, held, effects, len(waiting_queue), hinted)
            self.executor.execute(effects)
            if hinted and self.kv_hints.promote:
                self.kv_hints.promote_hinted()

    # ------------------------------------------------------------------ SGLang's calls that span collaborators
    # (a call that belongs to one collaborator goes to it: ``admission.admit_now`` and
    # ``load_back``, ``executor.evict``; /server_info reads ``agreement`` and ``probes``)
    def admitted(self, req: PcrReq) -> None:
        """``req``'s first extend was prepared: count its hits once (:meth:`Admission.admitted`)."""
        self.admission.admitted(req)
        self._admitted_in.setdefault(req.rid, self.generation)

    def computed_before_an_update(self, rid: str) -> bool:
        """Whether request ``rid`` was admitted before the weights last changed in place
        (``flush_cache: false`` lets it run on): its KV is partly the old weights', and
        must never be keyed under the new ones."""
        return self._admitted_in.get(rid, self.generation) != self.generation

    def rows_written(self, reqs: Sequence[PcrReq]) -> None:
        """``prepare_for_extend`` wrote these requests' rows: private document slots in
        them now belong to the row (and are freed with it)."""
        for req in reqs:
            self.docs.written_into_row(req)

    def plan_forward(self, batch: Any) -> None:
        """After ``prepare_for_extend``: the extend input of requests with permuted rows
        (recomputed or gap tokens) in row order, and their rows' positions planned for the
        batch's forward (:class:`ForwardPlans`; no plan when the batch has none)."""
        rows = permute_extend_inputs(batch, self.docs.row) if self.docs.fill_gaps else None
        self.forward_plans.prepared(batch, rows)

    def plan_offloads(
        self, reqs: Sequence[PcrReq], seq_lens: Sequence[int], req_to_token: torch.Tensor, decode: bool
    ) -> None:
        """Host slots for the whole chunks the coming forward completes (:class:`Offloads`)."""
        self.executor.execute(self.offloads.plan(reqs, seq_lens, req_to_token, decode, self.docs.exact_end))

    def adopt_offloads(self, rid: str, path: Sequence[ChunkNode], first: int, num_existing: int, end: int) -> None:
        """A checkpoint handed chunks ``[first, end)`` to the tree: offloaded ones become host-resident."""
        self.executor.execute(self.offloads.adopt(rid, path, first, num_existing, end))

    def release(self, rid: str, row_released: bool = True) -> None:
        """The request left (finished, retracted or aborted): give back what it held.
        ``row_released`` False: SGLang dropped the request's state before releasing its row
        (an abort in the waiting queue); what the row's checkpoint needs stays until then."""
        self._admitted_in.pop(rid, None)
        if self.engine is not None:
            self.engine.drop_plans(rid)  # offloads no batch of its ran
        self.docs.release(rid, keep_row_state=not row_released)
        entry = self.requests.pop(rid)
        if entry is None:
            return
        if entry.phase.held:  # it left while waiting for its reads (an abort)
            self.state.abandon_reads(entry.held_chain)
        for slot in entry.offload_slots.values():
            self.state.release_reserved(slot)

    # ------------------------------------------------------------------ flush, rekey, close
    def reset(self, keep_persisted: bool = True) -> None:
        """``/flush_cache``: forget every request's bookkeeping, live KV hint and cached
        chunk (but the persisted ones, unless ``keep_persisted`` is False). A hint outliving
        the flush would read its chains back from the SSD into the cache just emptied."""
        # mutant: flush-keeps-live-hints
        self.requests.clear()
        self.hints.clear()
        self.probes.clear()
        self.docs.reset()
        self.keys.forget()
        # mutant: deferred-orders-survive-a-reset
        self.executor.cancel_deferred()  # CUDA: orders still waiting for their slot's copies
        self.executor.execute(self.state.reset(keep_persisted))

    def rekey(self, chain_digest: bytes) -> None:
        """Name chunks under another namespace from now on (the weights changed in place):
        no key derived after this matches one derived before, on any tier. Keys derived
        before and kept (live hints, remote probes in flight, waiting requests' document
        chains) are dropped or derived again."""
        self.keyer.rekey(chain_digest)
        self.generation += 1
        # mutant: weight-update-rekey-keeps-live-hints
        self.keys.forget()
        self.hints.clear()
        self.probes.clear()
        self.docs.forget_keys()

    def close(self) -> None:
        if self.io is not None:
            self.io.close()
