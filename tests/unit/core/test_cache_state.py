"""CacheState, the one owner of residency and host slots, driven alone (no SGLang, torch or
disk): the test plays SGLang's allocator and the I/O process, executing the effects."""

from __future__ import annotations

import random

import pytest

from pcr_sglang.core import CacheState, CacheStateConfig, Effects, IoOutcome
from pcr_sglang.core.host_slots import SlotState
from pcr_sglang.core.orders import DeleteChunk, ReadChunk, Reorder, WriteChunk
from tests.unit.core.test_chunk_tree import CHUNK, keys


class Driver:
    """Device slots as integers, I/O orders answered by the test."""

    def __init__(self, device_slots: int = 40, **config):
        self.state = CacheState(CacheStateConfig(chunk_size=CHUNK, **config))
        self.device_free = list(range(device_slots))
        self.device_slots = device_slots
        self.orders: list = []
        self.copies = 0

    def run(self, effects: Effects) -> None:
        slots = [slot for _, slot in effects.demotions.values()]
        assert len(slots) == len(set(slots)), "a host slot demoted into twice"
        self.copies += len(effects.demotions)
        for value in effects.device_frees:
            self.device_free.append(value)
        self.orders.extend(o for o in effects.orders if not isinstance(o, (DeleteChunk, Reorder)))

    def serve(self, tokens: list[int]) -> int:
        """Admit (loading the host hit), compute the rest, insert; returns chunks reused."""
        ks = keys(tokens)
        match = self.state.match(iter(ks))
        head = match.nodes[match.device - 1] if match.device else self.state.tree.root
        self.state.lock(head)
        host = match.host_nodes
        if host:
            self.state.lock(host[-1])
            need = len(host) - len(self.device_free)
            if need > 0:
                effects = Effects()
                self.state.evict_device(need, effects)
                self.run(effects)
            if len(self.device_free) >= len(host):
                self.state.commit_load(host, [self.device_free.pop() for _ in host])
                self.state.unlock(head)
                head = host[-1]
                self.state.lock(head)
            self.state.unlock(host[-1])
        reused = head.depth
        new = len(ks) - reused
        if len(self.device_free) < new:
            effects = Effects()
            self.state.evict_device(new - len(self.device_free), effects)
            self.run(effects)
        room = min(new, len(self.device_free))
        if room:
            values = [None] * reused + [self.device_free.pop() for _ in range(room)]
            out = self.state.insert(ks[: reused + room], values)
            assert out.num_existing == reused
        self.state.unlock(head)
        return reused

    def answer(self, outcome: IoOutcome = IoOutcome.OK, only=None) -> None:
        """The I/O process completes the orders it was given."""
        done = [o for o in self.orders if only is None or isinstance(o, only)]
        self.orders = [o for o in self.orders if o not in done]
        effects = Effects()
        self.state.apply_outcomes([(o.seq, outcome, 0.001) for o in done], effects)
        self.run(effects)

    def check(self) -> None:
        self.state.check()
        owned = [n.device_value for n in self.state.tree.iter_nodes() if n.on_device]
        assert sorted(owned + self.device_free) == list(range(self.device_slots))


def test_500_requests_through_device_host_and_ssd_keep_every_slot_owned_once():
    rng = random.Random(3)
    d = Driver(host_slots=24, ssd_capacity_chunks=60)
    docs = [[rng.randrange(1000) for _ in range(CHUNK * rng.randint(1, 4))] for _ in range(30)]
    reused = 0
    for step in range(500):
        tokens = sum((rng.choice(docs) for _ in range(rng.randint(1, 3))), [])[: 12 * CHUNK]
        reused += d.serve(tokens)
        if step % 3 == 0:
            d.answer()  # write-back completes now and then
        if step % 7 == 0:
            ssd_chain = d.state.match(iter(keys(tokens)), touch=False).ssd_nodes
            effects = Effects()
            d.state.order_reads(ssd_chain, effects, urgent=True, limit=len(ssd_chain))
            d.run(effects)
        if step % 50 == 0:
            d.check()
    d.answer()
    d.answer()
    d.check()
    tree = d.state.tree
    assert tree.locked_chunks == 0 and reused > 0
    stats, ssd = d.state.stats, d.state.ssd_stats
    assert stats.demoted_chunks > 0 and stats.host_evicted_chunks > 0 and ssd.written_chunks > 0
    assert ssd.evicted_chunks > 0  # the SSD capacity was reached too
    assert d.state.slots.num_free + tree.host_chunks == d.state.slots.num_slots


def test_a_chunk_leaving_the_device_is_copied_first_then_its_slots_are_freed():
    d = Driver(host_slots=4)
    d.serve(list(range(2 * CHUNK)))
    effects = Effects()
    assert d.state.evict_device(10, effects) == 2
    assert len(effects.demotions) == 2 and len(effects.device_frees) == 2
    assert [v for v, _ in effects.demotions.values()] == effects.device_frees  # the same slots, copied first
    d.run(effects)
    assert d.state.tree.host_chunks == 2 and d.state.tree.device_chunks == 0
    d.check()


def test_a_chunk_being_written_stays_in_host_memory_until_it_is_on_ssd():
    d = Driver(host_slots=2, ssd_capacity_chunks=10)
    d.serve(list(range(2 * CHUNK)))  # two chunks
    effects = Effects()
    d.state.evict_device(2, effects)  # both demoted and, write-through, ordered to SSD
    d.run(effects)
    assert [type(o) for o in d.orders] == [WriteChunk, WriteChunk]
    d.serve(list(range(100, 100 + CHUNK)))
    effects = Effects()
    d.state.evict_device(1, effects)  # needs a host slot: both are being written
    d.run(effects)
    assert d.state.stats.dropped_chunks == 1 and d.state.tree.host_chunks == 2  # nothing waited
    d.answer()
    assert d.state.tree.ssd_chunks == 2
    d.serve(list(range(200, 200 + CHUNK)))
    effects = Effects()
    d.state.evict_device(1, effects)  # now a written chunk can leave host memory
    d.run(effects)
    assert d.state.stats.host_evicted_chunks == 1 and d.state.stats.dropped_chunks == 1
    d.answer()
    d.check()


def test_a_read_fills_a_slot_and_lands_or_drops_the_record():
    d = Driver(host_slots=3, ssd_capacity_chunks=10)
    tokens = list(range(3 * CHUNK))
    d.serve(tokens)
    effects = Effects()
    d.state.evict_device(10, effects)
    d.run(effects)
    d.answer()  # written
    # Push them out of host memory: three other chunks take the slots.
    d.serve(list(range(500, 500 + 3 * CHUNK)))
    effects = Effects()
    d.state.evict_device(10, effects)
    d.run(effects)
    d.answer()
    match = d.state.match(iter(keys(tokens)), touch=False)
    assert match.ssd == 3
    effects = Effects()
    assert d.state.order_reads(match.ssd_nodes, effects, urgent=False, limit=3) == 3
    d.run(effects)
    assert d.state.slots.counts()["filling"] == 3 and d.state.reads_in_flight == 3
    reads = [o for o in d.orders if isinstance(o, ReadChunk)]
    done = Effects()
    d.state.apply_outcomes(
        [
            (reads[0].seq, IoOutcome.OK, 0.001),
            (reads[1].seq, IoOutcome.BAD, 0.001),
            (reads[2].seq, IoOutcome.CANCELLED, 0.001),
        ],
        done,
    )
    d.orders = [o for o in d.orders if o not in reads]
    d.run(done)
    first, second, third = match.nodes
    assert first.on_host and d.state.landed(first)  # landed, protected until a request uses it
    assert second.parent is None  # its record was bad: dropped, with what only it reached
    assert third.parent is None
    assert d.state.ssd_stats.read_failures == 1
    d.check()


def test_a_reset_orphans_orders_in_flight_and_keeps_the_persisted_chunks():
    d = Driver(host_slots=4, ssd_capacity_chunks=10)
    d.serve(list(range(2 * CHUNK)))
    effects = Effects()
    d.state.evict_device(10, effects)
    d.run(effects)
    d.answer()  # both persisted
    d.serve(list(range(100, 100 + CHUNK)))
    effects = Effects()
    d.state.evict_device(10, effects)  # demoted; its write is in flight
    d.run(effects)
    assert d.state.writes_in_flight == 1
    d.device_free = list(range(d.device_slots))  # SGLang's flush empties the device pool too
    d.run(d.state.reset())
    assert d.state.tree.ssd_chunks == 2 and d.state.tree.host_chunks == 0
    assert d.state.slots.counts()["releasing"] == 1  # the write still reads its slot
    d.answer()  # completes: the slot is free, the orphaned record is deleted
    assert d.state.slots.num_free == 4 and d.state.tree.ssd_chunks == 2
    d.check()


def test_commit_load_refuses_a_chunk_already_on_the_device():
    d = Driver(host_slots=4)
    d.serve(list(range(CHUNK)))
    node = d.state.match(iter(keys(list(range(CHUNK))))).nodes[0]
    with pytest.raises(RuntimeError, match="host-only"):
        d.state.commit_load([node], [99])
    assert d.state.slots.state(0) is SlotState.FREE


def test_ranks_restoring_the_same_records_in_any_order_evict_the_same_chunks():
    """TP ranks scan their own store directories, in their own file-system order, and
    restored chunks all share one recency: eviction must still pick the same chunks on
    every rank (ties are broken by chunk key, never by process-local order)."""
    from pcr_sglang.core import PersistedChunk

    chains = [keys(list(range(s, s + 2 * CHUNK))) for s in range(0, 80, 8)]  # ten chains of two
    records = [
        PersistedChunk(k, bytes(16) if i == 0 else chain[i - 1], i + 1) for chain in chains for i, k in enumerate(chain)
    ]
    survivors, victims = [], []
    for order in (records, list(reversed(records)), records[1::2] + records[::2]):
        state = CacheState(CacheStateConfig(chunk_size=CHUNK, host_slots=4, ssd_capacity_chunks=12))
        junk = [object() for _ in range(len(victims) * 7)]  # shift object addresses between "ranks"
        state.restore(order)
        survivors.append(sorted(n.key for n in state.tree.iter_nodes()))
        effects = Effects()
        state.ssd.evict(3, effects)
        victims.append(sorted(o.key for o in effects.orders))
        del junk
    assert survivors[0] == survivors[1] == survivors[2] and len(survivors[0]) == 12
    assert victims[0] == victims[1] == victims[2] and len(victims[0]) == 3


def test_decode_offloads_hold_at_most_their_share_of_free_host_slots():
    """A decode step's chunk enters the tree only when its request finishes: its slot is
    reserved (not evictable) until then. Decode offloads take free slots only, never a
    tree chunk's, and at most a quarter of the tier; prefill offloads may still evict."""
    d = Driver(host_slots=8)
    assert d.state.decode_offload_limit == 2
    d.serve(list(range(4 * CHUNK)))
    effects = Effects()
    d.state.evict_device(10, effects)
    d.run(effects)
    assert d.state.tree.host_chunks == 4 and d.state.slots.num_free == 4
    decode = [d.state.reserve_offload_slot(f"r{i}", Effects(), decode=True) for i in range(3)]
    assert None not in decode[:2] and decode[2] is None  # the share (2) is reached, 2 slots still free
    assert d.state.decode_reserved_slots == 2 and d.state.slots.num_free == 2
    prefill = [d.state.reserve_offload_slot(f"p{i}", Effects(), decode=False) for i in range(2)]
    assert None not in prefill and d.state.slots.num_free == 0
    d.state.release_reserved(decode[0])  # its request left: the share has room again...
    assert d.state.decode_reserved_slots == 1
    again = d.state.reserve_offload_slot("r3", Effects(), decode=True)
    assert again is not None and d.state.decode_reserved_slots == 2
    d.state.release_reserved(again)
    assert d.state.reserve_offload_slot("p2", Effects(), decode=False) is not None  # the last free slot
    assert d.state.decode_reserved_slots == 1 and d.state.slots.num_free == 0
    effects = Effects()
    assert d.state.reserve_offload_slot("r4", effects, decode=True) is None  # within the share, but no eviction
    assert d.state.stats.host_evicted_chunks == 0 and d.state.tree.host_chunks == 4
    d.check()
    effects = Effects()
    assert d.state.reserve_offload_slot("p3", effects, decode=False) is not None  # a prefill may evict
    assert d.state.stats.host_evicted_chunks == 1
    d.check()
    d.run(d.state.reset())
    assert d.state.decode_reserved_slots == 0 and d.state.slots.num_free == 8
    d.check()


def test_a_host_tier_of_under_four_slots_takes_no_decode_offload():
    d = Driver(host_slots=3)
    assert d.state.decode_offload_limit == 0
    assert d.state.reserve_offload_slot("r", Effects(), decode=True) is None
    assert d.state.reserve_offload_slot("p", Effects(), decode=False) is not None


def test_reads_a_departed_request_waited_for_are_cancelled_unless_still_needed():
    """An aborted request's urgent reads must not keep the I/O process (and host slots)
    busy: abandoned, the next prefetch plan cancels those no waiting request needs."""
    d = Driver(host_slots=6, ssd_capacity_chunks=10)
    tokens, shared_with_next = list(range(3 * CHUNK)), list(range(2 * CHUNK))
    d.serve(tokens)
    effects = Effects()
    d.state.evict_device(10, effects)
    d.run(effects)
    d.answer()  # written
    d.serve(list(range(500, 500 + 6 * CHUNK)))  # pushes them out of host memory
    effects = Effects()
    d.state.evict_device(20, effects)
    d.run(effects)
    d.answer()
    chain = d.state.match(iter(keys(tokens)), touch=False).nodes
    assert [n.on_host or n.on_device for n in chain] == [False] * 3
    effects = Effects()
    assert d.state.order_reads(chain, effects, urgent=True, limit=3) == 3
    still_needed = d.state.match(iter(keys(shared_with_next)), touch=False).nodes
    plan = Effects()
    d.state.plan_prefetch([still_needed], [], plan, queue_depth=1)
    assert not [o for o in plan.orders if isinstance(o, Reorder)]  # urgent: a request waits
    d.state.abandon_reads(chain)
    assert d.state.ssd_stats.abandoned_reads == 3
    plan = Effects()
    d.state.plan_prefetch([still_needed], [], plan, queue_depth=1)
    cancels = [o for o in plan.orders if isinstance(o, Reorder) and o.cancel]
    assert [o.target for o in cancels] == [d.state.ledger.read_seq(chain[2])]  # the third: nobody needs it


def test_chunks_a_remote_probe_found_enter_the_ssd_level_past_the_match_only():
    d = Driver(host_slots=4, ssd_capacity_chunks=6)
    tokens = list(range(5 * CHUNK))
    ks = keys(tokens)
    d.serve(tokens[: 2 * CHUNK])  # the first two chunks are on the device
    effects = Effects()
    assert d.state.adopt_remote(ks, 2, 3, effects) == 3
    match = d.state.match(iter(ks), touch=False)
    assert (match.device, match.host, match.ssd) == (2, 0, 3)
    assert d.state.adopt_remote(ks, 2, 3, effects) == 0  # entered already
    # A probe sent when the match ended at chunk 4 cannot attach behind a shorter chain.
    other = keys(list(range(900, 900 + 5 * CHUNK)))
    assert d.state.adopt_remote(other, 4, 1, effects) == 0 and d.state.tree.match(iter(other)).nodes == []
    # An answer that overlaps what the tree gained since adds only the rest.
    assert d.state.adopt_remote(keys(list(range(6 * CHUNK))), 3, 3, effects) == 1
    # Beyond the SSD level's capacity, the least recently used SSD chunks go: not the
    # chunks just entered, which a request is about to read.
    assert d.state.adopt_remote(other, 0, 5, effects) == 5
    assert d.state.tree.ssd_chunks <= 6 and d.state.ssd_stats.remote_adopted_chunks == 9
    assert d.state.match(iter(other), touch=False).ssd == 5
    # Read like any SSD chunk: ordered into a host slot, landed on OK.
    tail = d.state.match(iter(other), touch=False).ssd_nodes
    assert all(n.remote_only for n in tail)  # the cost model weighs them at the remote tier's rate
    effects = Effects()
    assert d.state.order_reads(tail[:2], effects, urgent=True, limit=2) == 2
    d.run(effects)
    d.answer(only=ReadChunk)
    assert all(n.on_host for n in tail[:2])
    assert [n.remote_only for n in tail] == [False, False, True, True, True]  # read: local from now on
    d.check()
