"""What a :class:`~pcr_sglang.core.residency.CacheState` is sized and tuned by: its tiers'
capacities, the write-back policy and the read budgets (built from the flags by the
adapter's factory).
"""

from __future__ import annotations

from dataclasses import dataclass

# Share of the host tier that decode-time offloads may hold reserved at once. A chunk a
# decode step completes enters the tree only when its request finishes, so its slot is
# outside the tree (not evictable) for the rest of the generation: unbounded, long
# generations would take every free slot. A quarter, next to prefetch reads' half
# (:meth:`CacheState.plan_prefetch`), leaves at least a quarter to the tree's host chunks,
# prefill offloads and demotions. A chunk over the share is simply not offloaded: it stays
# device-resident in the tree when its request ends (as with the radix cache) and is
# copied to host memory if eviction takes it off the device later.
DECODE_OFFLOAD_SHARE = 0.25


@dataclass(frozen=True)
class CacheStateConfig:
    chunk_size: int
    lookahead_window: int = 8
    host_slots: int = 0  # 0: no host tier
    chunk_bytes: int = 0  # bytes of one chunk in host memory (for the transfer counters)
    ssd_capacity_chunks: int = 0  # 0: no SSD tier
    write_through: bool = True
    prefetch_budget_chunks: int = 0
    hint_budget_chunks: int = 0  # most chunks read for KV hints and held (in flight or landed, unused)
    decode_offload_share: float = DECODE_OFFLOAD_SHARE
