"""CacheState's parts (host tier, I/O ledger, SSD tier, prefetch planner) each check their
own bookkeeping: a slip in one is caught by ``CacheState.check`` and named by its part."""

from __future__ import annotations

import pytest

from pcr_sglang.core import Effects
from pcr_sglang.core.host_slots import HostSlotError
from pcr_sglang.core.orders import ReadChunk
from tests.unit.core.test_cache_state import Driver
from tests.unit.core.test_chunk_tree import CHUNK, keys


def _reading(d: Driver, tokens: list[int]) -> list:
    """Persist ``tokens``' chunks, push them out of host memory, and order their reads."""
    d.serve(tokens)
    for other in (list(range(500, 500 + 3 * CHUNK)), list(range(900, 900 + 3 * CHUNK))):
        effects = Effects()
        d.state.evict_device(10, effects)
        d.run(effects)
        d.answer()
        d.serve(other)
    effects = Effects()
    d.state.evict_device(10, effects)
    d.run(effects)
    d.answer()
    nodes = d.state.match(iter(keys(tokens)), touch=False).ssd_nodes
    effects = Effects()
    assert d.state.order_reads(nodes, effects, urgent=False, limit=len(nodes)) == len(nodes) > 0
    d.run(effects)
    return nodes


def test_a_read_in_flight_is_one_record_that_every_part_asks_the_ledger_about():
    d = Driver(host_slots=3, ssd_capacity_chunks=20)
    nodes = _reading(d, list(range(3 * CHUNK)))
    ledger = d.state.ledger
    assert all(ledger.reading(n) and d.state.reading(n) for n in nodes)
    seqs = [ledger.read_seq(n) for n in nodes]
    assert sorted(seqs) == [o.seq for o in d.orders if isinstance(o, ReadChunk)] == ledger.outstanding()
    assert ledger.expedite(nodes[0]) == seqs[0] and ledger.expedite(nodes[0]) is None  # urgent once
    d.check()
    d.answer()
    assert not any(ledger.reading(n) for n in nodes) and not ledger.outstanding()
    d.check()


def test_the_ledger_check_finds_a_read_indexed_under_another_chunk():
    d = Driver(host_slots=3, ssd_capacity_chunks=20)
    first, second = _reading(d, list(range(3 * CHUNK)))[:2]
    d.state.ledger._reading[first] = d.state.ledger._reading[second]
    with pytest.raises(AssertionError, match="not its live read"):
        d.state.check()


def test_the_ledger_check_finds_an_order_whose_slot_counts_no_io():
    d = Driver(host_slots=3, ssd_capacity_chunks=20)
    node = _reading(d, list(range(3 * CHUNK)))[0]
    d.state.slots.io_end(d.state.ledger._pending[d.state.ledger.read_seq(node)].slot)
    with pytest.raises((AssertionError, HostSlotError), match="I/O"):
        d.state.check()


def test_the_host_tier_check_finds_a_decode_reservation_over_its_share():
    d = Driver(host_slots=8)
    effects = Effects()
    slots = [d.state.reserve_offload_slot(("r", i), effects, decode=True) for i in range(3)]
    assert slots[:2] != [None, None] and slots[2] is None  # a quarter of 8 slots
    d.check()
    d.state.host._decode_reserved.add(7)
    with pytest.raises(AssertionError, match="decode offload"):
        d.state.check()
