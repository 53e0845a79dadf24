"""Runs what the cache state decided: demotion copies to the host, the device frees the
state's decisions imply, and every I/O order.

:class:`~pcr_sglang.core.residency.CacheState` decides and returns
:class:`~pcr_sglang.core.effects.Effects`; the scheduler loop and its collaborators
(admission, offloads, remote probes, KV hints) hand those effects here, in the order the
state gave them: demotion copies first (a device slot is freed only after its copy is
ordered), then device frees, then I/O orders. An order waits here until the copies that
touch its host slot have completed (CUDA; on the CPU copies complete inline), and a
completion this rank saw but the TP ranks have not agreed on yet waits in
:attr:`EffectsExecutor.finished`.

It never decides anything and never calls back into the loop, so every collaborator may
hold it. (The prefix cache frees a finished request's row and a deduplicated chunk's slots
itself: those are SGLang's slots, not the cache state's decisions.)
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.orders import IoOutcome, Order, ReadChunk, Reorder, WriteChunk
from pcr_sglang.core.residency import CacheState
from pcr_sglang.io.supervisor import IOSupervisor


class EffectsExecutor:
    def __init__(self, state: CacheState, allocator: Any, engine: Any, io: Optional[IOSupervisor]):
        self.state = state
        self.allocator = allocator
        self.engine = engine  # the transfer engine (None: no host tier)
        self.io = io
        self.chunk = state.chunk_size
        self.finished: dict[int, tuple[IoOutcome, float]] = {}  # this rank's, not yet agreed
        self.deferred: list[Any] = []  # orders waiting for the copies touching their host slot (CUDA)

    def execute(self, effects: Effects) -> None:
        """Demotion copies, then device frees, then I/O orders."""
        if effects.demotions:
            assert self.engine is not None
            copies = list(effects.demotions.values())
            host_slots = [slot for _, slot in copies]
            # One batched copy: a slot named twice would race (index_put with duplicate
            # indices has no defined winner). The cache state never gives one twice.
            assert len(set(host_slots)) == len(host_slots), "a host slot demoted into twice"
            self.engine.copy_to_host(torch.cat([d for d, _ in copies]), host_slots)
        if effects.device_frees:
            self.fence_before_reuse()
            for slots in effects.device_frees:
                self.allocator.free_segment(slots, start_pos=0)
        for order in effects.orders:
            self.send(order)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens from the tree (LRU, look-ahead last)."""
        effects = Effects()
        evicted = self.state.evict_device(-(-num_tokens // self.chunk), effects)
        self.execute(effects)
        return evicted * self.chunk

    def fence_before_reuse(self) -> None:
        """Device slots about to be reused or freed: their pending layer-wise copies are done."""
        if self.engine is not None:
            self.engine.fence_before_reuse()

    def free_private(self, slots: torch.Tensor) -> None:
        """Free device slots no tree chunk and no row holds (unused document copies)."""
        self.fence_before_reuse()
        self.allocator.free(slots)

    def load_into_free_slots(self, nodes: Sequence[ChunkNode]) -> Optional[list[torch.Tensor]]:
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

    def send(self, order: Order) -> None:
        """Send ``order`` to the I/O process, or keep it until the copies touching its host
        slot have completed. A reorder for a kept read is applied here: the I/O process has
        not seen that read yet."""
        if self.io is None:
            return
        if isinstance(order, Reorder):
            kept = next((o for o in self.deferred if o.seq == order.target), None)
            if kept is not None:
                if order.cancel:
                    self.deferred.remove(kept)
                    self.finished[kept.seq] = (IoOutcome.CANCELLED, 0.0)
                else:
                    kept.urgent = True
                return
        elif (
            isinstance(order, (ReadChunk, WriteChunk))
            and self.engine is not None
            and not self.engine.host_slot_ready(order.host_slot)
        ):
            self.deferred.append(order)
            return
        self.io.submit(order)

    def cancel_deferred(self) -> None:
        """A reset (``/flush_cache``, a weight update's move): the orders kept back for
        their host slot's copies never reach the I/O process; they end cancelled once the
        ranks agree, which releases their slots. Sent after the reset, a write would persist
        a chunk of the tree just forgotten (after a weight update, the old weights' chunk
        into the new namespace's directory and the fleet's store). A released slot is safe
        to reuse: an I/O order into it is kept back again until its copies complete."""
        for order in self.deferred:
            self.finished[order.seq] = (IoOutcome.CANCELLED, 0.0)
        self.deferred = []

    def send_deferred(self) -> None:
        """Send the kept orders whose host slot is ready now, urgent reads first."""
        if not self.deferred or self.io is None or self.engine is None:
            return
        ready = [o for o in self.deferred if self.engine.host_slot_ready(o.host_slot)]
        for order in sorted(ready, key=lambda o: not getattr(o, "urgent", False)):
            self.deferred.remove(order)
            self.io.submit(order)
