"""The PCR cache's core: chunk keys, the chunk tree and its eviction order.

Nothing here imports SGLang (or torch): the core is tested alone and reused by the
benchmark's simulator. The adapter in ``pcr_sglang.sglang_adapter`` owns the mapping from
SGLang's requests and KV pool to these structures.
"""

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree, InsertOutcome, MatchOutcome
from pcr_sglang.core.keys import CacheNamespace, ChunkKey, chunk_keys, root_key

__all__ = [
    "CacheNamespace",
    "ChunkKey",
    "ChunkNode",
    "ChunkTree",
    "InsertOutcome",
    "MatchOutcome",
    "chunk_keys",
    "root_key",
]
