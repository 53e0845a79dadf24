"""Document reuse turned off: the null collaborator the scheduler side holds without ``--pcr-doc-reuse``.

Every question the adapter asks :class:`~pcr_sglang.reuse.placement.DocReuse` has a
"nothing to reuse" answer, given here, so the adapter asks it unconditionally instead of
testing for a missing collaborator at each call: no request has a plan or private slots,
no document chain is needed, no row is permuted, and a load of documents never happens.
``enabled`` is False for what reports the feature (``/server_info``, metrics).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pcr_sglang.req import PcrReq


class NoDocReuse:
    enabled = False
    fill_gaps = False  # no request's row is ever permuted
    stats = None
    conditions = None

    def canonical_chain_keys(self, req: PcrReq) -> list[list[bytes]]:
        return []

    def canonical_chain_nodes(self, req: PcrReq) -> list[list[Any]]:
        return []

    def plan(self, req: PcrReq, tokens: Sequence[int], exact_len: int) -> None:
        return None

    def planned(self, rid: str) -> None:
        return None

    def reused(self, rid: str) -> None:
        return None

    def exact_end(self, rid: str) -> Optional[int]:
        return None

    def private_slots(self, rid: str) -> None:
        return None

    def load(self, *args: Any) -> bool:
        return False

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
