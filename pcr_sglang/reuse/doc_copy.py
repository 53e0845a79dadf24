"""Copying a request's planned documents into its private slots, and ``blend``'s choice of
what to recompute among them.

:class:`~pcr_sglang.reuse.placement.DocReuse` decides what a request reuses and owns its
slots once admission allocated them; this module fills them: each document's canonical KV
copied into its offset, K rotated by the position delta
(:func:`pcr_sglang.transfer.rope_shift.replace_layer`), with a transfer engine layer by
layer with the chains' loads before the forward reads each layer
(:meth:`pcr_sglang.transfer.engine.TransferEngine.replace`), without one at once. A
recompute plan keeps only part of the copied tokens: ``blend`` first re-places the layers
its selector's probe reads for every candidate and asks the probe
(:mod:`pcr_sglang.reuse.blend_select`) which to recompute; the kept tokens' other layers
follow, and the dropped tokens' slots go back to the allocator. What was placed comes back
as a :class:`Placed` for ``DocReuse`` to keep.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.req import PcrReq
from pcr_sglang.reuse import rows as permuted_rows
from pcr_sglang.reuse.blend_select import BlendProbe
from pcr_sglang.reuse.plan import ReusePlan, RowOrder, row_order
from pcr_sglang.reuse.selectors import QUESTION_SELECTORS
from pcr_sglang.transfer.engine import TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec, check_slots, replace_layer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placed:
    """What a copy left in a request's private slots."""

    plan: ReusePlan  # the plan served: ``blend``'s with its recomputed tokens chosen
    slots: torch.Tensor  # the kept tokens' slots, in position order
    row: Optional[RowOrder]  # where the row holds which positions (None: in order)


class DocCopier:
    """Fills private slots with documents' canonical KV (``kv_layers``: the pool's per-layer
    K and V buffers; ``allocator``: SGLang's, given the dropped tokens' slots back)."""

    def __init__(
        self,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        rope: RopeSpec,
        allocator: Any,
        engine: Optional[TransferEngine] = None,
        probe: Optional[BlendProbe] = None,
    ):
        self.kv_layers = list(kv_layers)
        self.rope = rope
        self.allocator = allocator
        self.engine = engine
        self.probe = probe  # blend's selection (built for the recompute modes)

    def place(
        self,
        req: PcrReq,
        plan: ReusePlan,
        chains: dict[int, list[ChunkNode]],
        prefix_node: ChunkNode,
        slots: torch.Tensor,
    ) -> Placed:
        """Copy ``plan``'s documents (their canonical ``chains``, on the device) into
        ``slots`` (one per token of ``plan``), past ``prefix_node`` (the end of the
        request's exact prefix). With recompute, the recomputed tokens' slots are freed
        again: the row keeps the others. On an exception the caller frees all of ``slots``."""
        if plan.recompute_count or plan.gaps:
            return self._keep_unrecomputed(req, plan, chains, prefix_node, slots)
        self.copy(plan, chains, slots)
        return Placed(plan, slots, None)

    def _keep_unrecomputed(
        self,
        req: PcrReq,
        plan: ReusePlan,
        chains: dict[int, list[ChunkNode]],
        prefix_node: ChunkNode,
        slots: torch.Tensor,
    ) -> Placed:
        """Choose the recomputed tokens (``blend``: by the probe, after re-placing the
        layers it reads for every candidate), re-place the kept ones (the rest of their layers), free
        the others' slots and the gaps', and lay out the row; returns the kept tokens'
        slots, in position order."""
        first_layer = 0
        if plan.recompute_count and not plan.recompute:
            assert self.probe is not None, "blend needs its probe (built at startup)"
            plan = replace(plan, selector=effective_selector(req, plan))
            first_layer = self.probe.layers_read(plan.selector)
            self.copy(plan, chains, slots, layers=range(first_layer))
            chosen = self._blend_selection(req, plan, prefix_node, slots)
            plan = replace(plan, recompute=chosen)
        keep = torch.ones(plan.tokens, dtype=torch.bool)
        keep[torch.tensor([p - plan.start for p in plan.extended_positions()], dtype=torch.int64)] = False
        self.copy(plan, chains, slots, layers=range(first_layer, len(self.kv_layers)), keep=keep)
        row = row_order(plan)
        # Nothing pending writes the dropped tokens' slots: no copy was queued into them but
        # the layers blend's probe read, which it already waited for (on CUDA the scheduler's
        # stream did, and the forward's stream waits for it). So they are freed without
        # the ordering a free of pending slots needs, which would make the next forward
        # wait for every pending copy. Nothing after this can fail: the caller frees all
        # of ``slots`` on an exception.
        kept = keep.nonzero().squeeze(1)
        both = to_device(torch.cat((kept, (~keep).nonzero().squeeze(1))), slots.device)  # one host-to-device copy
        self.allocator.free(slots[both[len(kept) :]])
        return Placed(plan, slots[both[: len(kept)]], row)

    def _blend_selection(
        self, req: PcrReq, plan: ReusePlan, prefix_node: ChunkNode, slots: torch.Tensor
    ) -> tuple[int, ...]:
        """The ``plan.recompute_count`` re-placed tokens the plan's selector ranks first
        (``reuse/blend_select.py``), the plan's anchors first whatever their score. The
        probe's full-context KV (layer 1; layer 2 for ``gradual``'s finalists) replaces the
        re-placed one. The layers the selector reads are in the slots already."""
        assert self.probe is not None, "blend needs its probe (built at startup)"
        if self.engine is not None:  # the probe reads the first layers of the prefix and the re-placed KV
            for layer in range(self.probe.layers_read(plan.selector)):
                self.engine.wait_until(layer)
        path = [n.device_value for n in prefix_node.path_from_root()]
        device = slots.device
        prefix = torch.cat(path).to(device) if path else torch.empty(0, dtype=torch.int64, device=device)
        candidates = torch.tensor(plan.rotated_positions(), dtype=torch.int64)
        gaps = torch.tensor(plan.gap_positions(), dtype=torch.int64)
        anchored = torch.isin(candidates, torch.tensor(plan.anchors, dtype=torch.int64))
        question_ids = (
            req.origin_input_ids[plan.end : question_end(req, plan)] if plan.selector in QUESTION_SELECTORS else []
        )
        sizes = [plan.tokens, len(candidates), len(gaps), len(candidates), len(question_ids)]
        host = torch.cat(
            (
                torch.tensor(req.origin_input_ids[plan.start : plan.end], dtype=torch.int64),
                candidates - plan.start,
                gaps - plan.start,
                anchored.to(torch.int64),
                torch.tensor(question_ids, dtype=torch.int64),
            )
        )
        ids, offsets, gap_offsets, anchors, question = torch.split(to_device(host, device), sizes)  # one copy
        positions = torch.arange(plan.start, plan.end, dtype=torch.int64, device=device)
        selection = self.probe.select(
            ids,
            positions,
            prefix[: plan.start],
            slots,
            offsets,
            plan.recompute_count,
            anchors.bool(),
            plan.selector,
            question if len(question_ids) else None,
            gap_offsets,
        )
        for exact in selection.exact:  # only re-placed tokens: delta-0 slots may enter the tree
            # Below the layers the kept tokens' copy starts at, or that copy would overwrite it.
            assert exact.layer < self.probe.layers_read(plan.selector), exact.layer
            k_buffer, v_buffer = self.kv_layers[exact.layer]
            k_buffer[slots[exact.offsets]] = exact.k
            v_buffer[slots[exact.offsets]] = exact.v
        # The one wait of a blend admission: the row's layout is chosen on the host from
        # the probe's scores, so the scheduler waits for the probe and the writes above
        # (docs/document-reuse.md).
        return tuple(sorted(plan.start + int(o) for o in selection.chosen.cpu()))

    def copy(
        self,
        plan: ReusePlan,
        chains: dict[int, list[ChunkNode]],
        slots: torch.Tensor,
        layers: Optional[range] = None,
        keep: Optional[torch.Tensor] = None,
    ) -> None:
        """Each segment's canonical KV into its offset of ``slots`` (gaps get nothing), for
        ``layers`` (default all) and, with ``keep`` (a mask over the plan's tokens), only
        the kept tokens."""
        layers = layers if layers is not None else range(len(self.kv_layers))
        # Indices are built on the host (a mask on the GPU would sync) and cross to the
        # device in one pinned, non-blocking copy: positions in the documents' chains
        # (concatenated), offsets into ``slots`` and deltas. Chain slots stay on the device.
        docs = list(dict.fromkeys(s.doc for s in plan.segments))
        chain_slots = [torch.cat([n.device_value for n in chains[doc]]) for doc in docs]
        base: dict[int, int] = {}
        total = 0
        for doc, values in zip(docs, chain_slots):
            base[doc], total = total, total + values.shape[0]  # shapes are host metadata: no sync
        sources: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        deltas: list[torch.Tensor] = []
        for segment in plan.segments:
            offset = segment.start - plan.start
            start = base[segment.doc] + segment.source_start
            source = torch.arange(start, start + segment.length, dtype=torch.int64)
            target = torch.arange(offset, offset + segment.length, dtype=torch.int64)
            if keep is not None:
                kept = keep[offset : offset + segment.length]
                source, target = source[kept], target[kept]
            sources.append(source)
            targets.append(target)
            # mutant: doc-reuse-concat-without-rotation
            deltas.append(torch.full((source.numel(),), segment.delta, dtype=torch.int64))
        index = torch.stack((torch.cat(sources), torch.cat(targets), torch.cat(deltas)))
        if index.shape[1] == 0 or not len(layers):
            return
        index = to_device(index, slots.device)
        src = torch.cat(chain_slots).to(torch.int64)[index[0]]
        dst = slots[index[1]]
        delta = index[2]
        if src.device.type == "cpu":
            # Once, not per layer. On CUDA it is left out: its verdicts would cost a
            # device-to-host sync in the scheduler thread (waiting for the forward in
            # flight); the slots are the allocator's fresh ones and locked tree chains', and
            # every CPU test checks them here (docs/document-reuse.md).
            check_slots(src, dst, self.kv_layers[0][0].shape[0])
        if self.engine is not None:
            self.engine.replace(src, dst, delta, self.rope, layers)
            return
        for layer in layers:
            k_buffer, v_buffer = self.kv_layers[layer]
            replace_layer(k_buffer, v_buffer, src, dst, delta, self.rope, verify_slots=False)


def question_end(req: PcrReq, plan: ReusePlan) -> int:
    """Where the question selectors' question ends: the request's mark, else its input's end."""
    return min(len(req.origin_input_ids), plan.question_end or len(req.origin_input_ids))


def effective_selector(req: PcrReq, plan: ReusePlan) -> str:
    """The plan's selector, but ``deviation`` for a question selector with no question
    after the documents (nothing to rank by): decided once, before the layers it reads are
    copied."""
    if plan.selector in QUESTION_SELECTORS and question_end(req, plan) <= plan.end:
        return "deviation"
    return plan.selector


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host integer tensor on ``device``: on CUDA through the pinned ring allocated once
    (:func:`rows.to_device`), non-blocking: a pageable copy would make the scheduler thread
    wait for the stream, i.e. for the forward in flight, and a ``pin_memory()`` per
    admission allocates pinned memory in the scheduler step."""
    return permuted_rows.to_device(host, device).view(host.shape)
