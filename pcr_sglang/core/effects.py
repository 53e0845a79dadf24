"""Values the cache state hands out: what a match found, and the work a decision implies
(its counters are in :mod:`pcr_sglang.core.stats`).

:class:`~pcr_sglang.core.residency.CacheState` decides and records; it never copies a
byte, frees a device slot or talks to the I/O process itself. Each decision that needs
such work returns it as :class:`Effects`, which the scheduler side executes in order
(demotion copies, then device frees, then I/O orders), and the outcome of I/O comes
back to the state as data (:class:`IoOutcome`). So data only flows down, and the state
can be driven, and tested, without SGLang, torch or a disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.orders import Order

__all__ = ["ChainMatch", "Effects"]


@dataclass
class Effects:
    """Work implied by one or more decisions, to run in this order."""

    # chunk -> (its device slots, its host slot): copy before the device slots are freed.
    # A chunk that leaves host memory again within the same decision is taken out (its
    # slot may already hold the next chunk), so no host slot appears twice.
    demotions: dict[ChunkNode, tuple[Any, int]] = field(default_factory=dict)
    device_frees: list[Any] = field(default_factory=list)  # device slots to give back to the allocator
    orders: list[Order] = field(default_factory=list)  # for the I/O process

    def __bool__(self) -> bool:
        return bool(self.demotions or self.device_frees or self.orders)


@dataclass(frozen=True)
class ChainMatch:
    """A request's cached chain split by where it can be served from.

    ``nodes[:device]`` are on the device; the next ``host`` are in host memory (loadable
    at admission); the next ``ssd`` are only on SSD (readable into host memory first).
    Anything after those is not reusable now (a chunk in no reachable tier).
    """

    nodes: list[ChunkNode]
    device: int
    host: int
    ssd: int

    @property
    def host_nodes(self) -> list[ChunkNode]:
        return self.nodes[self.device : self.device + self.host]

    @property
    def ssd_nodes(self) -> list[ChunkNode]:
        start = self.device + self.host
        return self.nodes[start : start + self.ssd]
