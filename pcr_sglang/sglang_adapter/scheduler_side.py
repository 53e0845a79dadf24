"""The scheduler's side of PCR: what runs in SGLang's scheduler loop around the cache interface.

Once per scheduler step (``get_next_batch_to_run``), before any request is matched:

1. take the I/O process's completions and the worker side's prefill timings;
2. agree across TP ranks (:mod:`pcr_sglang.core.agreement`) on which orders finished
   and how, on I/O health, write-back and the load-or-recompute verdict, on which
   requests waiting for reads have waited long enough, and on the clock KV hints expire
   by; apply what was agreed;
3. send I/O orders that waited for their host slot's copies to complete;
4. refresh the look-ahead protection and plan prefetch reads for the first waiting
   requests; with a remote tier (``--pcr-remote``), probe it once for each of them whose
   chains go past the local tiers, and enter what it holds at the SSD level.

At admission: :meth:`SchedulerSide.consider` (SGLang's ``PrefillAdder.add_one_req``)
holds a request back while its SSD chunks are read (ordered together, urgently, and
waited for at most about what recomputing them costs, in the queue, never in the
scheduler); :meth:`SchedulerSide.load_back` (``init_load_back``) copies the host part
of an admitted request's chain to the device; :meth:`SchedulerSide.admitted` counts
its hits, once. The scheduler never waits on a disk, a peer or a whole CUDA stream (but
for a ``blend`` admission, which reads its probe's scores back: docs/document-reuse.md).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch

from pcr_sglang.config import PCRConfig
from pcr_sglang.core.agreement import LocalView, agree
from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.effects import Effects, IoOutcome
from pcr_sglang.core.hints import Hint, HintBook, HintPayload, hint_tenant
from pcr_sglang.core.keys import ChunkKey, chunk_keys, root_key
from pcr_sglang.core.residency import CacheState
from pcr_sglang.io.protocol import ReadChunk, Reorder, WriteChunk
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.reuse.placement import DocReuse, is_canonical_request
from pcr_sglang.reuse.rows import permute_extend_inputs
from pcr_sglang.server_args_fields import HINT_TO_DEVICE_FREE_SHARE
from pcr_sglang.sglang_adapter.offloads import Offloads
from pcr_sglang.sglang_adapter.remote_probes import RemoteProbes, RemoteProbeStats
from pcr_sglang.sglang_adapter.requests import Hold, RequestRegistry
from pcr_sglang.sglang_adapter.step_timing import StepHistogram
from pcr_sglang.sglang_adapter.tp_group import TpGroup
from pcr_sglang.sglang_adapter.worker_side import WorkerSide
from pcr_sglang.tiers.remote_store import RemoteConfig

logger = logging.getLogger(__name__)

class SchedulerSide:
    def __init__(self, state: CacheState, config: PCRConfig, chain_digest: bytes, allocator: Any, *,
                 worker: Optional[WorkerSide] = None, io: Optional[IOSupervisor] = None,
                 tp: Optional[TpGroup] = None, remote: Optional[RemoteConfig] = None):
        self.state = state
        self.config = config
        self.chunk = config.chunk_size
        self.allocator = allocator
        self.worker = worker
        self.engine = worker.engine if worker is not None else None
        self.io = io
        self.tp = tp
        self.requests = RequestRegistry()
        self.offloads = Offloads(state, self.engine, self.requests, config.chunk_size)
        self._chain_digest = chain_digest
        self._window_keys: dict[str, list[ChunkKey]] = {}
        self._finished: dict[int, tuple[IoOutcome, float]] = {}  # this rank's, not yet agreed
        self._deferred: list = []  # orders waiting for the copies touching their host slot (CUDA)
        self._broken: Optional[str] = None  # the agreement found the ranks inconsistent
        self._writes_were_enabled = True
        self.agreement_rounds = 0
        self.digest_mismatches = 0
        self._admission_digest = 0  # of (rid, prefix length) of every admitted request
        self.step_time = StepHistogram()  # PCR's own work per scheduler step
        self.iteration_time = StepHistogram()  # the scheduler loop's iterations while busy
        self._last_step_start: Optional[float] = None
        self.docs: Optional[DocReuse] = None  # --pcr-doc-reuse (set by the factory)
        self.hints = HintBook(config.hint_limits())
        # Hints live by the clock the TP ranks agree on (the earliest rank's), so that they
        # register, hit the rate limit and expire in the same step on every rank.
        self.hint_clock: Callable[[], float] = time.monotonic  # this rank's (a test may replace it)
        self._hint_now = 0.0  # the last agreed hint clock, in seconds
        # --pcr-hint-to-device: 'auto' is on where the KV pool is on a GPU.
        on_gpu = str(getattr(allocator, "device", "cpu")).startswith("cuda")
        self.promote_hints = config.hint_to_device == "on" or (config.hint_to_device == "auto" and on_gpu)
        self._promote_free_floor = int(HINT_TO_DEVICE_FREE_SHARE * getattr(allocator, "size", 0))
        self.last_load_private = False  # the last load_back gave the request private slots
        # The remote tier (--pcr-remote, parsed by the factory): probes in flight, by probe seq.
        self.remote = remote is not None and io is not None
        self.probes = RemoteProbes(state, io, self.requests, remote.probe_timeout_ms / 1000) \
            if remote is not None and io is not None else None

    # ------------------------------------------------------------------ keys
    def root_key(self, extra_key: Optional[str], cache_salt: Optional[str]) -> bytes:
        return root_key(self._chain_digest, extra_key, cache_salt)

    def _keys(self, req: Any) -> list[ChunkKey]:
        keys = self._window_keys.get(req.rid)
        if keys is not None:
            return keys
        root = self.root_key(req.extra_key, req.cache_salt)
        tokens = self._tokens(req)
        return chunk_keys(root, tokens, self.chunk)

    def _keys_of(self, tokens: Any, extra_key: Optional[str] = None,
                 cache_salt: Optional[str] = None) -> list[ChunkKey]:
        """The chunk keys of ``tokens`` (whole chunks only)."""
        return chunk_keys(self.root_key(extra_key, cache_salt), tokens, self.chunk)

    @staticmethod
    def _tokens(req: Any) -> Any:
        """What SGLang will match for ``req``: the prompt (and any output of a retracted
        request) up to the request's own limit (at most all but the last token, which is
        always computed; less with logprobs from an earlier position; nothing with
        embedding overrides)."""
        if getattr(req, "positional_embed_overrides", None) is not None:
            return req.origin_input_ids[:0]
        tokens = req.origin_input_ids + req.output_ids if len(req.output_ids) else req.origin_input_ids
        limit = getattr(req, "_compute_max_prefix_len", None)
        cap = limit(len(tokens)) if limit is not None else len(tokens) - 1
        return tokens[: max(min(cap, len(tokens) - 1), 0)]

    # ------------------------------------------------------------------ per step
    def step(self, waiting_queue: Sequence[Any], busy: bool = True) -> None:
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
            self._agree_and_apply(bool(waiting_queue), effects)
        if self.remote:
            for seconds in self.io.take_remote_read_seconds():
                self.state.cost_model.observe_read(seconds, remote=True)
            self.probes.collect(effects)
        self.execute(effects)
        self._send_deferred()
        self._update_window(waiting_queue)
        self.step_time.observe(time.perf_counter() - start)

    def _agree_and_apply(self, queue_nonempty: bool, effects: Effects) -> None:
        if self.io is not None:
            for seq, outcome, seconds in self.io.poll():
                self._finished[seq] = (outcome, seconds)
            self.state.ssd_stats.io_failures = self.io.failures
            self.state.ssd_stats.io_restarts = self.io.restarts
        holds = self.requests.holds()
        outstanding = self.state.outstanding()
        if self.tp is not None and not (outstanding or holds or queue_nonempty or len(self.hints)):
            return  # nothing to agree on (and the same on every rank)
        if self._broken is not None:
            if len(self.hints):  # nothing is read for them any more (every rank stopped), but they end
                self.hints.expire(self.hint_clock())
            return
        now = time.monotonic()
        view = LocalView(healthy=self.io is not None and self.io.healthy,
                         prefers_load=self.state.cost_model.prefers_load(self.chunk), outstanding=outstanding,
                         finished=self._finished, still_waiting=[now < s.hold.deadline for s in holds],
                         admission_digest=self._admission_digest, hint_clock_ms=self._hint_clock_ms())
        agreed = agree(view, self.tp.reduce_min if self.tp is not None else None)
        self.agreement_rounds += 1
        if not agreed.digests_match:
            self.digest_mismatches += 1
            logger.error("PCR: the TP ranks admitted requests with different prefix lengths (a bug: please "
                         "report it); outputs may be wrong")
        if not agreed.consistent:
            self._broken = agreed.error
            self.state.io_healthy = self.state.writes_enabled = False
            for state in holds:  # nothing the SSD tier was reading will be applied any more
                state.hold = None
            logger.error("PCR: %s; the SSD tier stops on every rank (a bug: please report it)", agreed.error)
            return
        self.state.io_healthy = agreed.healthy
        self.state.prefer_load = agreed.prefers_load
        self._hint_now = max(self._hint_now, agreed.hint_clock_ms / 1000)
        if len(self.hints):  # here, not only when planning reads: hints end while the I/O is down too
            self.hints.expire(self._hint_now)
        for seq, _, _ in agreed.outcomes:
            del self._finished[seq]
        self.state.apply_outcomes(agreed.outcomes, effects)
        if self._writes_were_enabled and not self.state.writes_enabled:
            logger.warning("PCR SSD tier: a write failed (on this or another TP rank); SSD write-back is "
                           "stopped, serving continues from device and host memory (chunks already on SSD "
                           "stay readable)")
        self._writes_were_enabled = self.state.writes_enabled
        for state, still in zip(holds, agreed.still_waiting):
            if not still:
                state.hold.expired = True

    def _update_window(self, waiting_queue: Sequence[Any]) -> None:
        lookahead, prefetch = self.config.lookahead_window, self.config.prefetch_window
        ssd = self.state.ssd_enabled
        depth = max(lookahead, prefetch if ssd else 0)
        window = list(waiting_queue[:depth])
        self._window_keys = {req.rid: self._keys(req) for req in window}
        # Per request: its own prefix, then (document reuse) its documents' canonical chains.
        chains = [self._needed_chains(req) for req in window]
        if lookahead:  # one entry per request: the window counts requests
            self.state.protect([[n for chain in per_req for n in chain] for per_req in chains[:lookahead]])
        if self.remote and self.state.io_healthy:
            for req in window[:prefetch]:  # probed ahead of admission, so the answer is in by then
                entry = self.requests.get(req.rid)
                if entry.probe_seq is None and not entry.probed:
                    self.probes.send(req.rid, entry, self._needed_keys(req))
        if ssd:
            held = [n for s in self.requests.holds() for n in s.hold.chain]
            effects = Effects()
            healthy = self.state.io_healthy
            wanted = [c for per_req in chains[:prefetch] for c in per_req] if healthy else []
            if self.remote and not self.state.cost_model.prefers_remote_load(self.chunk):
                wanted = [_before_remote_only(c) for c in wanted]  # not worth reading ahead either
            hinted = self._hinted_chains() if healthy else []
            self.state.plan_prefetch(wanted, held, effects, len(waiting_queue), hinted)
            self.execute(effects)
            if hinted and self.promote_hints:
                self._promote_hinted()

    # ------------------------------------------------------------------ KV hints
    def add_hint(self, req: Any, payload: HintPayload) -> bool:
        """Register ``req``'s prompt as a hint: its chains are read ahead while the hint
        lives (see :mod:`pcr_sglang.core.hints`). False when it was not registered (no SSD
        tier, hints off, or over the rate). Under TP every rank registers the same request
        here (SGLang hands each rank the same requests in the same order), so the clock it
        is registered at is agreed by a collective of its own."""
        if not self.state.ssd_enabled or self.state.config.hint_budget_chunks <= 0:
            return False
        tokens = req.origin_input_ids
        # What the final request will match: all but its last token (always computed).
        keys = self._keys_of(tokens[: max(len(tokens) - 1, 0)], req.extra_key, req.cache_salt)
        clock_ms = self._hint_clock_ms()
        if self.tp is not None:
            clock_ms = self.tp.reduce_min([clock_ms])[0]
        now = self._hint_now = max(self._hint_now, clock_ms / 1000)
        tenant = hint_tenant(req.cache_salt, req.extra_key)
        if not self.hints.register(req.rid, keys, payload, now, tenant=tenant):
            return False
        if self.docs is not None and payload.hint_only:
            # A hint marking documents also reads each one's canonical chain: the final
            # request reuses them in whatever order it puts them. One group with the
            # prompt's own hint, so they end together. They count against the tenant's live
            # hints (never another tenant's), and past the first 16 they take rate tokens.
            doc_payload = replace(payload, group=payload.group or f"pcr-hint:{req.rid}")
            self.hints.register_documents(req.rid, self.docs.canonical_chain_keys(req), doc_payload, now, tenant)
            self.docs.release(req.rid)  # the hint-only request never reaches admission
        return True

    def _hint_clock_ms(self) -> int:
        return int(self.hint_clock() * 1000)

    def _hinted_chains(self) -> tuple[Hint, ...]:
        """The live hints, in reading order (this step's agreement expired the old ones):
        the cache state keeps their chains matched from step to step."""
        return self.hints.live()

    def _promote_hinted(self) -> None:
        """``--pcr-hint-to-device``: the host-resident run that continues each live hint's
        device prefix is loaded into free device slots now, while at least half the pool
        stays free, newest hint first; never by evicting anything. The final request then
        finds it on the device (on a GPU its PCIe copy is meant to have left the request's
        path: not measured yet)."""
        chains = self.state.hint_chains.tracked()  # the live hints', synced by this step's plan
        if self.engine is None or not any(chain.nodes for chain in chains):
            return
        for chain in chains:
            fits = (self.allocator.available_size() - self._promote_free_floor) // self.chunk
            nodes = self.state.hint_promotable(chain, fits)
            if not nodes:
                continue
            slots = self._load_into_free_slots(nodes)
            if slots is not None:
                self.state.promote(nodes, slots)
        if self.engine.pending_loads:
            # CPU: copies wait for the next forward's layer hooks; there may be none for a
            # while, and an I/O order for these host slots waits for them: copy now.
            self.engine.order_before_reuse()

    def _needed_chains(self, req: Any) -> list[list[ChunkNode]]:
        """The cached part of each chain of :meth:`_needed_keys` (document chains share
        their leading chunks: :meth:`DocReuse.canonical_chain_nodes` walks those once)."""
        own = self.state.match(iter(self._keys(req)), touch=False).nodes
        return [own, *self.docs.canonical_chain_nodes(req)] if self.docs is not None else [own]

    def _needed_keys(self, req: Any) -> list[list[ChunkKey]]:
        """The chains a waiting request will reuse: its prefix, and with document reuse
        the canonical chains of the documents it marked."""
        own = self._keys(req)
        return [own, *self.docs.canonical_chain_keys(req)] if self.docs is not None else [own]

    # ------------------------------------------------------------------ admission
    def consider(self, req: Any) -> bool:
        """A waiting request is a candidate for admission: False holds it back this pass
        (its SSD chunks are being read). The same answer on every rank."""
        if not self.state.ssd_enabled:
            return True
        entry = self.requests.peek(req.rid)
        if self._broken is not None:
            return True  # nothing the SSD tier reads is applied any more
        if entry is not None and entry.hold is not None:
            hold = entry.hold
            if hold.expired or not any(self.state.reading(n) for n in hold.chain):
                entry.hold = None
                return True
            return False
        if entry is not None and entry.waited:
            return True  # one wait per request: what has not landed since is recomputed
        if self.probes is not None and self.probes.awaiting(req.rid, lambda: self._needed_keys(req)):
            return False
        match = self.state.match(iter(self._keys(req)), touch=False)
        # With document reuse, the documents' canonical chains on SSD are read as the
        # request's own chain is: a document first marked after a restart (or a
        # precompute) is reused from SSD without a warm-up.
        docs = ([self.state.match(iter(keys), touch=False) for keys in self.docs.canonical_chain_keys(req)]
                if self.docs is not None else [])
        entry = self._first_consideration(req.rid, match, [n for m in docs for n in m.nodes])
        chains = [m for m in [match, *docs] if m.ssd_nodes]
        ssd_count = sum(len(m.ssd_nodes) for m in chains)
        if not chains or not self.state.io_healthy:
            return True
        if not self.state.cost_model.decide(self.state.prefer_load):
            self.state.ssd_stats.recompute_chosen_chunks += ssd_count
            return True
        reads = self._worth_reading([m.ssd_nodes for m in chains])
        if not reads:
            return True
        effects = Effects()
        for nodes in reads:
            self.state.order_reads(nodes, effects, urgent=True, limit=len(nodes))
        self.execute(effects)
        if not any(self.state.reading(n) for nodes in reads for n in nodes):
            return True  # nothing could be ordered (no host slot): recompute
        if entry is None:
            entry = self.requests.get(req.rid)
        wait_s = self.state.cost_model.recompute_seconds(sum(len(nodes) for nodes in reads) * self.chunk)
        entry.hold = Hold(chain=[n for chain in chains for n in chain.nodes], deadline=time.monotonic() + wait_s)
        entry.waited = True
        return False

    def _worth_reading(self, chains: Sequence[Sequence[ChunkNode]]) -> list[Sequence[ChunkNode]]:
        """Each chain's SSD-level chunks to read, once loading from the SSD tier was chosen:
        all of them, or, where the remote tier's measured cost says recompute, up to the
        first chunk only the remote tier holds (those are a chain's last: a probe adopts
        only past the local match)."""
        if (not self.remote or not any(n.remote_only for nodes in chains for n in nodes)
                or self.state.cost_model.decide_remote(self.chunk)):
            return [nodes for nodes in chains if nodes]
        kept = []
        for nodes in chains:
            local = _before_remote_only(nodes)
            self.state.ssd_stats.remote_recompute_chosen_chunks += len(nodes) - len(local)
            if local:
                kept.append(local)
        return kept

    def _first_consideration(self, rid: str, match: Any, doc_nodes: Sequence[ChunkNode] = ()) -> Optional[Any]:
        """Snapshot how timely the SSD chunks this request needs are, once (``doc_nodes``:
        its documents' canonical chains, which only KV hints read ahead of it)."""
        entry = self.requests.peek(rid)
        if entry is not None and entry.considered:
            return entry
        hinted = self.state.count_hinted([*match.nodes, *doc_nodes])  # counted as the hints' own
        in_time = sum(1 for n in match.host_nodes if self.state.landed(n))
        ssd = [n for n in match.ssd_nodes if n not in hinted]
        if not in_time and not ssd:
            return entry
        entry = entry or self.requests.get(rid)
        entry.considered = True
        entry.in_time_chunks = in_time
        entry.late_chunks = sum(1 for n in ssd if self.state.reading(n))
        entry.on_demand_chunks = len(ssd) - entry.late_chunks
        return entry

    def load_back(self, req: Any, host_node: ChunkNode, host_hit_length: int) -> tuple[int, Any]:
        """``init_load_back``: copy the host-resident chunks between the request's device
        prefix and ``host_node`` to fresh device slots, then the documents it reuses (if
        :meth:`DocReuse.plan` found any) to slots of its own. All or nothing: returns the
        tokens the request's prefix grew by (SGLang refuses a partial load), or 0."""
        self.last_load_private = False
        device_node = req.last_node
        plan = self.docs.planned(req.rid) if self.docs is not None else None
        exact_host = host_hit_length - (plan.prefix_tokens if plan is not None else 0)
        nodes = host_node.path_from_root()[device_node.depth:]
        if (len(nodes) * self.chunk != exact_host or (nodes and nodes[0].parent is not device_node)
                or any(not (n.on_host or n.on_device) for n in nodes) or (not nodes and plan is None)):
            return 0, device_node  # the chain changed since the match: recompute
        if nodes and not self._load_chain(req, nodes):
            return 0, device_node
        if plan is not None:
            self.state.lock(host_node)
            try:
                loaded = self.docs.load(req, host_node, lambda chain: self._load_chain(None, chain), self.evict,
                                        self._order_before_copy)
            finally:
                self.state.unlock(host_node)
            if not loaded:
                return 0, device_node  # the exact host part stays in the tree; all is recomputed
            # The tree owns the exact prefix; the private slots past it are the request's.
            req.kv.cache_protected_len = host_node.depth * self.chunk
            self.last_load_private = True
        return host_hit_length, host_node

    def _load_chain(self, req: Any, nodes: list[ChunkNode]) -> bool:
        """Bring host-resident ``nodes`` (a chain, first chunk first) to the device."""
        to_load = [n for n in nodes if not n.on_device]  # a request admitted earlier may have loaded some
        if not to_load:
            return True
        tokens = len(to_load) * self.chunk
        last = nodes[-1]
        self.state.lock(last)
        try:
            if self.allocator.available_size() < tokens:
                self.evict(tokens - self.allocator.available_size())
            slots = self._load_into_free_slots(to_load) if self.allocator.available_size() >= tokens else None
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

    def _load_into_free_slots(self, nodes: Sequence[ChunkNode]) -> Optional[list[torch.Tensor]]:
        """Take device slots for host-resident ``nodes`` from the free pool (never evicting:
        the caller has made room or chosen not to) and order their copies; each chunk's
        slots, for the cache state to commit, or None when the pool is short."""
        assert self.engine is not None
        slots = self.allocator.alloc(len(nodes) * self.chunk)
        if slots is None:
            return None
        slots = slots.to(torch.int64)
        self.engine.load(slots, [n.host_slot for n in nodes])
        return [s.clone() for s in slots.split(self.chunk)]

    def _order_before_reuse(self) -> None:
        if self.engine is not None:
            self.engine.order_before_reuse()

    def _order_before_copy(self) -> None:
        """Before a document copy on the scheduler's stream: pending layer-wise loads are
        complete, and (CUDA) no forward still running on another stream touches the slots
        (a chunk stashed into the tree while its forward runs, slots freed by a dedupe)."""
        if self.engine is not None:
            self.engine.order_before_reuse()
            self.engine.order_after_forward()
        elif torch.cuda.is_available() and getattr(self.allocator, "device", "cpu") != "cpu":
            # No engine: a GPU-side wait on SGLang's forward stream (the scheduler thread
            # goes on); only where that stream is unknown, a wait for the whole device.
            if self.docs is None or not self.docs.order_after_forward():
                torch.cuda.synchronize()

    def rows_written(self, reqs: Sequence[Any]) -> None:
        """``prepare_for_extend`` wrote these requests' rows: private document slots in
        them now belong to the row (and are freed with it)."""
        if self.docs is not None:
            for req in reqs:
                self.docs.written_into_row(req)

    def permute_extend_inputs(self, batch: Any) -> Optional[dict[int, torch.Tensor]]:
        """After ``prepare_for_extend``: the extend input of requests with permuted rows
        (recomputed or gap tokens) in row order, and their rows' positions for the forward
        (None when the batch has none)."""
        if self.docs is None or not self.docs.fill_gaps:  # no request's row is permuted
            return None
        return permute_extend_inputs(batch, self.docs.row)

    def admitted(self, req: Any) -> None:
        """``req``'s first extend was prepared: count its hits once, by tier, as SGLang
        split them for its response."""
        chunk = self.chunk
        entry = self.requests.peek(req.rid)
        in_time = late = on_demand = 0
        if entry is not None and entry.considered:
            in_time, late, on_demand = entry.in_time_chunks, entry.late_chunks, entry.on_demand_chunks
            entry.considered = False
        host = req.cached_tokens_host
        if self.docs is not None:
            if is_canonical_request(req):
                self.docs.count_canonical()
            plan = self.docs.reused(req.rid)
            if plan is not None:  # SGLang counts them as host hits (they came through load_back)
                host = max(host - plan.prefix_tokens, 0)
        self.state.count_admission(req.cached_tokens_device // chunk, host // chunk,
                                   req.cached_tokens_storage // chunk, in_time, late, on_demand)
        if len(self.hints):
            self.hints.consume(self._keys(req))
        if self.tp is not None:
            data = f"{self._admission_digest}|{req.rid}|{req.prefix_len}".encode()
            self._admission_digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 12

    # ------------------------------------------------------------------ offloads
    def plan_offloads(self, reqs: Sequence[Any], seq_lens: Sequence[int], req_to_token: torch.Tensor,
                      decode: bool) -> None:
        """Host slots for the whole chunks the coming forward completes (:class:`Offloads`)."""
        docs = self.docs
        self.execute(self.offloads.plan(reqs, seq_lens, req_to_token, decode,
                                        docs.exact_end if docs is not None else lambda rid: None))

    def adopt_offloads(self, rid: str, path: Sequence[ChunkNode], first: int, num_existing: int, end: int) -> None:
        """A checkpoint handed chunks ``[first, end)`` to the tree: offloaded ones become host-resident."""
        self.execute(self.offloads.adopt(rid, path, first, num_existing, end))

    def release(self, rid: str, row_released: bool = True) -> None:
        """The request left (finished, retracted or aborted): give back what it held.
        ``row_released`` False: SGLang dropped the request's state before releasing its row
        (an abort in the waiting queue); what the row's checkpoint needs stays until then."""
        if self.engine is not None:
            self.engine.drop_plans(rid)  # offloads no batch of its ran
        if self.docs is not None:
            self.docs.release(rid, keep_row_state=not row_released)
        entry = self.requests.pop(rid)
        if entry is None:
            return
        if entry.hold is not None:  # it left while waiting for its reads (an abort)
            self.state.abandon_reads(entry.hold.chain)
        for slot in entry.offload_slots.values():
            self.state.release_reserved(slot)

    # ------------------------------------------------------------------ effects
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens from the tree (LRU, look-ahead last)."""
        effects = Effects()
        evicted = self.state.evict_device(-(-num_tokens // self.chunk), effects)
        self.execute(effects)
        return evicted * self.chunk

    def execute(self, effects: Effects) -> None:
        """Run what the cache state decided: demotion copies, then device frees, then I/O."""
        if effects.demotions:
            assert self.engine is not None
            copies = list(effects.demotions.values())
            host_slots = [slot for _, slot in copies]
            # One batched copy: a slot named twice would race (index_put with duplicate
            # indices has no defined winner). The cache state never gives one twice.
            assert len(set(host_slots)) == len(host_slots), "a host slot demoted into twice"
            self.engine.copy_to_host(torch.cat([d for d, _ in copies]), host_slots)
        if effects.device_frees:
            if self.engine is not None:
                self.engine.order_before_reuse()
            for slots in effects.device_frees:
                self.allocator.free_segment(slots, start_pos=0)
        for order in effects.orders:
            self._send(order)

    def _send(self, order: Any) -> None:
        """Send ``order`` to the I/O process, or keep it until the copies touching its host
        slot have completed (CUDA; on CPU copies complete inline). A reorder for a kept
        read is applied here: the I/O process has not seen that read yet."""
        if self.io is None:
            return
        if isinstance(order, Reorder):
            kept = next((o for o in self._deferred if o.seq == order.target), None)
            if kept is not None:
                if order.cancel:
                    self._deferred.remove(kept)
                    self._finished[kept.seq] = (IoOutcome.CANCELLED, 0.0)
                else:
                    kept.urgent = True
                return
        elif (isinstance(order, (ReadChunk, WriteChunk)) and self.engine is not None
              and not self.engine.host_slot_ready(order.host_slot)):
            self._deferred.append(order)
            return
        self.io.submit(order)

    def _send_deferred(self) -> None:
        """Send the kept orders whose host slot is ready now, urgent reads first."""
        if not self._deferred or self.io is None or self.engine is None:
            return
        ready = [o for o in self._deferred if self.engine.host_slot_ready(o.host_slot)]
        for order in sorted(ready, key=lambda o: not getattr(o, "urgent", False)):
            self._deferred.remove(order)
            self.io.submit(order)

    @property
    def probes_in_flight(self) -> int:
        return self.probes.in_flight if self.probes is not None else 0

    @property
    def remote_stats(self) -> RemoteProbeStats:
        return self.probes.stats if self.probes is not None else RemoteProbeStats()

    @property
    def deferred_orders(self) -> int:
        return len(self._deferred)

    @property
    def broken(self) -> Optional[str]:
        return self._broken

    def free_private(self, slots: torch.Tensor) -> None:
        """Free device slots no tree chunk and no row holds (unused document copies)."""
        self._order_before_reuse()
        self.allocator.free(slots)

    def reset(self, keep_persisted: bool = True) -> None:
        """``/flush_cache``: forget every request's bookkeeping, live KV hint and cached
        chunk (but the persisted ones, unless ``keep_persisted`` is False). A hint outliving
        the flush would read its chains back from the SSD into the cache just emptied."""
        self.requests.clear()
        self.hints.clear()
        if self.probes is not None:
            self.probes.clear()
        if self.docs is not None:
            self.docs.reset()
        self._window_keys = {}
        self.execute(self.state.reset(keep_persisted))

    def rekey(self, chain_digest: bytes) -> None:
        """Name chunks under another namespace from now on (the weights changed in place):
        no key derived after this matches one derived before, on any tier. Keys derived
        before and kept (live hints, remote probes in flight, waiting requests' document
        chains) are dropped or derived again."""
        self._chain_digest = chain_digest
        self._window_keys = {}
        self.hints.clear()
        if self.probes is not None:
            self.probes.clear()
        if self.docs is not None:
            self.docs.forget_keys()

    def close(self) -> None:
        if self.io is not None:
            self.io.close()


def _before_remote_only(nodes: Sequence[ChunkNode]) -> Sequence[ChunkNode]:
    """``nodes`` up to the first chunk only the remote tier holds."""
    return next((nodes[:i] for i, n in enumerate(nodes) if n.remote_only), nodes)
