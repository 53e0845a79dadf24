"""Residency changes as a log, for whoever mirrors the tree outside the core.

SGLang publishes KV cache events (``--kv-events-config``) so that event-driven routers can
route on a server's real cache state: a block stored in a medium, a block removed from
it, everything cleared. The chunk tree records the same facts as they happen, one entry
per chunk and tier, in the order they happen; the adapter
(:mod:`pcr_sglang.sglang_adapter.kv_events`) turns them into SGLang's events. The log
knows nothing of SGLang: it is the tree's own vocabulary (device, host, SSD, remote).

``FORGOTTEN`` says a chunk left the tree (no tier holds it any more), so a mirror can drop
what it keeps per chunk; ``CLEARED`` says the whole tree was reset.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from pcr_sglang.core.keys import ChunkKey


class Tier(enum.IntFlag):
    DEVICE = 1
    HOST = 2
    SSD = 4  # the SSD level, with a record in the local store
    REMOTE = 8  # the SSD level, with its record only in the remote tier (until it is read)


class TierEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    FORGOTTEN = "forgotten"
    CLEARED = "cleared"


@dataclass(frozen=True)
class TierEvent:
    kind: TierEventKind
    key: ChunkKey = b""
    parent_key: Optional[ChunkKey] = None  # None: a first chunk (its parent is the root)
    tier: Optional[Tier] = None


class TierEventLog:
    """What changed since the last :meth:`take`, oldest first."""

    def __init__(self) -> None:
        self._events: list[TierEvent] = []

    def append(self, event: TierEvent) -> None:
        self._events.append(event)

    def take(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events
