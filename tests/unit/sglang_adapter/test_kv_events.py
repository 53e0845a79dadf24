"""SGLang's KV cache events for PCR's tree (``sglang_adapter/kv_events``): a subscriber that
replays them holds exactly what the tree holds, tier by tier, through device, host and SSD
eviction, restores and resets."""

from __future__ import annotations

import random

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from pcr_sglang.core import Effects, IoOutcome, PersistedChunk
from pcr_sglang.core.orders import ReadChunk
from pcr_sglang.core.tier_events import Tier
from pcr_sglang.sglang_adapter.kv_events import MEDIUM, TIERS, PCRKvEvents, block_hash
from tests.unit.core.test_cache_state import Driver
from tests.unit.core.test_chunk_tree import CHUNK, keys


class Subscriber:
    """What an event-driven router rebuilds from the events: blocks per medium."""

    def __init__(self) -> None:
        self.media: dict[str, set[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.parents: dict[int, int] = {}
        self.salts: dict[int, str] = {}

    def held(self) -> set[int]:
        return set().union(*self.media.values())

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.media.clear()
            elif isinstance(event, BlockStored):
                known = self.held() | set(event.block_hashes)
                assert event.parent_block_hash is None or event.parent_block_hash in known, event
                parent = event.parent_block_hash
                assert len(event.token_ids) == event.block_size * len(event.block_hashes) and event.block_size == CHUNK
                blocks = self.media.setdefault(event.medium, set())
                for i, h in enumerate(event.block_hashes):
                    assert h not in blocks, ("stored twice", event.medium, h)
                    blocks.add(h)
                    self.tokens[h] = event.token_ids[i * CHUNK : (i + 1) * CHUNK]
                    if parent is not None:
                        self.parents[h] = parent
                    parent = h
                    if event.cache_salt is not None:
                        self.salts[h] = event.cache_salt
            elif isinstance(event, BlockRemoved):
                blocks = self.media.get(event.medium, set())
                for h in event.block_hashes:
                    assert h in blocks, ("removed but never stored", event.medium, h)
                    blocks.discard(h)
                    held = self.held()
                    if h not in held:  # gone from every medium: no child of it may be left
                        assert not any(self.parents.get(c) == h for c in held), ("orphaned children", h)
            else:
                raise AssertionError(f"unexpected event {event!r}")


def tree_blocks(state) -> dict[str, set[int]]:
    held = {MEDIUM[t]: set() for t in TIERS}
    for node in state.tree.iter_nodes():
        ssd = Tier.REMOTE if node.remote_only else Tier.SSD
        for tier, on in ((Tier.DEVICE, node.on_device), (Tier.HOST, node.on_host), (ssd, node.on_ssd)):
            if on:
                held[MEDIUM[tier]].add(block_hash(node.key))
    return held


def mirrored(sub: Subscriber) -> dict[str, set[int]]:
    return {MEDIUM[t]: set(sub.media.get(MEDIUM[t], set())) for t in TIERS}


class EventDriver(Driver):
    """The prefix cache's part: every chain it inserts or matches, it tells the events."""

    def __init__(self, **config):
        super().__init__(**config)
        self.events = PCRKvEvents(self.state.tree, CHUNK)
        self.chunk_tokens: dict[int, list[int]] = {}

    def serve(self, tokens: list[int]) -> int:
        ks = keys(tokens)
        self.events.learn(self.state.match(iter(ks), touch=False).nodes, tokens, None)
        reused = super().serve(tokens)
        self.events.learn(self.state.match(iter(ks), touch=False).nodes, tokens, None)
        for i, k in enumerate(ks):
            self.chunk_tokens[block_hash(k)] = tokens[i * CHUNK : (i + 1) * CHUNK]
        return reused


def test_a_subscriber_mirrors_every_tier_through_500_requests():
    rng = random.Random(11)
    d = EventDriver(device_slots=40, host_slots=24, ssd_capacity_chunks=60)
    sub = Subscriber()
    docs = [[rng.randrange(1000) for _ in range(CHUNK * rng.randint(1, 4))] for _ in range(30)]
    served = []
    for step in range(500):
        tokens = sum((rng.choice(docs) for _ in range(rng.randint(1, 3))), [])[: 12 * CHUNK]
        d.serve(tokens)
        served.append(tokens)
        if step % 3 == 0:
            d.answer()  # write-back completes now and then: chunks reach the SSD level
        if step % 7 == 0:  # SSD chunks read back into host memory; every other round fails (bad records)
            chain = d.state.match(iter(keys(rng.choice(served))), touch=False).ssd_nodes
            effects = Effects()
            d.state.order_reads(chain, effects, urgent=True, limit=len(chain))
            d.run(effects)
            d.answer(IoOutcome.BAD if step % 2 == 0 else IoOutcome.OK, only=ReadChunk)
        if step % 13 == 0:  # a probe finds a chain's continuation in the remote tier
            more = tokens + [rng.randrange(1000) for _ in range(2 * CHUNK)]
            ks = keys(more)
            matched = len(d.state.match(iter(ks), touch=False).nodes)
            effects = Effects()
            if d.state.adopt_remote(ks, matched, len(ks) - matched, effects):
                d.run(effects)
                d.events.learn(d.state.match(iter(ks), touch=False).nodes, more, None)
                for i, k in enumerate(ks):
                    d.chunk_tokens[block_hash(k)] = more[i * CHUNK : (i + 1) * CHUNK]
        if step % 5 == 0:
            sub.apply(d.events.take())
            assert mirrored(sub) == tree_blocks(d.state), step
    d.answer()
    sub.apply(d.events.take())
    held = tree_blocks(d.state)
    assert mirrored(sub) == held
    assert all(held[MEDIUM[t]] for t in (Tier.DEVICE, Tier.HOST, Tier.SSD)), held
    assert d.events.stats.removed_blocks > 0
    assert d.state.ssd_stats.remote_adopted_chunks and d.state.ssd_stats.read_failures
    for h, tokens in sub.tokens.items():
        assert tokens == d.chunk_tokens[h]


def test_restored_chunks_are_announced_once_a_request_names_their_tokens():
    d = EventDriver(host_slots=4, ssd_capacity_chunks=20)
    sub = Subscriber()
    tokens = list(range(3 * CHUNK))
    chain = keys(tokens)
    d.state.restore(PersistedChunk(k, bytes(16) if i == 0 else chain[i - 1], i + 1) for i, k in enumerate(chain))
    sub.apply(d.events.take())
    assert sub.media == {}  # on SSD, tokens unknown: nothing a router could match yet
    assert d.events.report()["unannounced_chunks"] == 3
    d.serve(tokens + [5])
    sub.apply(d.events.take())
    assert mirrored(sub) == tree_blocks(d.state)
    assert sub.media[MEDIUM[TIERS[2]]] == {block_hash(k) for k in chain}
    assert d.events.report()["unannounced_chunks"] == 0


def test_a_reset_clears_then_stores_the_persisted_chunks_again():
    d = EventDriver(host_slots=8, ssd_capacity_chunks=20)
    sub = Subscriber()
    d.serve(list(range(4 * CHUNK)))
    effects = Effects()
    d.state.evict_device(4, effects)  # to host memory, and written through to SSD
    d.run(effects)
    d.answer()
    sub.apply(d.events.take())
    assert sub.media[MEDIUM[TIERS[2]]]
    d.run(d.state.reset())
    events = d.events.take()
    assert isinstance(events[0], AllBlocksCleared)
    sub.apply(events)
    assert mirrored(sub) == tree_blocks(d.state) and sub.media[MEDIUM[TIERS[2]]]


def test_the_salt_of_the_request_that_stored_a_chunk_is_published():
    d = EventDriver()
    tokens = list(range(2 * CHUNK)) + [1]
    ks = keys(tokens)
    d.state.insert(ks, [0, 1])
    d.events.learn(d.state.match(iter(ks), touch=False).nodes, tokens, "tenant-a")
    sub = Subscriber()
    sub.apply(d.events.take())
    assert set(sub.salts.values()) == {"tenant-a"} and len(sub.salts) == 2
