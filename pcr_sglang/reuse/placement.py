"""Document KV reuse on the scheduler's side: plan at match, copy and rotate at admission.

A request opts in with ``sampling_params.custom_params["pcr_doc_bounds"]`` (see
:mod:`pcr_sglang.reuse.plan`). SGLang's tree-cache protocol carries the reuse the way
it carries a host hit, so its admission budget, locks and row writing apply unchanged.
The adapter asks in this order (the protocol is :class:`~pcr_sglang.reuse.seam.SchedulerDocReuse`,
in the manner of vLLM's scheduler-side KV connector: the scheduler allocates, the connector fills):

* :meth:`DocReuse.plan` (from ``match_prefix``, only looking): past the exact prefix, the documents
  whose canonical chain ``S ‖ d ‖ pad`` is in device or host memory, reported in ``host_hit_length``;
* :meth:`DocReuse.load` (from ``init_load_back``, under the adder's budget): what admission
  provides first (:class:`~pcr_sglang.reuse.seam.DocLoad`): the chains locked and on the
  device, fresh slots for the copy, its fence; no room yet: :meth:`DocReuse.defer`;
* :meth:`DocReuse.place`: each document's KV copied into those slots, the request's own, K
  rotated by the position delta (:mod:`pcr_sglang.reuse.doc_copy`): with a transfer engine,
  layer by layer with the chains' loads, before the forward reads each layer
  (:meth:`pcr_sglang.transfer.engine.TransferEngine.replace`), only the tokens the
  request keeps (``blend`` rotates the first layers of every candidate first, those its
  selector's probe reads: 0-1, 0-2 for ``gradual``, 0-4 for ``prophet``);
* ``prefix_device_indices`` appends those private slots to the tree path, so
  ``alloc_for_extend`` writes them into the request's row, which frees them like any slot
  past ``cache_protected_len`` (:meth:`DocReuse.written_into_row`, :meth:`DocReuse.release`);
* checkpoints stop at the plan's ``exact_end``: blended KV never enters the tree;
* recompute modes (``lego``, ``blend``) keep only part of the re-placed tokens: the
  recomputed ones' slots are freed at admission, and they are extended at their true
  positions behind the kept ones (:class:`pcr_sglang.reuse.plan.RowOrder`,
  :mod:`pcr_sglang.reuse.rows`); ``blend`` picks them with its probe
  (:mod:`pcr_sglang.reuse.blend_select`);
* with ``fill_gaps`` (every mode where the attention takes permuted rows), a document not
  cached, between reused ones, is extended in place the same way; those after it are reused.

The cache state still owns every tree chunk: this module reads residency and frees only
its private slots; admission locks, loads, evicts and allocates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.keys import ChainKeyer, ChunkKey
from pcr_sglang.core.residency import CacheState
from pcr_sglang.req import PcrReq, request_tenant
from pcr_sglang.reuse.batch_mask import needs_position_mask, own_mask_bound
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
from pcr_sglang.reuse.doc_copy import DocCopier, effective_selector, question_end
from pcr_sglang.reuse.doc_stats import DocReuseStats
from pcr_sglang.reuse.plan import ReusePlan, RowOrder, canonical_chain_keys, plan_reuse, with_recompute
from pcr_sglang.reuse.seam import DocLoad
from pcr_sglang.reuse.selectors import QUESTION_SELECTORS
from pcr_sglang.transfer.engine import TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec

__all__ = ["DocReuse", "DocReuseStats"]

logger = logging.getLogger(__name__)


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
    chain_keys: Optional[dict[int, list[ChunkKey]]] = None


class DocReuse:
    enabled = True  # beside reuse.disabled.NoDocReuse, the null collaborator without --pcr-doc-reuse

    def __init__(
        self,
        state: CacheState,
        recompute: Recompute,
        chunk_size: int,
        pad_token_id: int,
        rope: RopeSpec,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        allocator: Any,
        keyer: ChainKeyer,
        free_slots: Callable[[torch.Tensor], None],
        probe: Optional[BlendProbe] = None,
        fill_gaps: bool = False,
        engine: Optional[TransferEngine] = None,
        limits: Optional[DocLimits] = None,
        forward_stream: Any = None,
        mask_bytes: Optional[int] = None,
    ):
        self.state = state
        self.server = recompute
        self.mode = recompute.mode
        # What is known of the mode's accuracy on this model (doc_reuse_setup.calibration_status).
        self.calibration: dict[str, Any] = {"file": None, "measured": False}
        # What a calibration of this server must have been measured under (reuse.setup).
        self.conditions: Optional[CalibrationConditions] = None
        # Compute an uncached document in place, reusing those after it (a permuted row).
        self.fill_gaps = fill_gaps or recompute.mode in RECOMPUTE_MODES
        self.probe = probe  # blend's selection (built for the recompute modes)
        self.chunk = chunk_size
        self.pad_token_id = pad_token_id
        self.rope = rope
        self.keyer = keyer  # the server's one key derivation (the scheduler side's)
        self.free_slots = free_slots
        # Re-placed layer by layer with the loads by a transfer engine; without one, at admission.
        self.engine = engine
        self.limits = limits  # the server's --pcr-doc-max-documents / --pcr-doc-min-tokens
        # SGLang's forward stream (CUDA): without an engine, a copy is ordered after the
        # forward in flight by a GPU-side wait on it (``fence_after_forward``).
        self.forward_stream = forward_stream
        # The most bytes a forward's position mask may take (--pcr-position-mask-mb; None: no
        # budget): a permuted row's own part is checked here, the batch's at admission (batch_mask).
        self.mask_bytes = mask_bytes
        self.stats = DocReuseStats()
        # Fills the slots admission allocated for a load (the pool's ``kv_layers``; the
        # allocator takes back the tokens a recompute plan drops).
        self.copier = DocCopier(kv_layers, rope, allocator, engine, probe)
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

    def canonical_chain_keys(self, req: PcrReq) -> list[list[ChunkKey]]:
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
                child = node.children.get(key)
                if child is None:
                    break
                nodes.append(child)
                node = child
            matched.append(nodes)
        return matched

    def _chain_keys(self, req: PcrReq, entry: _Planned) -> dict[int, list[ChunkKey]]:
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
    def load(self, req: PcrReq) -> Optional[DocLoad]:
        """``init_load_back``: what admission must provide before ``req``'s planned
        documents are copied (its chains locked and on the device, fresh slots, a fence),
        to hand the slots to :meth:`place` then. None when nothing is to be loaded: no
        plan, a reuse that could need more scratch than reserved (refused before anything
        is loaded, allocated or run), or a chain no longer in device or host memory
        (counted as a load failure): the documents are recomputed."""
        entry = self._requests.get(req.rid)
        if entry is None or entry.plan is None:
            return None
        entry.row = None  # laid out again at :meth:`place`, for this plan
        plan = entry.plan
        # mutant: gpu-scratch-budgets-checked-only-once-copying
        refusal = self._over_budget(req, plan)
        if refusal is not None:  # before anything is loaded, allocated or run
            log = logger.info if self._warned_budget else logger.warning
            self._warned_budget = True
            log("PCR document reuse: request %s's documents are recomputed: %s", req.rid, refusal)
            entry.plan = None
            return None
        chains = [entry.chains[doc] for doc in dict.fromkeys(s.doc for s in plan.segments)]
        if any(not all(n.on_device or n.on_host for n in nodes) for nodes in chains):
            self._failed(entry)
            return None
        return DocLoad(chains, plan.tokens, fence=self.engine is None)

    def place(self, req: PcrReq, prefix_node: ChunkNode, slots: Optional[torch.Tensor]) -> bool:
        """Copy ``req``'s planned documents into ``slots``, fresh private slots admission
        allocated for its :meth:`load` with the chains on the device (``prefix_node``: the
        end of the request's exact prefix, on the device). All or nothing: without
        ``slots`` (a chain could not be loaded, or no room) or when the copy fails, the
        documents are recomputed, counted as a load failure, and no slot is kept. With
        recompute, the recomputed tokens' slots are freed again: the row keeps the others."""
        entry = self._requests.get(req.rid)
        if entry is None or entry.plan is None:  # place follows a load of the same plan: a slip, but no leak
            if slots is not None:
                self.free_slots(slots)
            raise AssertionError(f"PCR document reuse: {req.rid} placed without a planned load")
        if slots is None:
            return self._failed(entry)
        slots = slots.to(torch.int64)
        try:
            placed = self.copier.place(req, entry.plan, entry.chains, prefix_node, slots)
        except Exception:  # noqa: BLE001 - a failed copy or probe recomputes the request, never loses slots
            logger.exception("PCR document reuse: re-placing request %s's documents failed; recomputed", req.rid)
            self.free_slots(slots)
            entry.row = None
            return self._failed(entry)
        entry.plan, entry.row = placed.plan, placed.row
        chain_keys = self._chain_keys(req, entry)
        for doc in dict.fromkeys(s.doc for s in placed.plan.segments):  # reused: recently used, for the LRU
            self.state.match(iter(chain_keys[doc]))
        entry.slots = placed.slots
        return True

    def _over_budget(self, req: PcrReq, plan: ReusePlan) -> Optional[str]:
        """Why serving ``plan`` could need more scratch than reserved (None: it fits): a
        permuted row's own position mask over ``mask_bytes`` (:func:`batch_mask.own_mask_bound`),
        or blend's probe over its budget (:meth:`BlendProbe.check_budget`). Counted."""
        if not needs_position_mask(plan):
            return None  # an in-order row: no position mask, no probe
        need = own_mask_bound(req, plan)
        # mutant: gpu-position-mask-unbounded
        if self.mask_bytes is not None and need > self.mask_bytes:
            self.stats.mask_over_budget += 1
            return (
                f"its position mask could need {need / 2**20:.0f} MiB, over --pcr-position-mask-mb "
                f"{self.mask_bytes / 2**20:.0f}"
            )
        if plan.recompute_count and not plan.recompute and self.probe is not None:
            selector = effective_selector(req, plan)
            question = max(question_end(req, plan) - plan.end, 0) if selector in QUESTION_SELECTORS else 0
            try:
                self.probe.check_budget(plan.tokens, plan.start, question)
            except ProbeBudgetError as e:
                self.stats.probe_over_budget += 1
                return str(e)
        return None

    def defer(self, rid: str) -> None:
        """No device room for ``rid``'s planned load this pass: it waits for the next one
        (others in flight free some), counted, and is planned again at its next match."""
        entry = self._requests.get(rid)
        if entry is not None and entry.plan is not None:
            self.stats.load_deferred += 1
            entry.plan = entry.row = None

    def _failed(self, entry: _Planned) -> bool:
        self.stats.load_failures += 1
        entry.plan = None
        return False

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
            self.stats.count_admitted(entry.plan, len(entry.spans))

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
