"""Admission: whether a waiting request goes now, what its admission loads, and its hits.

* :meth:`Admission.admit_now` (SGLang's ``PrefillAdder.add_one_req``) holds a request back
  while its SSD chunks are read (ordered together, urgently, and waited for at most about
  what recomputing them costs, in the queue, never in the scheduler); the verdicts (hold,
  read or recompute, by the request's explicit phase) are core's (:mod:`pcr_sglang.core.admission`).
* :meth:`Admission.load_back` (``init_load_back``) copies the host part of an admitted
  request's chain to the device, then the documents it reuses. Where the documents find no
  device room while other requests are in flight (:meth:`Admission.adding`), the request
  waits for a later pass (SGLang's "retry admission"), up to ``MAX_ROOM_WAITS`` passes,
  instead of recomputing all it planned to reuse, and the requests behind it are still
  considered this pass; alone, it is recomputed.
* :meth:`Admission.admitted` counts its hits once, by tier, and folds it into the digest
  the TP ranks compare.

A collaborator of the scheduler loop: it is handed the request's keys
(:class:`~pcr_sglang.sglang_adapter.request_keys.RequestKeys`), changes residency only
through :class:`CacheState`, runs the effects it gets through the
:class:`~pcr_sglang.sglang_adapter.executor.EffectsExecutor` and never calls back into
the loop.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from pcr_sglang.core.admission import AdmissionPhase, Timeliness, Verdict, after_reads, at_gate, read_or_recompute
from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.effects import ChainMatch, Effects
from pcr_sglang.core.hints import HintBook
from pcr_sglang.core.residency import CacheState
from pcr_sglang.req import PcrReq
from pcr_sglang.reuse.bounds import is_canonical_request
from pcr_sglang.reuse.disabled import NoDocReuse
from pcr_sglang.reuse.seam import DocLoad, SchedulerDocReuse
from pcr_sglang.sglang_adapter.executor import EffectsExecutor
from pcr_sglang.sglang_adapter.remote_probes import NoRemoteProbes, RemoteProbes
from pcr_sglang.sglang_adapter.request_keys import RequestKeys
from pcr_sglang.sglang_adapter.requests import RequestRegistry, RequestState
from pcr_sglang.sglang_adapter.step_agreement import StepAgreement

# Admission passes a request whose documents find no device room waits for others in flight
# to free some, before it is recomputed instead: a pass is about one decode step, so about
# a second on these CPUs and tens of milliseconds on a GPU, near what recomputing a few
# hundred tokens costs there. Counted in passes, not time, so every TP rank decides alike.
MAX_ROOM_WAITS = 16


@dataclass
class AddAttempt:
    """One ``add_one_req`` call as admission sees it (:meth:`Admission.adding`)."""

    others_in_flight: bool  # the batch being formed or the running batch has requests
    deferred: bool = False  # its documents found no room: it waits for a later pass


class Admission:
    def __init__(
        self,
        state: CacheState,
        executor: EffectsExecutor,
        keys: RequestKeys,
        requests: RequestRegistry,
        hints: HintBook,
        probes: RemoteProbes | NoRemoteProbes,
        agreement: StepAgreement,
        *,
        tensor_parallel: bool,
    ):
        self.state = state
        self.executor = executor
        self.allocator = executor.allocator
        self.engine = executor.engine
        self.chunk = state.chunk_size
        self.keys = keys
        self.requests = requests
        self.hints = hints
        self.probes = probes
        self.agreement = agreement  # read only: whether the TP ranks stopped the SSD tier
        self.docs: SchedulerDocReuse = NoDocReuse()  # DocReuse, with --pcr-doc-reuse
        self.tensor_parallel = tensor_parallel
        self.digest = 0  # of (rid, prefix length) of every admitted request (compared across TP ranks)
        self.last_load_private = False  # the last load_back gave the request private slots
        self._attempt: Optional[AddAttempt] = None  # within ``adding``

    @contextmanager
    def adding(self, others_in_flight: bool) -> Iterator[AddAttempt]:
        """Around SGLang's ``add_one_req``: whether other requests, already in the batch being
        formed or running, will free device memory, so a request whose documents find no
        room now can wait for a later pass instead of recomputing them (the attempt says
        whether it did: the caller lets the adder go on to the next request)."""
        self._attempt = AddAttempt(others_in_flight)
        try:
            yield self._attempt
        finally:
            self._attempt = None

    # ------------------------------------------------------------------ the gate
    def admit_now(self, req: PcrReq) -> bool:
        """``PrefillAdder.add_one_req`` (and ``preempt_to_schedule``): a waiting request is a
        candidate for admission: False holds it back this pass (its SSD chunks are being
        read). The same answer on every rank. Once the TP ranks found their I/O
        inconsistent (``agreement.broken``), nothing read is applied any more: no request waits.
        The verdicts are core's (:mod:`pcr_sglang.core.admission`); this gathers their facts."""
        entry = self.requests.peek(req.rid)
        held_chain = entry.held_chain if entry is not None else []
        gate = at_gate(
            entry.phase if entry is not None else AdmissionPhase.NEW,
            tier_on=self.state.ssd_enabled and self.agreement.broken is None,
            still_reading=lambda: any(self.state.reading(n) for n in held_chain),
        )
        if entry is not None:
            # mutant: admission-hold-not-counted
            if entry.phase.held and not gate.phase.held:  # its one hold ends (once)
                self.state.count_hold(
                    time.monotonic() - entry.held_since, expired=entry.phase is AdmissionPhase.EXPIRED
                )
            entry.phase = gate.phase
            if not gate.phase.held:
                entry.held_chain = []
        if gate.verdict is not Verdict.CONSIDER:
            return gate.verdict is Verdict.ADMIT
        if self.probes.awaiting(req.rid, lambda: self.keys.needed(req)):
            return False
        match = self.state.match(iter(self.keys.own(req)), touch=False)
        # With document reuse, the documents' canonical chains on SSD are read as the
        # request's own chain is: a document first marked after a restart (or a
        # precompute) is reused from SSD without a warm-up.
        docs = [self.state.match(iter(keys), touch=False) for keys in self.docs.canonical_chain_keys(req)]
        entry = self._first_consideration(req.rid, match, [n for m in docs for n in m.nodes])
        chains = [m for m in [match, *docs] if m.ssd_nodes]
        ssd_chunks = sum(len(m.ssd_nodes) for m in chains)
        verdict = read_or_recompute(
            ssd_chunks=ssd_chunks,
            io_healthy=self.state.io_healthy,
            choose_load=lambda: self.state.cost_model.decide(self.state.prefer_load),
        )
        if verdict is Verdict.RECOMPUTE:
            self.state.note_recompute_chosen(ssd_chunks)
        if verdict is not Verdict.READ:
            return True
        reads = self._worth_reading([m.ssd_nodes for m in chains])
        if not reads:
            return True
        effects = Effects()
        for nodes in reads:
            self.state.order_reads(nodes, effects, urgent=True, limit=len(nodes))
        self.executor.execute(effects)
        held = after_reads(
            entry.phase if entry is not None else AdmissionPhase.NEW,
            reading=any(self.state.reading(n) for nodes in reads for n in nodes),
        )
        if held.verdict is Verdict.ADMIT:
            return True  # nothing could be ordered (no host slot): recompute
        entry = entry or self.requests.get(req.rid)
        wait_s = self.state.cost_model.recompute_seconds(sum(len(nodes) for nodes in reads) * self.chunk)
        entry.phase = held.phase
        entry.held_chain = [n for chain in chains for n in chain.nodes]
        entry.held_since = time.monotonic()
        entry.deadline = entry.held_since + wait_s
        return False

    def _worth_reading(self, chains: Sequence[Sequence[ChunkNode]]) -> list[Sequence[ChunkNode]]:
        """Each chain's SSD-level chunks to read, once loading from the SSD tier was chosen:
        all of them, or, where the remote tier's measured cost says recompute, up to the
        first chunk only the remote tier holds (those are a chain's last: a probe adopts
        only past the local match)."""
        if (
            not self.probes.enabled
            or not any(n.remote_only for nodes in chains for n in nodes)
            or self.state.cost_model.decide_remote(self.chunk)
        ):
            return [nodes for nodes in chains if nodes]
        kept = []
        for nodes in chains:
            local = up_to_first_remote_only(nodes)
            self.state.note_remote_recompute_chosen(len(nodes) - len(local))
            if local:
                kept.append(local)
        return kept

    def _first_consideration(
        self, rid: str, match: ChainMatch, doc_nodes: Sequence[ChunkNode] = ()
    ) -> Optional[RequestState]:
        """Snapshot how timely the SSD chunks this request needs are, once (``doc_nodes``:
        its documents' canonical chains, which only KV hints read ahead of it)."""
        entry = self.requests.peek(rid)
        if entry is not None and entry.timeliness is not None:
            return entry
        hinted = self.state.count_hinted([*match.nodes, *doc_nodes])  # counted as the hints' own
        in_time = sum(1 for n in match.host_nodes if self.state.landed(n))
        ssd = [n for n in match.ssd_nodes if n not in hinted]
        if not in_time and not ssd:
            return entry
        entry = entry or self.requests.get(rid)
        late = sum(1 for n in ssd if self.state.reading(n))
        entry.timeliness = Timeliness(in_time, late, len(ssd) - late)
        return entry

    # ------------------------------------------------------------------ loads
    def load_back(self, req: PcrReq, host_node: ChunkNode, host_hit_length: int) -> Optional[tuple[int, Any]]:
        """``init_load_back``: copy the host-resident chunks between the request's device
        prefix and ``host_node`` to fresh device slots, then the documents it reuses (if
        :meth:`DocReuse.plan` found any) to slots of its own. All or nothing: returns the
        tokens the request's prefix grew by (SGLang refuses a partial load), or 0; None
        when the documents wait for device room (SGLang admits it at a later pass)."""
        self.last_load_private = False
        device_node = req.last_node
        plan = self.docs.planned(req.rid)
        exact_host = host_hit_length - (plan.prefix_tokens if plan is not None else 0)
        nodes = host_node.path_from_root()[device_node.depth :]
        if (
            len(nodes) * self.chunk != exact_host
            or (nodes and nodes[0].parent is not device_node)
            or any(not (n.on_host or n.on_device) for n in nodes)
            or (not nodes and plan is None)
        ):
            return 0, device_node  # the chain changed since the match: recompute
        if nodes and not self.load_chain(req, nodes):
            return 0, device_node
        if plan is not None:
            self.state.lock(host_node)
            try:
                loaded = self._load_documents(req, host_node)
            finally:
                self.state.unlock(host_node)
            if loaded is None:
                return None  # a later pass; the exact host part stays in the tree
            if not loaded:
                return 0, device_node  # the exact host part stays in the tree; all is recomputed
            # The tree owns the exact prefix; the private slots past it are the request's.
            req.kv.cache_protected_len = host_node.depth * self.chunk
            self.last_load_private = True
        return host_hit_length, host_node

    def _load_documents(self, req: PcrReq, host_node: ChunkNode) -> Optional[bool]:
        """The documents' part of ``load_back``, as document reuse asks for it (a
        :class:`~pcr_sglang.reuse.seam.DocLoad`): their chains locked while they are loaded
        and copied from, then the copy placed past ``host_node`` into the slots
        :meth:`_doc_slots` provides. All or nothing; None: no room yet, and it waits."""
        load = self.docs.load(req)
        if load is None:
            return False  # refused before anything ran, or a chain left memory
        for node in load.ends:
            self.state.lock(node)
        try:
            slots = self._doc_slots(load)
            if slots is None and self._waits_for_room(req.rid):
                self.docs.defer(req.rid)
                return None
            return self.docs.place(req, host_node, slots)
        finally:
            for node in load.ends:
                self.state.unlock(node)

    def _waits_for_room(self, rid: str) -> bool:
        """Whether a request whose documents found no device room waits for a later pass:
        while others in flight will free some, at most ``MAX_ROOM_WAITS`` passes."""
        attempt = self._attempt
        # mutant: documents-without-room-recomputed-beside-others
        if attempt is None or not attempt.others_in_flight:
            return False
        entry = self.requests.get(rid)
        if entry.room_waits >= MAX_ROOM_WAITS:
            return False
        entry.room_waits += 1
        attempt.deferred = True
        return True

    def _doc_slots(self, load: DocLoad) -> Optional[torch.Tensor]:
        """Fresh device slots for ``load``'s copy, its chains on the device first and the
        copy fenced where it runs here (None: a chain could not be loaded, or no room)."""
        for nodes in load.chains:  # host chunks of a chain come to the device like any host hit
            if not all(n.on_device for n in nodes) and not self.load_chain(None, nodes):
                return None
        if self.allocator.available_size() < load.tokens:
            self.executor.evict(load.tokens - self.allocator.available_size())
        if self.allocator.available_size() < load.tokens:
            return None
        slots: Optional[torch.Tensor] = self.allocator.alloc(load.tokens)
        if slots is not None and load.fence:
            try:
                self._fence_before_copy()  # the chains' loads are complete before the copy
            except BaseException:
                self.allocator.free(slots)
                raise
        return slots

    def load_chain(self, req: Optional[PcrReq], nodes: list[ChunkNode]) -> bool:
        """Bring host-resident ``nodes`` (a chain, first chunk first) to the device."""
        to_load = [n for n in nodes if not n.on_device]  # a request admitted earlier may have loaded some
        if not to_load:
            return True
        tokens = len(to_load) * self.chunk
        last = nodes[-1]
        self.state.lock(last)
        try:
            if self.allocator.available_size() < tokens:
                self.executor.evict(tokens - self.allocator.available_size())
            slots = self.executor.load_into_free_slots(to_load) if self.allocator.available_size() >= tokens else None
            if slots is None:
                return False
            from_ssd = self.state.commit_load(to_load, slots)
        finally:
            self.state.unlock(last)
        if from_ssd and req is not None:
            # SGLang reports these tokens under cached_tokens_details["storage"].
            req.storage_hit_length = from_ssd * self.chunk
            req.storage_hit_start = req.prefix_len
        return True

    def _fence_before_copy(self) -> None:
        """Before a document copy on the scheduler's stream: pending layer-wise loads are
        complete, and (CUDA) no forward still running on another stream touches the slots
        (a chunk stashed into the tree while its forward runs, slots freed by a dedupe)."""
        if self.engine is not None:
            self.engine.fence_before_reuse()
            self.engine.fence_after_forward()
        elif torch.cuda.is_available() and getattr(self.allocator, "device", "cpu") != "cpu":
            # No engine: a GPU-side wait on SGLang's forward stream (the scheduler thread
            # goes on); only where that stream is unknown, a wait for the whole device.
            if not self.docs.fence_after_forward():
                torch.cuda.synchronize()

    # ------------------------------------------------------------------ hits
    def admitted(self, req: PcrReq) -> None:
        """``req``'s first extend was prepared: count its hits once, by tier, as SGLang
        split them for its response."""
        chunk = self.chunk
        entry = self.requests.peek(req.rid)
        in_time = late = on_demand = 0
        if entry is not None and entry.timeliness is not None:
            in_time, late, on_demand = (entry.timeliness.in_time, entry.timeliness.late, entry.timeliness.on_demand)
            entry.timeliness = None
        host = req.cached_tokens_host
        if is_canonical_request(req):
            self.docs.count_canonical()
        plan = self.docs.reused(req.rid)
        if plan is not None:  # SGLang counts them as host hits (they came through load_back)
            host = max(host - plan.prefix_tokens, 0)
        self.state.count_admission(
            req.cached_tokens_device // chunk,
            host // chunk,
            req.cached_tokens_storage // chunk,
            in_time,
            late,
            on_demand,
        )
        if len(self.hints):
            self.hints.consume(self.keys.own(req))
        if self.tensor_parallel:
            data = f"{self.digest}|{req.rid}|{req.prefix_len}".encode()
            self.digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 12


def up_to_first_remote_only(nodes: Sequence[ChunkNode]) -> Sequence[ChunkNode]:
    """``nodes`` up to the first chunk only the remote tier holds."""
    return next((nodes[:i] for i, n in enumerate(nodes) if n.remote_only), nodes)
