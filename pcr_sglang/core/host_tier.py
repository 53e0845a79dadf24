"""The host tier: which tree chunk or planned offload holds each host slot, and host eviction.

A part of :class:`~pcr_sglang.core.residency.CacheState`, on its tree. It hands out slots
(:meth:`HostTier.take_slot`, evicting LRU host leaves when none is free), releases a chunk's
slot when the chunk leaves host memory, and keeps the decode-time offload reservations
within their share of the tier (``DECODE_OFFLOAD_SHARE``). Every order its decisions imply
goes into the caller's :class:`~pcr_sglang.core.effects.Effects`.

Below it on SSD, write-back is the SSD tier's: the host tier reaches it only through the
narrow :class:`WriteBack` face (whether writes may go, persist a chunk, is one being
written, forget a record), which :class:`~pcr_sglang.core.ssd_residency.SsdTier` provides.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from pcr_sglang.core.chunk_tree import ChunkNode, ChunkTree
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.hint_chains import HintedChains
from pcr_sglang.core.host_slots import HostSlots, SlotState
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_sglang.core.prefetch import UnusedReads
from pcr_sglang.core.state_config import CacheStateConfig
from pcr_sglang.core.stats import CacheStats

__all__ = ["HostTier", "WriteBack"]


class WriteBack(Protocol):
    """What the host tier asks of the tier it writes back to."""

    def may_write(self) -> bool: ...

    def persist(self, node: ChunkNode, effects: Effects) -> None: ...

    def writing(self, node: ChunkNode) -> bool: ...

    def forget(self, node: ChunkNode, effects: Effects) -> None: ...


class HostTier:
    def __init__(
        self,
        config: CacheStateConfig,
        tree: ChunkTree,
        slots: Optional[HostSlots],
        stats: CacheStats,
        lookahead: LookaheadProtection,
        unused: UnusedReads,
        hint_chains: HintedChains,
    ):
        self.config = config  # the host tier's settings never change at run time
        self.tree = tree
        self.slots = slots
        self.stats = stats
        self.lookahead = lookahead
        self.unused = unused
        self.hint_chains = hint_chains
        self.write_back: WriteBack  # set by CacheState once the SSD tier exists
        self._decode_reserved: set[int] = set()  # host slots reserved by decode-time offloads
        self.decode_offload_limit = int(config.host_slots * config.decode_offload_share)

    # ------------------------------------------------------------------ slots
    def loadable(self, node: ChunkNode) -> bool:
        """``node``'s KV is in a host slot that holds it whole (not still being read)."""
        slot = node.host_slot  # on_host
        return slot is not None and self.slots is not None and self.slots.state(slot) is SlotState.RESIDENT

    def take_slot(self, state: SlotState, owner: Any, effects: Effects, may_evict: bool = True) -> Optional[int]:
        assert self.slots is not None
        slot = self.slots.alloc(state, owner)
        if slot is None and may_evict and self.evict(1, effects):
            slot = self.slots.alloc(state, owner)
        return slot

    def release(self, node: ChunkNode, effects: Effects) -> None:
        """``node`` is leaving host memory (the tree clears ``host_slot`` right after). If
        this decision demoted it, that copy is not made: the slot may go to another chunk."""
        assert self.slots is not None and node.host_slot is not None
        self.hint_chains.residency_changed(node)
        if effects.demotions.pop(node, None) is not None:
            self.stats.demoted_chunks -= 1
            self.stats.bytes_device_to_host -= self.config.chunk_bytes
        self.slots.release(node.host_slot)
        self.unused.used(node)

    def became_resident(self, node: ChunkNode, effects: Effects) -> None:
        if self.config.write_through and self.write_back.may_write():
            self.write_back.persist(node, effects)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_chunks: int, effects: Effects) -> int:
        """Free host slots of LRU host leaves. A chunk being written to SSD is pinned (not a
        leaf) until the write is done: eviction never waits for the disk. With the
        ``on-evict`` write policy, the first unpersisted leaf eviction meets is written
        (with the host-resident chain above it, which eviction takes next) and stays, and
        the walk ends at the next one: no eviction orders writes for the whole tier."""
        write_back = self.write_back
        on_evict_writes = [1] if not self.config.write_through and write_back.may_write() else [0]

        def take(node: ChunkNode) -> Optional[bool]:
            if node.on_ssd or self.config.write_through or not write_back.may_write():
                return True
            if not on_evict_writes[0]:
                return None
            on_evict_writes[0] -= 1
            above: Optional[ChunkNode] = node
            while above is not None and above.parent is not None and above.on_host and not above.on_ssd:
                write_back.persist(above, effects)
                above = above.parent
            return not write_back.writing(node)  # not written (no room on SSD): it may go

        release = lambda n: self.release(n, effects)  # noqa: E731
        evicted = self.tree.evict_host(
            num_chunks,
            on_evict=release,
            is_protected=self.protected,
            on_drop_host=release,
            on_drop_ssd=lambda n: write_back.forget(n, effects),
            take=take,
        )
        self.stats.host_evicted_chunks += len(evicted)
        return len(evicted)

    def protected(self, node: ChunkNode) -> bool:
        return node in self.lookahead or node in self.unused

    # ------------------------------------------------------------------ offloads
    def reserve_offload_slot(self, owner: Any, effects: Effects, *, decode: bool) -> Optional[int]:
        """A host slot for a chunk a forward will compute (copied there as it is written).
        A prefill's chunk enters the tree at the checkpoint right after its forward, and
        may evict host chunks for its slot. A decode step's chunk waits for its request to
        finish: it takes only a free slot, never a tree chunk's, and only while decode
        offloads hold less than their share (``decode_offload_limit``); None otherwise."""
        if self.slots is None:
            return None
        if not decode:
            return self.take_slot(SlotState.RESERVED, owner, effects)
        if len(self._decode_reserved) >= self.decode_offload_limit:
            return None
        slot = self.take_slot(SlotState.RESERVED, owner, effects, may_evict=False)
        if slot is not None:
            self._decode_reserved.add(slot)
        return slot

    @property
    def decode_reserved_slots(self) -> int:
        """Host slots decode-time offloads hold reserved now (at most ``decode_offload_limit``)."""
        return len(self._decode_reserved)

    def adopt_offload(self, node: ChunkNode, slot: int, effects: Effects) -> None:
        """The chunk computed into reserved ``slot`` is ``node``: it is host-resident now,
        unless the tree already had a host copy (the reserved slot is released)."""
        assert self.slots is not None
        self._decode_reserved.discard(slot)
        if node.on_host or node.parent is None:
            self.slots.release(slot)
            return
        self.slots.bind(slot, node)
        self.tree.set_host(node, slot)
        self.stats.offloaded_chunks += 1
        self.stats.bytes_device_to_host += self.config.chunk_bytes
        self.became_resident(node, effects)

    def release_reserved(self, slot: int) -> None:
        assert self.slots is not None
        self._decode_reserved.discard(slot)
        self.slots.release(slot)

    # ------------------------------------------------------------------ reset, checks
    def reset(self) -> None:
        self._decode_reserved = set()  # the slot table frees every reservation
        if self.slots is not None:
            self.slots.reset()

    def check(self) -> None:
        """The slot table against the tree, and the decode reservations against their share."""
        if self.slots is None:
            return
        resident = {n.host_slot: n for n in self.tree.iter_nodes() if n.host_slot is not None}
        self.slots.check(resident)
        if len(self._decode_reserved) > self.decode_offload_limit:
            raise AssertionError(
                f"decode offloads hold {len(self._decode_reserved)} host slots, over their "
                f"share of {self.decode_offload_limit}"
            )
        for slot in self._decode_reserved:
            state = self.slots.state(slot)
            if state is not SlotState.RESERVED:
                raise AssertionError(f"host slot {slot} counts as a decode offload but is {state.value}")
