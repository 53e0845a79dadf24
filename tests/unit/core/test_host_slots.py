"""The host slot table: one state per slot, and no slot reused while I/O touches it."""

from __future__ import annotations

import pytest

from pcr_sglang.core.host_slots import HostSlotError, HostSlots, SlotState


def test_a_slot_goes_free_only_when_its_owner_and_its_io_are_done():
    slots = HostSlots(2)
    a = slots.alloc(SlotState.FILLING, "node")
    slots.io_begin(a)  # a read is writing it
    slots.release(a)  # the read's chunk is gone: the slot must wait for the read
    assert slots.state(a) is SlotState.RELEASING and slots.num_free == 1
    b = slots.alloc(SlotState.RESERVED, "req")
    assert b != a and slots.alloc(SlotState.RESERVED, "req") is None  # a is not handed out
    slots.io_end(a)
    assert slots.state(a) is SlotState.FREE and slots.num_free == 1


def test_transitions_the_protocol_forbids_raise():
    slots = HostSlots(1)
    a = slots.alloc(SlotState.RESERVED, "req")
    slots.release(a)
    with pytest.raises(HostSlotError, match="released twice"):
        slots.release(a)
    with pytest.raises(HostSlotError, match="I/O order"):
        slots.io_begin(a)
    with pytest.raises(HostSlotError):
        slots.alloc(SlotState.FREE, None)
    with pytest.raises(HostSlotError):
        slots.bind(a, "node")


def test_reset_keeps_slots_with_io_in_flight_reserved():
    slots = HostSlots(3)
    a = slots.alloc(SlotState.RESIDENT, "n1")
    b = slots.alloc(SlotState.RESIDENT, "n2")
    slots.io_begin(b)  # being written to SSD
    slots.reset()
    assert slots.state(a) is SlotState.FREE and slots.state(b) is SlotState.RELEASING
    assert slots.num_free == 2
    slots.io_end(b)
    assert slots.num_free == 3
    assert slots.counts() == {"free": 3, "reserved": 0, "filling": 0, "resident": 0, "releasing": 0}


def test_check_compares_the_table_with_the_tree():
    slots = HostSlots(2)
    a = slots.alloc(SlotState.RESIDENT, "n1")
    slots.check({a: "n1"})
    with pytest.raises(HostSlotError):
        slots.check({a: "someone else"})
    with pytest.raises(HostSlotError):
        slots.check({})
