"""Document KV reuse on the scheduler's side: plan at match, copy and rotate at admission.

A request opts in with ``sampling_params.custom_params["pcr_doc_bounds"]`` (see
:mod:`pcr_sglang.reuse.plan`). SGLang's tree-cache protocol carries the reuse the way
it carries a host hit, so its admission budget, locks and row writing apply unchanged:

* :meth:`DocReuse.plan` (from ``match_prefix``, only looking): past the exact prefix, the
  documents whose canonical chain ``S ‖ d ‖ pad`` is in device or host memory; their
  tokens are reported as part of ``host_hit_length``;
* :meth:`DocReuse.load` (from ``init_load_back``, under the adder's budget): the chains'
  host chunks are loaded into the tree like any host hit, then each document's KV is
  copied into slots of the request's own, K rotated by the position delta
  (:func:`pcr_sglang.transfer.rope_shift.replace_layer`): with a transfer engine, layer
  by layer with the chains' loads, before the forward reads each layer
  (:meth:`pcr_sglang.transfer.engine.TransferEngine.replace`), only the tokens the
  request keeps (``blend`` rotates the first layers of every candidate first, those its
  selector's probe reads: 0-1, 0-2 for ``gradual``, 0-4 for ``prophet``);
* ``prefix_device_indices`` appends those private slots to the tree path, so
  ``alloc_for_extend`` writes them into the request's row; from then on they are the
  request's, freed with its row like any slot past ``cache_protected_len``;
* checkpoints stop at the plan's ``exact_end``: blended KV never enters the tree;
* recompute modes (``lego``, ``blend``) keep only part of the re-placed tokens: the
  recomputed ones' slots are freed at admission, and they are extended at their true
  positions behind the kept ones (:class:`pcr_sglang.reuse.plan.RowOrder`,
  :mod:`pcr_sglang.reuse.rows`); ``blend`` picks them with its probe
  (:mod:`pcr_sglang.reuse.blend_select`);
* with ``fill_gaps`` (every mode where the attention takes permuted rows), a document that
  is not cached, between reused ones, is extended in place the same way, and the
  documents after it are still reused.

The cache state still owns every tree chunk: this module reads residency, locks chains
while it copies from them, and allocates and frees only its private slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.keys import ChainKeyer
from pcr_sglang.core.residency import CacheState
from pcr_sglang.req import PcrReq, request_tenant
from pcr_sglang.reuse import rows as permuted_rows
from pcr_sglang.reuse.blend_select import BlendProbe, ProbeBudgetError
from pcr_sglang.reuse.bounds import (
    RECOMPUTE_MODES,
    DocBoundsError,
    DocLimits,
    DocSpan,
    Recompute,
    is_canonical_request,
    request_doc_reuse,
)
from pcr_sglang.reuse.calibration import CalibrationConditions
from pcr_sglang.reuse.plan import ReusePlan, RowOrder, canonical_chain_keys, plan_reuse, row_order, with_recompute
from pcr_sglang.reuse.selectors import QUESTION_SELECTORS
from pcr_sglang.transfer.engine import TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec, check_slots, replace_layer

logger = logging.getLogger(__name__)


@dataclass
class DocReuseStats:
    requests: int = 0  # admitted requests that marked documents
    canonical_requests: int = 0  # admitted canonical prefills (S ‖ d ‖ pad)
    docs_marked: int = 0
    docs_reused: int = 0
    tokens_reused: int = 0
    tokens_rotated: int = 0  # of those, moved to another position (delta != 0)
    tokens_recomputed: int = 0  # re-placed tokens recomputed instead (lego, blend)
    gap_tokens: int = 0  # tokens between reused documents with no cached KV, computed in place
    load_failures: int = 0  # planned but not loadable at admission (recomputed)
    # Recomputed at admission, before anything was copied, because serving the reuse could
    # need more scratch than reserved: blend's probe (--pcr-blend-probe-mb) or the
    # permuted row's position mask (--pcr-position-mask-mb).
    probe_over_budget: int = 0
    mask_over_budget: int = 0
    malformed: int = 0  # bounds the scheduler could not use (the HTTP server checks them first)


@dataclass
class _Planned:
    spans: tuple[DocSpan, ...]
    recompute: Recompute = field(default_factory=Recompute)
    plan: Optional[ReusePlan] = None
    row: Optional[RowOrder] = None  # recompute modes: where the row holds which positions
    slots: Optional[torch.Tensor] = None  # private slots for [plan.start, plan.end)
    in_row: bool = False  # written into the request's row: the row frees them
    counted: bool = False
    chains: dict[int, list[ChunkNode]] = field(default_factory=dict)  # of the documents in ``plan``
    # Each document's canonical chain keys, by document index: hashed once per request,
    # all together (``S`` once), the first time any is needed; matched every pass.
    chain_keys: Optional[dict[int, list[Any]]] = None


class DocReuse:
    enabled = True  # beside reuse.disabled.NoDocReuse, the null collaborator without --pcr-doc-reuse

    def __init__(self, state: CacheState, recompute: Recompute, chunk_size: int, pad_token_id: int,
                 rope: RopeSpec, kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]], allocator: Any,
                 keyer: ChainKeyer,
                 free_slots: Callable[[torch.Tensor], None], probe: Optional[BlendProbe] = None,
                 fill_gaps: bool = False, engine: Optional[TransferEngine] = None,
                 limits: Optional[DocLimits] = None, forward_stream: Any = None,
                 mask_bytes: Optional[int] = None):
        self.state = state
        self.server = recompute
        self.mode = recompute.mode
        # What is known of the mode's accuracy on this model (doc_reuse_setup.calibration_status).
        self.calibration: dict[str, Any] = {"file": None, "measured": False}
        # What a calibration of this server must have been measured under (reuse.setup).
        self.conditions: Optional[CalibrationConditions] = None
        # Compute a document that is not cached in place and go on reusing the ones after
        # it (a permuted row, as recompute has): needs the position-causal attention.
        self.fill_gaps = fill_gaps or recompute.mode in RECOMPUTE_MODES
        self.probe = probe  # blend's selection (built for the recompute modes)
        self.chunk = chunk_size
        self.pad_token_id = pad_token_id
        self.rope = rope
        self.kv_layers = list(kv_layers)
        self.allocator = allocator
        self.keyer = keyer  # the server's one key derivation (the scheduler side's)
        self.free_slots = free_slots
        # Re-placements go through the transfer engine where there is one (layer by layer
        # with the loads); without one (no host tier) they run at admission.
        self.engine = engine
        self.limits = limits  # the server's --pcr-doc-max-documents / --pcr-doc-min-tokens
        # SGLang's forward stream (CUDA): without an engine, a copy is ordered after the
        # forward in flight by a GPU-side wait on it (``fence_after_forward``).
        self.forward_stream = forward_stream
        # The most bytes a permuted row's own position mask may take (--pcr-position-mask-mb;
        # None: unbounded).
        self.mask_bytes = mask_bytes
        self.stats = DocReuseStats()
        self._warned_budget = False
        self._requests: dict[str, _Planned] = {}
        self._warned_malformed = False

    # ------------------------------------------------------------------ match
    def plan(self, req: PcrReq, tokens: Sequence[int], exact_len: int) -> Optional[ReusePlan]:
        """What ``req`` can reuse past its exact prefix of ``exact_len`` tokens (``tokens``:
        what SGLang matches, at most all but the last prompt token). Only looks."""
        if req is None or is_canonical_request(req):
            return None
        entry = self._requests.get(req.rid)
        if entry is not None and entry.slots is not None and not entry.in_row:
            # Loaded at an admission that did not go through (it is matched again): start over.
            self.free_slots(entry.slots)
            entry.slots = None
            entry.row = None
        if entry is None:
            try:
                asked = request_doc_reuse(req, len(req.origin_input_ids), self.server, self.limits)
            except DocBoundsError as e:
                self.stats.malformed += 1  # once: the empty entry below answers later matches
                if not self._warned_malformed:
                    self._warned_malformed = True
                    logger.warning("PCR document reuse: request %s: %s; served without document reuse", req.rid, e)
                asked = ((), Recompute())
            if asked is None:
                return None
            entry = self._requests.setdefault(req.rid, _Planned(*asked))
        if entry.slots is not None or not entry.spans:  # loaded already (a later chunk), or malformed
            return None
        chain_keys = self._chain_keys(req, entry)
        chains: dict[int, list[ChunkNode]] = {}

        def cached(span: DocSpan) -> bool:
            keys = chain_keys[span.index]
            match = self.state.match(iter(keys), touch=False)
            if match.device + match.host < len(keys):
                return False
            chains[span.index] = match.nodes
            return True

        plan = plan_reuse(entry.spans, exact_len, len(tokens), cached, fill_gaps=self.fill_gaps)
        entry.plan = with_recompute(plan, entry.spans, entry.recompute) if plan is not None else None
        entry.chains = chains
        return entry.plan

    def canonical_chain_keys(self, req: PcrReq) -> list[list[Any]]:
        """The chunk keys of the canonical chains of the documents ``req`` marked, for the
        look-ahead window: a waiting request needs them as it needs its own prefix (none
        if it does not ask for reuse, or its bounds do not fit: ``plan`` reports those)."""
        if is_canonical_request(req):
            return []
        entry = self._requests.get(req.rid)
        if entry is None:
            try:
                asked = request_doc_reuse(req, len(req.origin_input_ids), self.server, self.limits)
            except DocBoundsError:
                return []
            if asked is None:
                return []
            entry = self._requests.setdefault(req.rid, _Planned(*asked))
        if not entry.spans:
            return []
        return list(self._chain_keys(req, entry).values())

    def canonical_chain_nodes(self, req: PcrReq) -> list[list[ChunkNode]]:
        """The cached part of each canonical chain of :meth:`canonical_chain_keys` (what
        ``state.match(keys, touch=False).nodes`` gives for each), walking the chunks all
        chains share (``S``'s whole chunks) once: a step's window costs
        ``O(|S| + documents x (chunk + document))`` lookups, not ``O(documents x |S|)``."""
        chains = self.canonical_chain_keys(req)
        if not chains:
            return []
        shared = self._requests[req.rid].spans[0].start // self.chunk
        head = self.state.match(iter(chains[0][:shared]), touch=False).nodes
        if len(head) < shared:  # a miss inside S: every chain ends there
            return [list(head) for _ in chains]
        start = head[-1] if head else self.state.tree.root
        matched = []
        for keys in chains:
            nodes, node = list(head), start
            for key in keys[shared:]:  # as the tree's match walks, from S's last chunk on
                node = node.children.get(key)
                if node is None:
                    break
                nodes.append(node)
            matched.append(nodes)
        return matched

    def _chain_keys(self, req: PcrReq, entry: _Planned) -> dict[int, list[Any]]:
        """Every marked document's canonical chain keys, hashed once per request (``S``
        once for all of them) and kept in its entry: the window, ``admit_now`` and every
        match read them from there, never hashing again."""
        if entry.chain_keys is None:
            root = self.keyer.request_root(request_tenant(req))  # fixed for a request, like its tokens
            chains = canonical_chain_keys(root, req.origin_input_ids, entry.spans, self.chunk, self.pad_token_id)
            entry.chain_keys = {span.index: keys for span, keys in zip(entry.spans, chains)}
        return entry.chain_keys

    def planned(self, rid: str) -> Optional[ReusePlan]:
        entry = self._requests.get(rid)
        return entry.plan if entry is not None and entry.slots is None else None

    # ------------------------------------------------------------------ admission
    def load(self, req: PcrReq, prefix_node: ChunkNode, load_chain: Callable[[list[ChunkNode]], bool],
             evict: Callable[[int], int], fence_before_copy: Callable[[], None]) -> bool:
        """Copy the planned documents into fresh private slots (``prefix_node``: the end of
        the request's exact prefix, on the device). All or nothing. With recompute, the
        recomputed tokens' slots are freed again: the row keeps the others."""
        entry = self._requests.get(req.rid)
        if entry is None or entry.plan is None:
            return False
        entry.row = None  # laid out again below, for this plan
        plan = entry.plan
        refusal = self._over_budget(req, plan)
        if refusal is not None:  # before anything is loaded, allocated or run
            log = logger.info if self._warned_budget else logger.warning
            self._warned_budget = True
            log("PCR document reuse: request %s's documents are recomputed: %s", req.rid, refusal)
            entry.plan = None
            return False
        chains = [entry.chains[doc] for doc in dict.fromkeys(s.doc for s in plan.segments)]
        ends = [nodes[-1] for nodes in chains]
        for node in ends:
            self.state.lock(node)
        try:
            if any(not all(n.on_device or n.on_host for n in nodes) for nodes in chains):
                return self._failed(entry)
            for nodes in chains:  # host chunks of a chain come to the device like any host hit
                if not all(n.on_device for n in nodes) and not load_chain(nodes):
                    return self._failed(entry)
            if self.allocator.available_size() < plan.tokens:
                evict(plan.tokens - self.allocator.available_size())
            if self.allocator.available_size() < plan.tokens:
                return self._failed(entry)
            slots = self.allocator.alloc(plan.tokens)
            if slots is None:
                return self._failed(entry)
            slots = slots.to(torch.int64)
            if self.engine is None:
                fence_before_copy()  # the chains' loads are complete before the copy
            try:
                if plan.recompute_count or plan.gaps:
                    slots = self._keep_unrecomputed(req, entry, prefix_node, slots)
                else:
                    self._copy(plan, entry.chains, slots)
            except Exception:  # noqa: BLE001 - a failed copy or probe recomputes the request, never loses slots
                logger.exception("PCR document reuse: re-placing request %s's documents failed; they are "
                                 "recomputed", req.rid)
                self.free_slots(slots)
                entry.row = None
                return self._failed(entry)
        finally:
            for node in ends:
                self.state.unlock(node)
        for doc in dict.fromkeys(s.doc for s in plan.segments):  # reused: recently used, for the LRU
            self.state.match(iter(entry.chain_keys[doc]))
        entry.slots = slots
        return True

    def _over_budget(self, req: PcrReq, plan: ReusePlan) -> Optional[str]:
        """Why serving ``plan`` could need more scratch than reserved (None: it fits): a
        permuted row's own position mask over ``mask_bytes`` (:func:`rows.row_mask_bound`),
        or blend's probe over its budget (:meth:`BlendProbe.check_budget`). Counted."""
        if not (plan.recompute_count or plan.gaps):
            return None  # an in-order row: no position mask, no probe
        total = len(req.origin_input_ids) + len(getattr(req, "output_ids", None) or ())
        need = permuted_rows.row_mask_bound(plan.start + plan.prefix_tokens, total)
        if self.mask_bytes is not None and need > self.mask_bytes:
            self.stats.mask_over_budget += 1
            return (f"its position mask could need {need / 2**20:.0f} MiB, over --pcr-position-mask-mb "
                    f"{self.mask_bytes / 2**20:.0f}")
        if plan.recompute_count and not plan.recompute and self.probe is not None:
            selector = _effective_selector(req, plan)
            question = max(_question_end(req, plan) - plan.end, 0) if selector in QUESTION_SELECTORS else 0
            try:
                self.probe.check_budget(plan.tokens, plan.start, question)
            except ProbeBudgetError as e:
                self.stats.probe_over_budget += 1
                return str(e)
        return None

    def _keep_unrecomputed(self, req: PcrReq, entry: _Planned, prefix_node: ChunkNode,
                           slots: torch.Tensor) -> torch.Tensor:
        """Choose the recomputed tokens (``blend``: by the probe, after re-placing the
        layers it reads for every candidate), re-place the kept ones (the rest of their layers), free
        the others' slots and the gaps', and lay out the row; returns the kept tokens'
        slots, in position order."""
        plan = entry.plan
        assert plan is not None
        first_layer = 0
        if plan.recompute_count and not plan.recompute:
            assert self.probe is not None, "blend needs its probe (built at startup)"
            plan = entry.plan = replace(plan, selector=_effective_selector(req, plan))
            first_layer = self.probe.layers_read(plan.selector)
            self._copy(plan, entry.chains, slots, layers=range(first_layer))
            chosen = self._blend_selection(req, plan, prefix_node, slots)
            plan = entry.plan = replace(plan, recompute=chosen)
        keep = torch.ones(plan.tokens, dtype=torch.bool)
        keep[torch.tensor([p - plan.start for p in plan.extended_positions()], dtype=torch.int64)] = False
        self._copy(plan, entry.chains, slots, layers=range(first_layer, len(self.kv_layers)), keep=keep)
        entry.row = row_order(plan)
        # Nothing pending writes the dropped tokens' slots: no copy was queued into them but
        # the layers blend's probe read, which it already waited for (on CUDA the scheduler's
        # stream did, and the forward's stream waits for it). So they are freed without
        # the ordering a free of pending slots needs, which would make the next forward
        # wait for every pending copy. Nothing after this can fail: the caller frees all
        # of ``slots`` on an exception.
        kept = keep.nonzero().squeeze(1)
        both = _to_device(torch.cat((kept, (~keep).nonzero().squeeze(1))), slots.device)  # one host-to-device copy
        self.allocator.free(slots[both[len(kept):]])
        return slots[both[:len(kept)]]

    def _blend_selection(self, req: PcrReq, plan: ReusePlan, prefix_node: ChunkNode,
                         slots: torch.Tensor) -> tuple[int, ...]:
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
        question_ids = req.origin_input_ids[plan.end:_question_end(req, plan)] \
            if plan.selector in QUESTION_SELECTORS else []
        sizes = [plan.tokens, len(candidates), len(gaps), len(candidates), len(question_ids)]
        host = torch.cat((torch.tensor(req.origin_input_ids[plan.start:plan.end], dtype=torch.int64),
                          candidates - plan.start, gaps - plan.start, anchored.to(torch.int64),
                          torch.tensor(question_ids, dtype=torch.int64)))
        ids, offsets, gap_offsets, anchors, question = _to_device(host, device).split(sizes)  # one copy
        positions = torch.arange(plan.start, plan.end, dtype=torch.int64, device=device)
        selection = self.probe.select(ids, positions, prefix[:plan.start], slots, offsets, plan.recompute_count,
                                      anchors.bool(), plan.selector, question if len(question_ids) else None,
                                      gap_offsets)
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

    def _failed(self, entry: _Planned) -> bool:
        self.stats.load_failures += 1
        entry.plan = None
        return False

    def _copy(self, plan: ReusePlan, chains: dict[int, list[ChunkNode]], slots: torch.Tensor,
              layers: Optional[range] = None, keep: Optional[torch.Tensor] = None) -> None:
        """Each segment's canonical KV into its offset of ``slots`` (gaps get nothing), for
        ``layers`` (default all) and, with ``keep`` (a mask over the plan's tokens), only
        the kept tokens."""
        layers = layers if layers is not None else range(len(self.kv_layers))
        # Indices are built on the host (a mask on the GPU would sync) and cross to the
        # device in one pinned, non-blocking copy: positions in the documents' chains
        # (concatenated), offsets into ``slots`` and deltas. Chain slots stay on the device.
        docs = list(dict.fromkeys(s.doc for s in plan.segments))
        chain_slots = [torch.cat([n.device_value for n in chains[doc]]) for doc in docs]
        base, total = {}, 0
        for doc, values in zip(docs, chain_slots):
            base[doc], total = total, total + values.shape[0]  # shapes are host metadata: no sync
        sources, targets, deltas = [], [], []
        for segment in plan.segments:
            offset = segment.start - plan.start
            start = base[segment.doc] + segment.source_start
            source = torch.arange(start, start + segment.length, dtype=torch.int64)
            target = torch.arange(offset, offset + segment.length, dtype=torch.int64)
            if keep is not None:
                kept = keep[offset: offset + segment.length]
                source, target = source[kept], target[kept]
            sources.append(source)
            targets.append(target)
            deltas.append(torch.full((source.numel(),), segment.delta, dtype=torch.int64))
        index = torch.stack((torch.cat(sources), torch.cat(targets), torch.cat(deltas)))
        if index.shape[1] == 0 or not len(layers):
            return
        index = _to_device(index, slots.device)
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

    # ------------------------------------------------------------------ the request's row
    def private_slots(self, rid: str) -> Optional[torch.Tensor]:
        entry = self._requests.get(rid)
        return entry.slots if entry is not None and not entry.in_row else None

    def written_into_row(self, req: PcrReq) -> None:
        """``alloc_for_extend`` wrote the private slots into ``req``'s row: the row owns them."""
        entry = self._requests.get(req.rid)
        if entry is None or entry.slots is None or entry.in_row:
            return
        entry.in_row = True
        if not entry.counted and entry.plan is not None:
            entry.counted = True
            plan = entry.plan
            self.stats.requests += 1
            self.stats.docs_marked += len(entry.spans)
            self.stats.docs_reused += plan.docs
            self.stats.tokens_reused += plan.prefix_tokens
            self.stats.tokens_rotated += plan.rotated_tokens - plan.recompute_count
            self.stats.tokens_recomputed += plan.recompute_count
            self.stats.gap_tokens += plan.gap_tokens

    def reused(self, rid: str) -> Optional[ReusePlan]:
        """The plan ``rid`` was loaded with, if any."""
        entry = self._requests.get(rid)
        return entry.plan if entry is not None and entry.slots is not None else None

    def row(self, rid: str) -> Optional[RowOrder]:
        """Where a recompute request's row holds which positions (None: in order)."""
        entry = self._requests.get(rid)
        return entry.row if entry is not None and entry.slots is not None else None

    def exact_end(self, rid: str) -> Optional[int]:
        """Past this position the request's KV is blended: never checkpointed."""
        entry = self._requests.get(rid)
        if entry is None or entry.slots is None or entry.plan is None:
            return None
        return entry.plan.exact_end

    def release(self, rid: str, keep_row_state: bool = False) -> None:
        """``rid`` left. Unused private slots are freed; with ``keep_row_state`` a request
        whose row holds them keeps its entry (``exact_end`` caps the row's checkpoint)."""
        entry = self._requests.get(rid)
        if entry is None:
            return
        if entry.in_row and keep_row_state:
            return
        del self._requests[rid]
        if entry.slots is not None and not entry.in_row:
            self.free_slots(entry.slots)  # loaded, but the request never got its row

    def reset(self) -> None:
        self._requests.clear()

    def forget_keys(self) -> None:
        """The namespace moved (the weights changed): every waiting request's canonical
        chain keys are derived again, under the new namespace, when next needed."""
        for entry in self._requests.values():
            entry.chain_keys = None

    def fence_after_forward(self) -> bool:
        """Fence a copy on the current stream behind the forward in flight (CUDA), by a
        GPU-side wait on SGLang's forward stream: the scheduler thread does not wait.
        False when that stream is not known (the caller must wait for the device)."""
        if self.forward_stream is None:
            return False
        current = torch.cuda.current_stream()
        if self.forward_stream != current:
            current.wait_stream(self.forward_stream)
        return True

    def count_canonical(self) -> None:
        self.stats.canonical_requests += 1


def _question_end(req: PcrReq, plan: ReusePlan) -> int:
    """Where the question selectors' question ends: the request's mark, else its input's end."""
    return min(len(req.origin_input_ids), plan.question_end or len(req.origin_input_ids))


def _effective_selector(req: PcrReq, plan: ReusePlan) -> str:
    """The plan's selector, but ``deviation`` for a question selector with no question
    after the documents (nothing to rank by): decided once, before the layers it reads are
    copied."""
    if plan.selector in QUESTION_SELECTORS and _question_end(req, plan) <= plan.end:
        return "deviation"
    return plan.selector


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host integer tensor on ``device``: on CUDA through the pinned ring allocated once
    (:func:`rows.to_device`), non-blocking: a pageable copy would make the scheduler thread
    wait for the stream, i.e. for the forward in flight, and a ``pin_memory()`` per
    admission allocates pinned memory in the scheduler step."""
    return permuted_rows.to_device(host, device).view(host.shape)
