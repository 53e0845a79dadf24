"""The PCR cache's core: chunk keys, the chunk tree, and the one owner of cache state.

Nothing here imports SGLang or torch: the core is tested alone and reused by the
benchmarks' simulators. :class:`~pcr_sglang.core.residency.CacheState` owns every
chunk's residency and every host slot's state; the adapter in
``pcr_sglang.sglang_adapter`` maps SGLang's requests and KV pool onto it and executes
the work it decides (:class:`~pcr_sglang.core.effects.Effects`).
"""

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree, InsertOutcome, MatchOutcome
from pcr_sglang.core.effects import ChainMatch, Effects
from pcr_sglang.core.keys import CacheNamespace, ChunkKey, chunk_keys, root_key
from pcr_sglang.core.orders import IoOutcome
from pcr_sglang.core.residency import CacheState, CacheStateConfig
from pcr_sglang.core.ssd_residency import PersistedChunk
from pcr_sglang.core.stats import CacheStats, SSDStats

__all__ = [
    "CacheNamespace",
    "CacheState",
    "CacheStateConfig",
    "CacheStats",
    "ChainMatch",
    "ChunkKey",
    "ChunkNode",
    "ChunkTree",
    "Effects",
    "InsertOutcome",
    "IoOutcome",
    "MatchOutcome",
    "PersistedChunk",
    "SSDStats",
    "chunk_keys",
    "root_key",
]
