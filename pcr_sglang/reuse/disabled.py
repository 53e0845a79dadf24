"""Document reuse turned off: the null collaborator the scheduler side holds without ``--pcr-doc-reuse``.

Every question the adapter asks document reuse through its seam
(:class:`~pcr_sglang.reuse.seam.DocReuseSeam`) has a "nothing to reuse" answer, given here,
so the adapter asks it unconditionally instead of testing for a missing collaborator at
each call: no request has a plan or private slots, no document chain is needed, no row is
permuted, and a load of documents never happens. What the server reports of the feature
(:class:`~pcr_sglang.reuse.seam.DocReuseStatus`) is absent instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    import torch

    from pcr_sglang.core.chunk_tree import ChunkNode
    from pcr_sglang.core.keys import ChunkKey
    from pcr_sglang.req import PcrReq
    from pcr_sglang.reuse.plan import ReusePlan, RowOrder
    from pcr_sglang.reuse.seam import DocLoad


class NoDocReuse:
    fill_gaps = False  # no request's row is ever permuted
    mask_bytes: Optional[int] = None  # so no position mask, and no budget for one

    def canonical_chain_keys(self, req: PcrReq) -> list[list[ChunkKey]]:
        return []

    def canonical_chain_nodes(self, req: PcrReq) -> list[list[ChunkNode]]:
        return []

    def plan(self, req: PcrReq, tokens: Sequence[int], exact_len: int) -> Optional[ReusePlan]:
        return None

    def planned(self, rid: str) -> Optional[ReusePlan]:
        return None

    def reused(self, rid: str) -> Optional[ReusePlan]:
        return None

    def row(self, rid: str) -> Optional[RowOrder]:
        return None

    def exact_end(self, rid: str) -> Optional[int]:
        return None

    def private_slots(self, rid: str) -> Optional[torch.Tensor]:
        return None

    def load(self, req: PcrReq) -> Optional[DocLoad]:
        return None

    def place(self, req: PcrReq, prefix_node: ChunkNode, slots: Optional[torch.Tensor]) -> bool:
        return False

    def defer(self, rid: str) -> None:
        return None

    def fence_after_forward(self) -> bool:
        return False

    def written_into_row(self, req: PcrReq) -> None:
        pass

    def count_canonical(self) -> None:
        pass

    def release(self, rid: str, keep_row_state: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def forget_keys(self) -> None:
        pass
