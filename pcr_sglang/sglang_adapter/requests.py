"""Per-request state PCR keeps across scheduler passes, by request id (never on SGLang's ``Req``).

A request gets an entry only when PCR has something to remember for it: host slots its
planned offloads will fill, the SSD reads it is waiting for, how timely the reads it
needed were when it was first considered for admission, its remote-tier probe. The entry goes when SGLang
releases the request (``on_release``) or drops it unadmitted (``release_aborted_request``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

from pcr_sglang.core.admission import AdmissionPhase, Timeliness
from pcr_sglang.core.chunk_tree import ChunkNode


@dataclass
class RequestState:
    rid: str
    offload_slots: dict[int, int] = field(default_factory=dict)  # chunk index -> reserved host slot
    phase: AdmissionPhase = AdmissionPhase.NEW  # its way to admission (core/admission.py)
    probe_seq: Optional[int] = None  # PROBING: the remote tier's probe for its chains
    held_chain: list[ChunkNode] = field(default_factory=list)  # HOLDING: its matched chain when the hold began
    deadline: float = 0.0  # HOLDING: local clock, past which this rank no longer wants to wait
    held_since: float = 0.0  # HOLDING: local clock when the hold began (its wait is counted at admission)
    timeliness: Optional[Timeliness] = None  # taken at its first consideration, counted when it is admitted
    room_waits: int = 0  # admission passes its documents' load waited for device room


class RequestRegistry:
    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def get(self, rid: str) -> RequestState:
        state = self._states.get(rid)
        if state is None:
            state = self._states[rid] = RequestState(rid)
        return state

    def peek(self, rid: str) -> Optional[RequestState]:
        return self._states.get(rid)

    def pop(self, rid: str) -> Optional[RequestState]:
        return self._states.pop(rid, None)

    def holds(self) -> list[RequestState]:
        """Requests waiting for reads, in the order PCR began tracking them (the same on
        every rank: entries are made at the same points of the same schedule)."""
        return [s for s in self._states.values() if s.phase.held]

    def clear(self) -> None:
        self._states.clear()

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._states.values())

    def __len__(self) -> int:
        return len(self._states)
