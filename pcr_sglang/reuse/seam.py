"""The seam between the SGLang adapter and document reuse: what the adapter may ask, by role.

The adapter holds document reuse as one of these faces, never as the concrete class, so
what crosses the seam is written here, typed, and nowhere else (in the manner of vLLM's
KV connector, whose interface is split by the process that calls it):

* :class:`SchedulerDocReuse`, the scheduler's half, in the order a request meets it: at
  match it is planned (only looking: a match may run many times for one request, and a
  plan changes nothing the tree or the allocator holds), the look-ahead window and
  admission ask which canonical chains it needs, admission asks what its load needs
  (a :class:`DocLoad`, data: no callback crosses the seam), provides it (locks, host
  loads, eviction, fresh slots, a fence) and hands the slots back to be placed into (all
  or nothing), the row written for its first extend owns its private slots, and it is
  released when it leaves. A flush forgets every plan; a weight update every derived key.
* :class:`DocReuseRows`, the forward's half: whether any row is permuted at all, where a
  request's permuted row holds which positions, and the budget of a forward's position mask.
* :class:`DocReuseStatus`, what the server reports of the feature (``/server_info``, the
  metrics, the calibration recheck after a weight update): only where it is on.

:class:`~pcr_sglang.reuse.placement.DocReuse` implements all three, and
:class:`~pcr_sglang.reuse.disabled.NoDocReuse` the first two with "nothing to reuse"
answers, so the adapter asks them unconditionally; mypy checks both against this module
where the factory and the scheduler loop hand them over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from pcr_sglang.core.chunk_tree import ChunkNode
    from pcr_sglang.core.keys import ChunkKey
    from pcr_sglang.req import PcrReq
    from pcr_sglang.reuse.bounds import Recompute
    from pcr_sglang.reuse.calibration import CalibrationConditions
    from pcr_sglang.reuse.doc_stats import DocReuseStats
    from pcr_sglang.reuse.plan import ReusePlan, RowOrder
    from pcr_sglang.transfer.rope_shift import RopeSpec


@dataclass(frozen=True)
class DocLoad:
    """What admission provides before a request's planned documents are copied
    (:meth:`SchedulerDocReuse.load`), in this order: each chain locked (at its end) until
    the documents are placed; each chain's host chunks brought to the device like any host
    hit (a failure ends the load); ``tokens`` fresh device slots, evicting for them; with
    ``fence`` (no transfer engine orders the copy layer by layer: it runs at admission, on
    the scheduler's stream) the chains' loads and the forward in flight ordered before it.
    Then :meth:`SchedulerDocReuse.place` gets the slots, or None where a step failed."""

    chains: list[list[ChunkNode]]  # each reused document's canonical chain, first chunk first
    tokens: int  # fresh device slots the copy takes: one per token of the plan
    fence: bool

    @property
    def ends(self) -> list[ChunkNode]:
        """The chunks whose locks keep every chain in place while it is loaded and copied from."""
        return [nodes[-1] for nodes in self.chains]


class SchedulerDocReuse(Protocol):
    """Document reuse on the scheduler's side: a request's plan, its chains, its load and release."""

    # ------------------------------------------------------------------ match (only looks)
    def plan(self, req: PcrReq, tokens: Sequence[int], exact_len: int) -> Optional[ReusePlan]:
        """What ``req`` can reuse past its exact prefix of ``exact_len`` tokens (``match_prefix``)."""

    def canonical_chain_keys(self, req: PcrReq) -> list[list[ChunkKey]]:
        """The keys of the canonical chains of the documents ``req`` marked (none if it asks no reuse)."""

    def canonical_chain_nodes(self, req: PcrReq) -> list[list[ChunkNode]]:
        """The cached part of each chain of :meth:`canonical_chain_keys`."""

    def planned(self, rid: str) -> Optional[ReusePlan]:
        """The plan the last match made for ``rid``, while it is not loaded."""

    # ------------------------------------------------------------------ admission
    def load(self, req: PcrReq) -> Optional[DocLoad]:
        """``init_load_back``: what admission must provide before the planned documents are
        copied (None: nothing to load, the documents are recomputed)."""

    def place(self, req: PcrReq, prefix_node: ChunkNode, slots: Optional[torch.Tensor]) -> bool:
        """Copy the documents of ``req``'s :class:`DocLoad` into ``slots`` (its fresh slots,
        None where admission could not provide them), past ``prefix_node`` (the end of the
        exact prefix, on the device). All or nothing: True when the request's reuse is loaded."""

    def defer(self, rid: str) -> None:
        """``rid``'s planned load found no device room this pass and waits for the next
        (counted): it is matched and planned again then."""

    def fence_after_forward(self) -> bool:
        """Order a copy on the current stream after the forward in flight; False when that
        stream is unknown (the caller waits for the device)."""

    def private_slots(self, rid: str) -> Optional[torch.Tensor]:
        """The slots ``rid``'s documents were loaded into, until its row holds them."""

    def written_into_row(self, req: PcrReq) -> None:
        """``prepare_for_extend`` wrote ``req``'s private slots into its row: the row owns them."""

    def reused(self, rid: str) -> Optional[ReusePlan]:
        """The plan ``rid`` was loaded with, if any."""

    def exact_end(self, rid: str) -> Optional[int]:
        """Past this position ``rid``'s KV is blended: never checkpointed nor offloaded."""

    def count_canonical(self) -> None:
        """A canonical prefill (``S ‖ d ‖ pad``) was admitted."""

    # ------------------------------------------------------------------ leave, flush, rekey
    def release(self, rid: str, keep_row_state: bool = False) -> None:
        """``rid`` left: unused private slots are freed (``keep_row_state``: its row still holds them)."""

    def reset(self) -> None:
        """``/flush_cache``: forget every request's plan."""

    def forget_keys(self) -> None:
        """The namespace moved: canonical chain keys are derived again when next needed."""


class DocReuseRows(Protocol):
    """Document reuse on the forward's side: which rows are permuted, and how."""

    @property
    def fill_gaps(self) -> bool:
        """Some request's row may be permuted (False: no row ever is, nothing to look up)."""

    @property
    def mask_bytes(self) -> Optional[int]:
        """The most bytes a forward's position mask may take (``--pcr-position-mask-mb``;
        None: no row is ever permuted, no budget applies)."""

    def row(self, rid: str) -> Optional[RowOrder]:
        """Where ``rid``'s row holds which positions (None: in order)."""


class DocReuseSeam(SchedulerDocReuse, DocReuseRows, Protocol):
    """Both halves: what the scheduler loop holds (its collaborators get the scheduler's half)."""


class DocReuseStatus(Protocol):
    """What the server reports of document reuse where it is on (``/server_info``, the
    metrics, the calibration recheck after a weight update)."""

    @property
    def mode(self) -> str: ...

    @property
    def rope(self) -> RopeSpec: ...

    @property
    def fill_gaps(self) -> bool: ...

    @property
    def server(self) -> Recompute:
        """The server's settings (and its calibration gate, with one)."""

    @property
    def calibration(self) -> dict[str, Any]:
        """What is known of the mode's accuracy on this model (updated by a recheck)."""

    @property
    def conditions(self) -> Optional[CalibrationConditions]: ...

    @property
    def stats(self) -> DocReuseStats: ...
