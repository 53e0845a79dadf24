"""HostSlots: the state of every slot of the host chunk pool, in one table.

The pool's bytes live in shared memory (:mod:`pcr_sglang.tiers.host_pool`); which chunk
a slot holds, and whether anything else may still touch it, is recorded here and only
here. Each slot is in exactly one state:

``FREE``
    in the free list; nothing reads or writes it.
``RESERVED``
    the target of a planned offload (a request's new chunk is copied into it during
    the forward that computes it); the request owns it until its checkpoint. A decode
    step's chunk is checkpointed only when its request finishes, so decode offloads
    hold at most a share of the slots (the cache state's ``decode_offload_limit``).
``FILLING``
    an SSD read is writing the chunk into it; becomes ``RESIDENT`` when the read lands.
``RESIDENT``
    holds a tree chunk's KV (the owner is the chunk's node).
``RELEASING``
    no owner any more, but an I/O order still reads or writes it (a write-back in
    flight, a read whose completion has not arrived, an order of an I/O process not
    yet confirmed dead); it returns to ``FREE`` when the last such order completes.

I/O orders that touch a slot are counted (``io_begin`` / ``io_end``), whatever the
slot's state, so a slot is never reused while the I/O process may still touch it.
GPU copies are ordered on their own stream and gated by their tickets in the transfer
engine, not here: the table is plain Python, shared by every rank's bookkeeping.
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import Any, Optional


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"
    FILLING = "filling"
    RESIDENT = "resident"
    RELEASING = "releasing"


class HostSlotError(RuntimeError):
    """A slot transition that the protocol forbids (a bookkeeping bug, never user input)."""


class HostSlots:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.reset()

    def reset(self) -> None:
        """Every slot free, except those an I/O order still touches (they finish releasing)."""
        busy = getattr(self, "_io", None)
        self._state = [SlotState.FREE] * self.num_slots
        self._owner: list[Any] = [None] * self.num_slots
        self._io = [0] * self.num_slots if busy is None else busy
        self._free = []
        for slot in range(self.num_slots - 1, -1, -1):
            if self._io[slot]:
                self._state[slot] = SlotState.RELEASING
            else:
                self._free.append(slot)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def owner(self, slot: int) -> Any:
        return self._owner[slot]

    def io_pending(self, slot: int) -> int:
        return self._io[slot]

    def counts(self) -> dict[str, int]:
        """Slots per state (for ``/server_info``)."""
        counts = Counter(s.value for s in self._state)
        return {s.value: counts.get(s.value, 0) for s in SlotState}

    # ------------------------------------------------------------------ transitions
    def alloc(self, state: SlotState, owner: Any) -> Optional[int]:
        """A free slot, now in ``state`` for ``owner``; None when none is free."""
        if state in (SlotState.FREE, SlotState.RELEASING):
            raise HostSlotError(f"cannot allocate a slot into state {state.value}")
        if not self._free:
            return None
        slot = self._free.pop()
        self._state[slot] = state
        self._owner[slot] = owner
        return slot

    def bind(self, slot: int, node: Any) -> None:
        """``slot`` now holds ``node``'s chunk (a planned offload was adopted, or a read landed)."""
        if self._state[slot] not in (SlotState.RESERVED, SlotState.FILLING, SlotState.RESIDENT):
            raise HostSlotError(f"host slot {slot} is {self._state[slot].value}, cannot hold a chunk")
        self._state[slot] = SlotState.RESIDENT
        self._owner[slot] = node

    def release(self, slot: int) -> None:
        """The owner lets go of ``slot``: free now, or once the I/O orders touching it end."""
        if self._state[slot] in (SlotState.FREE, SlotState.RELEASING):
            raise HostSlotError(f"host slot {slot} released twice (it is {self._state[slot].value})")
        self._owner[slot] = None
        if self._io[slot]:
            self._state[slot] = SlotState.RELEASING
        else:
            self._state[slot] = SlotState.FREE
            self._free.append(slot)

    def io_begin(self, slot: int) -> None:
        if self._state[slot] in (SlotState.FREE, SlotState.RELEASING):
            raise HostSlotError(f"an I/O order on host slot {slot}, which is {self._state[slot].value}")
        self._io[slot] += 1

    def io_end(self, slot: int) -> None:
        if self._io[slot] <= 0:
            raise HostSlotError(f"host slot {slot}: I/O end without a begin")
        self._io[slot] -= 1
        if self._io[slot] == 0 and self._state[slot] is SlotState.RELEASING:
            self._state[slot] = SlotState.FREE
            self._free.append(slot)

    # ------------------------------------------------------------------ checks
    def check(self, resident_owners: dict[int, Any]) -> None:
        """Verify the table against the tree's view (``slot -> node`` of resident chunks)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise HostSlotError("a slot is in the free list twice")
        for slot, state in enumerate(self._state):
            if (state is SlotState.FREE) != (slot in free):
                raise HostSlotError(
                    f"host slot {slot} is {state.value} but {'' if slot in free else 'not '}free-listed"
                )
            if state is SlotState.RESIDENT and resident_owners.get(slot) is not self._owner[slot]:
                raise HostSlotError(f"host slot {slot} is resident for a chunk the tree does not place there")
            if state is SlotState.RELEASING and not self._io[slot]:
                raise HostSlotError(f"host slot {slot} is releasing with no I/O order on it")
        for slot, node in resident_owners.items():
            if self._state[slot] is not SlotState.RESIDENT:
                raise HostSlotError(f"the tree places a chunk in host slot {slot}, which is {self._state[slot].value}")
