"""Layer-wise offloads (``--pcr-layerwise offload``): each whole chunk a forward completes
gets a host slot, filled layer by layer as that forward writes it, and becomes host-resident
when its request's checkpoint hands the chunk to the tree.

A collaborator of the scheduler side: it reserves and adopts slots through
:class:`CacheState` (the one owner of slot state) into the :class:`Effects` it returns,
plans copies on the transfer engine, and never calls back into the scheduler loop.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.residency import CacheState
from pcr_sglang.sglang_adapter.requests import RequestRegistry

logger = logging.getLogger(__name__)
_warned_no_host_seq_lens = False


def host_seq_lens(batch: Any) -> Optional[list[int]]:
    """A prepared batch's sequence lengths from SGLang's host copy (``seq_lens_cpu``), or
    None where SGLang left it unset (its speculative path without verify sync, which PCR
    refuses; older ROCm paths did too). Then no offload is planned for this forward: its
    chunks enter the tree device-resident and reach host memory when evicted. Reading the
    device tensor instead would make the scheduler thread wait for the GPU."""
    global _warned_no_host_seq_lens
    # mutant: offloads-read-seq-lens-from-the-device
    if batch.seq_lens_cpu is not None:
        return [int(n) for n in batch.seq_lens_cpu.tolist()]
    if not _warned_no_host_seq_lens:
        _warned_no_host_seq_lens = True
        logger.warning(
            "PCR: SGLang prepared a batch without seq_lens_cpu; its new chunks are not offloaded "
            "during the forward (they reach host memory when evicted)"
        )
    return None


class Offloads:
    def __init__(self, state: CacheState, engine: Any, requests: RequestRegistry, chunk_size: int):
        self.state = state
        self.engine = engine  # the transfer engine (None: no layer-wise copies)
        self.requests = requests
        self.chunk = chunk_size

    def plan(
        self,
        reqs: Sequence[Any],
        seq_lens: Sequence[int],
        req_to_token: torch.Tensor,
        decode: bool,
        exact_end: Callable[[str], Optional[int]],
    ) -> Effects:
        """Give each whole chunk the coming forward completes a host slot. A prefill may
        evict host chunks for them; a decode step takes only free slots, within the decode
        share of the host tier (:meth:`CacheState.reserve_offload_slot`): a chunk that gets
        none is not offloaded, and enters the tree device-resident when its request
        finishes. ``exact_end(rid)``: where a request's exact KV ends (document reuse's
        blended KV past it is never cached), or None."""
        effects = Effects()
        if self.engine is None or not self.engine.mode.offloads:
            return effects
        for req, seq_len in zip(reqs, seq_lens):
            first, end = req.kv.cache_protected_len // self.chunk, int(seq_len) // self.chunk
            exact = exact_end(req.rid)
            if exact is not None:
                end = min(end, exact // self.chunk)
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
                slot = self.state.reserve_offload_slot(req.rid, effects, decode=decode)
                if slot is None:
                    break
                entry.offload_slots[index] = slot
                self.engine.plan_offload(req.rid, row[index * self.chunk : (index + 1) * self.chunk], slot)
        return effects

    def adopt(self, rid: str, path: Sequence[ChunkNode], first: int, num_existing: int, end: int) -> Effects:
        """A checkpoint handed chunks ``[first, end)`` to the tree (``path`` is the chain):
        offloaded chunks the request computed become host-resident."""
        effects = Effects()
        entry = self.requests.peek(rid)
        if entry is None or not entry.offload_slots:
            return effects
        not_run = []
        for index in range(first, end):
            slot = entry.offload_slots.pop(index, None)
            if slot is None:
                continue
            ran = self.engine is not None and self.engine.offload_ran(slot)
            if not ran:
                not_run.append(slot)
            if index >= num_existing and ran:
                self.state.adopt_offload(path[index], slot, effects)
            else:
                self.state.release_reserved(slot)
        if not_run and self.engine is not None:
            self.engine.drop_plans(rid, not_run)
        return effects
