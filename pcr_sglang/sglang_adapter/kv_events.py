"""SGLang's KV cache events (``--kv-events-config``) for PCR's tree.

SGLang's scheduler publishes, every step, what its tree cache's ``take_events()`` returns:
``BlockStored`` (block hashes, the parent block's hash, the blocks' token ids, a medium),
``BlockRemoved`` and ``AllBlocksCleared``, which event-driven routers (Dynamo's KV router,
SGLang Model Gateway's event-driven cache-aware policy) index to route a prompt to the
worker holding its longest prefix. Here a block is one PCR chunk:

* ``block_size`` is ``--pcr-chunk-size`` (``/server_info``'s ``kv_events.block_size`` and
  the event sources advertised to gRPC routers say so too: PCR's plugin corrects SGLang's,
  which report the page size);
* a block's hash is the first 8 bytes of its chunk key (signed, big-endian), and its
  parent's is its parent chunk's: the keys already chain the namespace (model, dtype,
  layout), the cache salt and the extra key, so two tenants' blocks never share a hash
  in either event format;
* the medium is the tier: ``GPU`` for the device pool, ``CPU_PINNED`` for the host tier,
  ``DISK`` for the local SSD store, ``EXTERNAL`` for a chunk a probe found in the remote
  tier (``--pcr-remote``) that this server has not read yet (once read, it moves to
  ``DISK``: the I/O process keeps a local copy).

The tree logs its residency changes (:mod:`pcr_sglang.core.tier_events`); this class
turns them into SGLang's events. A ``BlockStored`` needs the block's tokens, which the
tree does not keep: the prefix cache tells this class the tokens of every chain it
inserts or matches. A chunk whose tokens are not known yet (restored from the SSD store
at startup, nothing has asked for it since) is announced when they are; a tier it left
before that is never announced, and so never removed either. ``/flush_cache`` publishes
``AllBlocksCleared``, then the persisted chunks it keeps as stored on ``DISK`` again.
What is kept per chunk (its tokens, parent, tiers held and announced) is dropped when
the chunk leaves the tree: with events on, it costs about 200 bytes plus 4 per token for
each chunk in the tree (260 bytes for 16-token chunks, 450 for 64-token ones, measured
with tracemalloc).
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence, cast

from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, StorageMedium
from sglang.srt.mem_cache.events import KVCacheEventRecorder

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree
from pcr_sglang.core.keys import ChunkKey
from pcr_sglang.core.tier_events import Tier, TierEventKind, TierEventLog

logger = logging.getLogger(__name__)

MEDIUM = {
    Tier.DEVICE: StorageMedium.GPU,
    Tier.HOST: StorageMedium.CPU,
    Tier.SSD: StorageMedium.DISK,
    Tier.REMOTE: StorageMedium.EXTERNAL,
}
TIERS = (Tier.DEVICE, Tier.HOST, Tier.SSD, Tier.REMOTE)  # announced in this order: the fastest first


def block_hash(key: ChunkKey) -> int:
    """A chunk's block hash in the events: its key's first 8 bytes as a signed int64."""
    return int.from_bytes(key[:8], "big", signed=True)


@dataclass(slots=True)
class _Chunk:
    parent_key: Optional[ChunkKey]
    tokens: Optional[array[int]] = None
    cache_salt: Optional[str] = None
    held: Tier = Tier(0)  # the tiers the tree says hold it
    announced: Tier = Tier(0)  # the tiers a BlockStored was published for


@dataclass
class KvEventStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0


class PCRKvEvents:
    """The tree cache's ``kv_events``: SGLang calls :meth:`take` once per step."""

    def __init__(self, tree: ChunkTree, chunk_size: int):
        self.chunk_size = chunk_size
        self.log = TierEventLog()
        tree.events = self.log
        # SGLang's recorder only for its queue: it coalesces a chain's stores into one
        # event as it does for the radix cache.
        self._out = KVCacheEventRecorder(enabled=True, page_size=chunk_size)
        self._chunks: dict[ChunkKey, _Chunk] = {}
        self.stats = KvEventStats()

    def learn(self, nodes: Sequence[ChunkNode], tokens: Sequence[int], cache_salt: Optional[str]) -> None:
        """``nodes`` (a chain from the first chunk on) hold ``tokens``, chunk by chunk."""
        self._drain()
        size = self.chunk_size
        for i, node in enumerate(nodes):
            chunk = self._chunks.get(node.key)
            if chunk is None or chunk.tokens is not None:
                continue
            chunk.tokens = array("i", tokens[i * size : (i + 1) * size])
            chunk.cache_salt = cache_salt
            for tier in TIERS:
                if chunk.held & tier:
                    self._announce(node.key, chunk, tier)

    def take(self) -> list[Any]:
        self._drain()
        return cast("list[Any]", self._out.take())  # SGLang's events (SGLang ships no types)

    def report(self) -> dict[str, Any]:
        """For ``/server_info``: blocks published, and chunks held whose tokens are not
        known yet (not announced)."""
        self._drain()
        unannounced = sum(1 for c in self._chunks.values() if c.held and c.tokens is None)
        return {**asdict(self.stats), "chunks": len(self._chunks), "unannounced_chunks": unannounced}

    # ------------------------------------------------------------------ internals
    def _drain(self) -> None:
        cleared = False
        for event in self.log.take():
            if event.kind is TierEventKind.STORED:
                assert event.tier is not None  # STORED and REMOVED name their tier
                chunk = self._chunks.get(event.key)
                if chunk is None:
                    chunk = self._chunks[event.key] = _Chunk(event.parent_key)
                chunk.held |= event.tier
                if chunk.tokens is not None:
                    self._announce(event.key, chunk, event.tier)
            elif event.kind is TierEventKind.REMOVED:
                assert event.tier is not None
                chunk = self._chunks.get(event.key)
                if chunk is None:
                    continue
                chunk.held &= ~event.tier
                if chunk.announced & event.tier:
                    chunk.announced &= ~event.tier
                    self._out.enqueue(BlockRemoved(block_hashes=[block_hash(event.key)], medium=MEDIUM[event.tier]))
                    self.stats.removed_blocks += 1
            elif event.kind is TierEventKind.FORGOTTEN:
                self._chunks.pop(event.key, None)
            else:  # CLEARED: tokens are kept for the chunks the reset puts back (persisted ones)
                for chunk in self._chunks.values():
                    # mutant: kv-events-reset-remembers-what-it-announced
                    chunk.held = chunk.announced = Tier(0)
                self._out.record_all_cleared()
                self.stats.clears += 1
                cleared = True
        if cleared:  # what the reset did not put back is gone
            self._chunks = {k: c for k, c in self._chunks.items() if c.held}

    def _announce(self, key: ChunkKey, chunk: _Chunk, tier: Tier) -> None:
        if chunk.announced & tier:
            return
        chunk.announced |= tier
        assert chunk.tokens is not None  # announced once its tokens are known
        self._out.enqueue(
            BlockStored(
                block_hashes=[block_hash(key)],
                parent_block_hash=block_hash(chunk.parent_key) if chunk.parent_key is not None else None,
                token_ids=list(chunk.tokens),
                block_size=self.chunk_size,
                lora_id=None,
                medium=MEDIUM[tier],
                cache_salt=chunk.cache_salt,
            )
        )
        self.stats.stored_blocks += 1
