"""The scheduler's side of PCR: what runs in SGLang's scheduler loop around the cache interface.

Once per scheduler step (``get_next_batch_to_run``), before any request is matched:

1. take the I/O process's completions and the worker side's prefill timings;
2. agree across TP ranks (:mod:`pcr_sglang.core.agreement`) on which orders finished
   and how, on I/O health, write-back and the load-or-recompute verdict, and on which
   requests waiting for reads have waited long enough; apply what was agreed;
3. send I/O orders that waited for their host slot's copies to complete;
4. refresh the look-ahead protection and plan prefetch reads for the first waiting
   requests.

At admission: :meth:`SchedulerSide.consider` (SGLang's ``PrefillAdder.add_one_req``)
holds a request back while its SSD chunks are read (ordered together, urgently, and
waited for at most about what recomputing them costs, in the queue, never in the
scheduler); :meth:`SchedulerSide.load_back` (``init_load_back``) copies the host part
of an admitted request's chain to the device; :meth:`SchedulerSide.admitted` counts
its hits, once. The scheduler never waits on a disk, a peer or a whole CUDA stream.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Optional, Sequence

import torch

from pcr_sglang.config import PCRConfig
from pcr_sglang.core.agreement import LocalView, agree
from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.effects import Effects, IoOutcome
from pcr_sglang.core.keys import ChunkKey, chunk_keys, root_key
from pcr_sglang.core.residency import CacheState
from pcr_sglang.io.protocol import ReadChunk, WriteChunk
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.sglang_adapter.requests import Hold, RequestRegistry
from pcr_sglang.sglang_adapter.tp_group import TpGroup
from pcr_sglang.sglang_adapter.worker_side import WorkerSide

logger = logging.getLogger(__name__)

STEP_SAMPLES = 4096


class SchedulerSide:
    def __init__(self, state: CacheState, config: PCRConfig, chain_digest: bytes, allocator: Any, *,
                 worker: Optional[WorkerSide] = None, io: Optional[IOSupervisor] = None,
                 tp: Optional[TpGroup] = None):
        self.state = state
        self.config = config
        self.chunk = config.chunk_size
        self.allocator = allocator
        self.worker = worker
        self.engine = worker.engine if worker is not None else None
        self.io = io
        self.tp = tp
        self.requests = RequestRegistry()
        self._chain_digest = chain_digest
        self._window_keys: dict[str, list[ChunkKey]] = {}
        self._finished: dict[int, tuple[IoOutcome, float]] = {}  # this rank's, not yet agreed
        self._deferred: collections.deque = collections.deque()  # orders waiting for their slot's copies
        self._broken: Optional[str] = None  # the agreement found the ranks inconsistent
        self._writes_were_enabled = True
        self.agreement_rounds = 0
        self.step_seconds: collections.deque = collections.deque(maxlen=STEP_SAMPLES)
        self.iteration_seconds: collections.deque = collections.deque(maxlen=STEP_SAMPLES)
        self._last_step_start: Optional[float] = None

    # ------------------------------------------------------------------ keys
    def root_key(self, extra_key: Optional[str], cache_salt: Optional[str]) -> bytes:
        return root_key(self._chain_digest, extra_key, cache_salt)

    def _keys(self, req: Any) -> list[ChunkKey]:
        keys = self._window_keys.get(req.rid)
        if keys is None:
            keys = chunk_keys(self.root_key(req.extra_key, req.cache_salt), self._tokens(req), self.chunk)
        return keys

    @staticmethod
    def _tokens(req: Any) -> Any:
        # What SGLang matches: the prompt (and any output of a retracted request), minus
        # the last token, which is always computed.
        tokens = req.origin_input_ids + req.output_ids if len(req.output_ids) else req.origin_input_ids
        return tokens[: max(len(tokens) - 1, 0)]

    # ------------------------------------------------------------------ per step
    def step(self, waiting_queue: Sequence[Any], busy: bool = True) -> None:
        """Before each scheduling pass (every rank, every loop iteration). ``busy``: the
        scheduler has requests waiting or running (idle iterations may sleep, and are
        not counted in the iteration times)."""
        start = time.perf_counter()
        if self._last_step_start is not None:
            self.iteration_seconds.append(start - self._last_step_start)
        self._last_step_start = start if busy else None
        if self.worker is not None:
            for tokens, seconds in self.worker.take_prefill_timings():
                self.state.cost_model.observe_prefill(tokens, seconds)
        effects = Effects()
        if self.io is not None:
            self._agree_and_apply(bool(waiting_queue), effects)
        self.execute(effects)
        self._send_deferred()
        self._update_window(waiting_queue)
        self.step_seconds.append(time.perf_counter() - start)

    def _agree_and_apply(self, queue_nonempty: bool, effects: Effects) -> None:
        assert self.io is not None
        for seq, outcome, seconds in self.io.poll():
            self._finished[seq] = (outcome, seconds)
        self.state.ssd_stats.io_failures = self.io.failures
        self.state.ssd_stats.io_restarts = self.io.restarts
        holds = self.requests.holds()
        outstanding = self.state.outstanding()
        if self.tp is not None and not (outstanding or holds or queue_nonempty):
            return  # nothing to agree on (and the same on every rank)
        if self._broken is not None:
            return
        now = time.monotonic()
        view = LocalView(healthy=self.io.healthy, writes_ok=not self.state.local_write_error,
                         prefers_load=self.state.cost_model.prefers_load(self.chunk), outstanding=outstanding,
                         finished=self._finished, still_waiting=[now < s.hold.deadline for s in holds])
        agreed = agree(view, self.tp.reduce_min if self.tp is not None else None)
        self.agreement_rounds += 1
        if not agreed.consistent:
            self._broken = agreed.error
            self.state.io_healthy = self.state.writes_enabled = False
            logger.error("PCR: %s; the SSD tier stops on every rank (a bug: please report it)", agreed.error)
            return
        self.state.io_healthy = agreed.healthy
        self.state.writes_enabled = agreed.writes_ok
        self.state.prefer_load = agreed.prefers_load
        if self._writes_were_enabled and not agreed.writes_ok:
            logger.warning("PCR SSD tier: a write failed (on this or another TP rank); SSD write-back is "
                           "stopped, serving continues from device and host memory (chunks already on SSD "
                           "stay readable)")
        self._writes_were_enabled = agreed.writes_ok
        for seq, _, _ in agreed.outcomes:
            del self._finished[seq]
        self.state.apply_outcomes(agreed.outcomes, effects)
        for state, still in zip(holds, agreed.still_waiting):
            if not still:
                state.hold.expired = True

    def _update_window(self, waiting_queue: Sequence[Any]) -> None:
        lookahead, prefetch = self.config.lookahead_window, self.config.prefetch_window
        ssd = self.state.ssd_enabled
        depth = max(lookahead, prefetch if ssd else 0)
        window = list(waiting_queue[:depth])
        self._window_keys = {req.rid: self._keys(req) for req in window}
        chains = [self.state.match(iter(self._window_keys[req.rid]), touch=False).nodes for req in window]
        if lookahead:
            self.state.protect(chains[:lookahead])
        if ssd:
            held = [n for s in self.requests.holds() for n in s.hold.chain]
            effects = Effects()
            self.state.plan_prefetch(chains[:prefetch] if self.state.io_healthy else [], held, effects,
                                     len(waiting_queue))
            self.execute(effects)

    # ------------------------------------------------------------------ admission
    def consider(self, req: Any) -> bool:
        """A waiting request is a candidate for admission: False holds it back this pass
        (its SSD chunks are being read). The same answer on every rank."""
        if not self.state.ssd_enabled:
            return True
        entry = self.requests.peek(req.rid)
        if entry is not None and entry.hold is not None:
            hold = entry.hold
            if hold.expired or not any(self.state.reading(n) for n in hold.chain):
                entry.hold = None
                return True
            return False
        match = self.state.match(iter(self._keys(req)), touch=False)
        entry = self._first_consideration(req.rid, match)
        ssd_nodes = match.ssd_nodes
        if not ssd_nodes or not self.state.io_healthy:
            return True
        if not self.state.cost_model.decide(self.state.prefer_load):
            self.state.ssd_stats.recompute_chosen_chunks += len(ssd_nodes)
            return True
        effects = Effects()
        self.state.order_reads(ssd_nodes, effects, urgent=True, limit=len(ssd_nodes))
        self.execute(effects)
        if not any(self.state.reading(n) for n in ssd_nodes):
            return True  # nothing could be ordered (no host slot): recompute
        if entry is None:
            entry = self.requests.get(req.rid)
        wait_s = self.state.cost_model.recompute_seconds(len(ssd_nodes) * self.chunk)
        entry.hold = Hold(chain=list(match.nodes), deadline=time.monotonic() + wait_s)
        return False

    def _first_consideration(self, rid: str, match: Any) -> Optional[Any]:
        """Snapshot how timely the SSD chunks this request needs are, once."""
        entry = self.requests.peek(rid)
        if entry is not None and entry.considered:
            return entry
        in_time = sum(1 for n in match.host_nodes if self.state.landed(n))
        ssd = match.ssd_nodes
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
        prefix and ``host_node`` to fresh device slots. All or nothing: returns the tokens
        the request's prefix grew by (SGLang refuses a partial load), or 0."""
        device_node = req.last_node
        nodes = host_node.path_from_root()[device_node.depth:]
        if (len(nodes) * self.chunk != host_hit_length or not nodes or nodes[0].parent is not device_node
                or any(not (n.on_host or n.on_device) for n in nodes)):
            return 0, device_node  # the chain changed since the match: recompute
        # A request admitted earlier in this pass may have loaded the head of the chain.
        to_load = [n for n in nodes if not n.on_device]
        tokens = len(to_load) * self.chunk
        from_ssd = 0
        self.state.lock(host_node)
        try:
            if to_load:
                if self.allocator.available_size() < tokens:
                    self.evict(tokens - self.allocator.available_size())
                slots = self.allocator.alloc(tokens) if self.allocator.available_size() >= tokens else None
                if slots is None:
                    return 0, device_node
                slots = slots.to(torch.int64)
                assert self.engine is not None
                self.engine.load(slots, [n.host_slot for n in to_load])
                from_ssd = self.state.commit_load(to_load, [s.clone() for s in slots.split(self.chunk)])
        finally:
            self.state.unlock(host_node)
        if from_ssd:
            # SGLang reports these tokens under cached_tokens_details["storage"].
            req.storage_hit_length = from_ssd * self.chunk
            req.storage_hit_start = req.prefix_len
        return len(nodes) * self.chunk, host_node

    def admitted(self, req: Any) -> None:
        """``req``'s first extend was prepared: count its hits once, by tier, as SGLang
        split them for its response."""
        chunk = self.chunk
        entry = self.requests.peek(req.rid)
        in_time = late = on_demand = 0
        if entry is not None and entry.considered:
            in_time, late, on_demand = entry.in_time_chunks, entry.late_chunks, entry.on_demand_chunks
            entry.considered = False
        self.state.count_admission(req.cached_tokens_device // chunk, req.cached_tokens_host // chunk,
                                   req.cached_tokens_storage // chunk, in_time, late, on_demand)

    # ------------------------------------------------------------------ offloads
    def plan_offloads(self, reqs: Sequence[Any], seq_lens: Sequence[int], req_to_token: torch.Tensor,
                      decode: bool) -> None:
        """Give each whole chunk the coming forward completes a host slot, filled layer by
        layer as that forward writes it (``--pcr-layerwise offload``). A decode step takes
        only free slots; a prefill may evict host chunks for them."""
        if self.engine is None or not self.engine.mode.offloads:
            return
        effects = Effects()
        for req, seq_len in zip(reqs, seq_lens):
            first, end = req.kv.cache_protected_len // self.chunk, int(seq_len) // self.chunk
            if decode:
                if seq_len % self.chunk:
                    continue
                first = max(first, end - 1)
            if end <= first:
                continue
            entry = self.requests.get(req.rid)
            row = req_to_token[req.kv.req_pool_idx]
            for index in range(first, end):
                if index in entry.offload_slots:
                    continue
                slot = self.state.reserve_offload_slot(req.rid, effects, may_evict=not decode)
                if slot is None:
                    break
                entry.offload_slots[index] = slot
                self.engine.plan_offload(req.rid, row[index * self.chunk:(index + 1) * self.chunk], slot)
        self.execute(effects)

    def adopt_offloads(self, rid: str, path: Sequence[ChunkNode], first: int, num_existing: int, end: int) -> None:
        """A checkpoint handed chunks ``[first, end)`` to the tree (``path`` is the chain):
        offloaded chunks the request computed become host-resident."""
        entry = self.requests.peek(rid)
        if entry is None or not entry.offload_slots:
            return
        effects = Effects()
        for index in range(first, end):
            slot = entry.offload_slots.pop(index, None)
            if slot is None:
                continue
            if index >= num_existing and self.engine is not None and self.engine.offload_ran(slot):
                self.state.adopt_offload(path[index], slot, effects)
            else:
                self.state.release_reserved(slot)
        self.execute(effects)

    def release(self, rid: str) -> None:
        """The request left (finished, retracted or aborted): give back what it held."""
        entry = self.requests.pop(rid)
        if entry is None:
            return
        if entry.offload_slots:
            if self.engine is not None:
                self.engine.drop_plans(rid)
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
            self.engine.copy_to_host(torch.cat([d for d, _ in effects.demotions]),
                                     [slot for _, slot in effects.demotions])
        if effects.device_frees:
            if self.engine is not None:
                self.engine.order_before_reuse()
            for slots in effects.device_frees:
                self.allocator.free_segment(slots, start_pos=0)
        for order in effects.orders:
            self._send(order)

    def _send(self, order: Any) -> None:
        if self.io is None:
            return
        if (isinstance(order, (ReadChunk, WriteChunk)) and self.engine is not None
                and (self._deferred or not self.engine.host_slot_ready(order.host_slot))):
            self._deferred.append(order)  # a copy still touches its host slot (CUDA)
            return
        self.io.submit(order)

    def _send_deferred(self) -> None:
        while self._deferred and self.engine is not None and self.engine.host_slot_ready(self._deferred[0].host_slot):
            self.io.submit(self._deferred.popleft())

    @property
    def deferred_orders(self) -> int:
        return len(self._deferred)

    @property
    def broken(self) -> Optional[str]:
        return self._broken

    def reset(self) -> None:
        self.requests.clear()
        self._window_keys = {}
        self.execute(self.state.reset())

    def close(self) -> None:
        if self.io is not None:
            self.io.close()
