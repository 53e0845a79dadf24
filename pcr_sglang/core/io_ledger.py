"""The I/O ledger: every SSD read and write the cache state ordered and has not yet seen finish.

One record per order (:class:`PendingIo`, by sequence number) is the one place where "a
read of this chunk is in flight" (or a write) is stored; the by-chunk indexes and the set of
reads a cancel was sent for are kept beside it here, by the same few methods, and nowhere
else. Whoever needs to know asks the ledger (:meth:`IoLedger.reading`), and the ledger counts
every order on its host slot (``io_begin``/``io_end`` of
:class:`~pcr_sglang.core.host_slots.HostSlots`) so that the slot is never reused while the
I/O process may still touch it.

A reset orphans the orders in flight: their records stay until their outcome comes (their
slots are released then), but no chunk is indexed as being read or written any more.
Nothing here decides what to read or write: :class:`~pcr_sglang.core.ssd_residency.SsdTier`
and the prefetch planner do, and their orders go into the caller's
:class:`~pcr_sglang.core.effects.Effects`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.host_slots import HostSlots

__all__ = ["IoLedger", "PendingIo"]


@dataclass
class PendingIo:
    """A read or write the state ordered and has not yet seen finish (one per sequence number)."""

    is_read: bool
    node: ChunkNode
    slot: int
    urgent: bool = False  # a request waits for it (ordered on demand, or a prefetch expedited)
    prefetch: bool = False  # ordered by the prefetcher
    orphaned: bool = False  # ordered for a tree that has been reset since


class IoLedger:
    def __init__(self, slots: Optional[HostSlots]):
        self.slots = slots
        self._seq = itertools.count(1)
        self._pending: dict[int, PendingIo] = {}
        self._reading: dict[ChunkNode, int] = {}  # index of the live reads' records, by chunk
        self._writing: dict[ChunkNode, int] = {}  # ... and of the live writes'
        self._cancelling: set[int] = set()  # reads a cancel was ordered for

    # ------------------------------------------------------------------ queries
    def reading(self, node: ChunkNode) -> bool:
        return node in self._reading

    def writing(self, node: ChunkNode) -> bool:
        return node in self._writing

    def writing_key(self, key: object) -> bool:
        """A write of a chunk with this key is in flight (a chunk of the same key re-entered the tree)."""
        return any(n.key == key for n in self._writing)

    def read_seq(self, node: ChunkNode) -> Optional[int]:
        return self._reading.get(node)

    def cancelling(self, seq: int) -> bool:
        return seq in self._cancelling

    @property
    def reads_in_flight(self) -> int:
        return len(self._reading)

    @property
    def writes_in_flight(self) -> int:
        return len(self._writing)

    def queue_reads_in_flight(self, hinted: set[ChunkNode]) -> int:
        """Reads the queue prefetch ordered and no request waits for (those of ``hinted`` chunks are a hint's)."""
        return sum(1 for op in self._pending.values() if op.is_read and not op.urgent and op.node not in hinted)

    def outstanding(self) -> list[int]:
        """Sequence numbers of reads and writes ordered and not yet applied, ascending."""
        return sorted(self._pending)

    # ------------------------------------------------------------------ orders begin
    def begin_read(self, node: ChunkNode, slot: int, *, urgent: bool) -> int:
        assert self.slots is not None
        seq = next(self._seq)
        self.slots.io_begin(slot)
        self._pending[seq] = PendingIo(True, node, slot, urgent=urgent, prefetch=not urgent)
        self._reading[node] = seq
        return seq

    def begin_write(self, node: ChunkNode, slot: int) -> int:
        assert self.slots is not None
        seq = next(self._seq)
        self.slots.io_begin(slot)
        self._pending[seq] = PendingIo(False, node, slot)
        self._writing[node] = seq
        return seq

    # ------------------------------------------------------------------ orders change
    def expedite(self, node: ChunkNode) -> Optional[int]:
        """A request waits for ``node``'s read in flight: the sequence number to move ahead,
        or None (no read, already urgent, or being cancelled)."""
        seq = self._reading.get(node)
        if seq is None:
            return None
        op = self._pending[seq]
        if op.urgent or seq in self._cancelling:
            return None
        op.urgent = True
        return seq

    def abandon(self, node: ChunkNode) -> bool:
        """The request waiting for ``node``'s read left: True if an urgent read was made a prefetch's again."""
        seq = self._reading.get(node)
        if seq is not None and self._pending[seq].urgent:
            self._pending[seq].urgent = False
            return True
        return False

    def cancel_unneeded(self, needed: Callable[[ChunkNode], bool]) -> list[int]:
        """Mark the reads no request waits for and not ``needed`` as cancelling; returns their sequence numbers."""
        cancels = []
        for node, seq in self._reading.items():
            op = self._pending[seq]
            if not op.urgent and not needed(node) and seq not in self._cancelling:
                self._cancelling.add(seq)
                cancels.append(seq)
        return cancels

    # ------------------------------------------------------------------ orders end
    def finish(self, seq: int) -> Optional[PendingIo]:
        """Order ``seq`` finished (not PENDING): its record, no longer indexed (None if unknown).
        The slot stays counted until :meth:`slot_done`, after the tier has acted on it."""
        op = self._pending.pop(seq, None)
        if op is None:
            return None
        self._cancelling.discard(seq)
        index = self._reading if op.is_read else self._writing
        if not op.orphaned and index.get(op.node) == seq:
            del index[op.node]
        return op

    def slot_done(self, op: PendingIo) -> None:
        assert self.slots is not None
        self.slots.io_end(op.slot)

    def orphan_all(self) -> None:
        """The tree was reset: every order in flight is for a tree that is gone."""
        for op in self._pending.values():
            op.orphaned = True
        self._reading, self._writing, self._cancelling = {}, {}, set()

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """The indexes point at live records of their kind, and each order's slot counts its I/O."""
        for index, is_read in ((self._reading, True), (self._writing, False)):
            for node, seq in index.items():
                op = self._pending.get(seq)
                if op is None or op.node is not node or op.is_read is not is_read or op.orphaned:
                    raise AssertionError(
                        f"{node!r} is indexed as order {seq}, which is not its live {'read' if is_read else 'write'}"
                    )
        for seq in self._cancelling:
            if seq not in self._pending or not self._pending[seq].is_read:
                raise AssertionError(f"order {seq} is being cancelled but is no read in flight")
        if self.slots is None:
            if self._pending:
                raise AssertionError("I/O orders without a host tier")
            return
        for seq, op in self._pending.items():
            if not self.slots.io_pending(op.slot):
                raise AssertionError(f"order {seq} on host slot {op.slot}, which counts no I/O")
