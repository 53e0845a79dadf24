"""The collectives PCR's agreement needs, over the ranks that share one scheduling decision.

A request's prefix length must be the same on every rank of its attention tensor- (and
context-) parallel group. SGLang hands a tree cache those groups' CPU (gloo) process
groups; like HiCache (``UnifiedRadixCache._all_reduce_attn_groups``) PCR reduces over
the attention CP and TP groups, or over the whole TP group when neither is wider than
one rank. On one rank there is no group and nothing to agree.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)


class TpGroup:
    def __init__(self, groups: list[Any]):
        self._groups = groups
        self.size = 1
        for group in groups:
            self.size *= torch.distributed.get_world_size(group=group)

    @classmethod
    def from_cache_params(cls, params: Any) -> Optional[TpGroup]:
        """The group of ``CacheInitParams``' ranks, or None when the cache runs alone."""
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return None
        wide = [
            g
            for g in (getattr(params, "attn_cp_cache_group", None), getattr(params, "attn_tp_cache_group", None))
            if g is not None and torch.distributed.get_world_size(group=g) > 1
        ]
        if not wide:
            tp = getattr(params, "tp_cache_group", None)
            if tp is not None and torch.distributed.get_world_size(group=tp) > 1:
                wide = [tp]
        return cls(wide) if wide else None

    def reduce_min(self, values: list[int]) -> list[int]:
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.int64)
        for group in self._groups:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=group)
        return tensor.tolist()

    def intersect(self, items: set[Any]) -> set[Any]:
        """The items every rank has (startup only: it gathers every rank's whole set)."""
        common = set(items)
        for group in self._groups:
            gathered: list[Any] = [None] * torch.distributed.get_world_size(group=group)
            torch.distributed.all_gather_object(gathered, sorted(common), group=group)
            for other in gathered:
                common &= set(other)
        return common


def min_max(tp: TpGroup, value: int) -> tuple[int, int]:
    """The smallest and the largest ``value`` the ranks passed (one collective over
    ``tp.reduce_min``: a MIN of it and of its negation); equal when every rank passed the same."""
    low, negated_high = tp.reduce_min([value, -value])
    return low, -negated_high
