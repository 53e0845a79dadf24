"""The transfer engine's records of its copies: the chunks each transfer moves, the offloads
planned per request, and each host slot's ticket.

A host slot goes to the I/O process only once every copy touching it has completed. Each
transfer records an event when it is complete (on CUDA; on CPU a transfer is complete once
its layers are issued), and the ticket of a host slot is the last transfer issued or
planned on it: all copies go on one side stream, in issue order, so the last one completes
after every earlier one. :meth:`Tickets.ready` asks that ticket, never waiting for it.
An offload holds its slot's ticket from the moment it is planned for a request, so a slot
whose offload no batch has run yet is not ready; dropping the plan releases it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from pcr_sglang.transfer.copy_kv import Direction
from pcr_sglang.transfer.streams import Event

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # compared and hashed by identity: merged copies are cached per set of transfers
class Transfer:
    """Chunks moving one way: ``device_slots`` holds ``chunk_size`` token slots per entry
    of ``host_slots``. ``next_layer`` counts the layers already issued."""

    direction: Direction
    device_slots: torch.Tensor
    host_index: torch.Tensor
    host_slots: tuple[int, ...]
    next_layer: int = 0
    event: Optional[Event] = None  # streams: recorded on the side stream after the last layer

    def complete(self, num_layers: int) -> bool:
        if self.next_layer < num_layers:
            return False
        # mutant: gpu-step-waits-for-a-copy
        return self.event is None or bool(self.event.query())


class Tickets:
    """The ticket of each host slot, and the offloads planned per request (by request id),
    for an engine copying ``num_layers`` layers per transfer."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._planned: dict[str, list[Transfer]] = defaultdict(list)  # offloads by request id
        self._by_host_slot: dict[int, Transfer] = {}  # the last transfer touching each host slot

    def hold(self, transfer: Transfer) -> None:
        """``transfer`` is the newest copy touching its host slots."""
        for slot in transfer.host_slots:
            self._by_host_slot[slot] = transfer

    def plan(self, owner: str, transfer: Transfer) -> None:
        self._planned[owner].append(transfer)

    def drop(self, owner: str, host_slots: Optional[Iterable[int]] = None) -> None:
        """Forget the offloads planned for ``owner`` (those into ``host_slots`` only, or
        all), releasing the tickets they hold."""
        only = None if host_slots is None else set(host_slots)
        kept = []
        for transfer in self._planned.pop(owner, ()):
            if only is not None and not only.intersection(transfer.host_slots):
                kept.append(transfer)
                continue
            for slot in transfer.host_slots:
                if self._by_host_slot.get(slot) is transfer:
                    del self._by_host_slot[slot]
        if kept:
            self._planned[owner] = kept

    def take(self, owners: Iterable[str]) -> list[Transfer]:
        """The offloads planned for ``owners``, no longer planned (a batch runs them)."""
        taken: list[Transfer] = []
        for owner in owners:
            taken.extend(self._planned.pop(owner, ()))
        return taken

    @property
    def planned(self) -> int:
        return sum(len(t) for t in self._planned.values())

    def ready(self, slot: int) -> bool:
        """Every copy touching host slot ``slot`` has completed."""
        transfer = self._by_host_slot.get(slot)
        if transfer is None:
            return True
        if transfer.complete(self.num_layers):
            del self._by_host_slot[slot]
            return True
        return False

    def ran(self, slot: int) -> bool:
        """The offload planned into ``slot`` has run (all its layers are issued)."""
        transfer = self._by_host_slot.get(slot)
        return transfer is None or transfer.next_layer >= self.num_layers
