"""Residency changes as a log, for whoever mirrors the tree outside the core.

SGLang publishes KV cache events (``--kv-events-config``) so that event-driven routers can
route on a server's real cache state: a block stored in a medium, a block removed from
it, everything cleared. The chunk tree records the same facts as they happen, one entry
per chunk and tier, in the order they happen; the adapter
(:mod:`pcr_sglang.sglang_adapter.kv_events`) turns them into SGLang's events. The log
knows nothing of SGLang: it is the tree's own vocabulary (device, host, SSD).

``FORGOTTEN`` says a chunk left the tree (no tier holds it any more), so a mirror can drop
what it keeps per chunk; ``CLEARED`` says the whole tree was reset.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pcr_sglang.core.keys import ChunkKey

if TYPE_CHECKING:
    from pcr_sglang.core.chunk_tree import ChunkNode


class Tier(enum.IntFlag):
    DEVICE = 1
    HOST = 2
    SSD = 4  # the SSD level: the local store, or the remote tier behind it


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

    def stored(self, node: ChunkNode, tier: Tier) -> None:
        self._events.append(TierEvent(TierEventKind.STORED, node.key, _parent_key(node), tier))

    def removed(self, node: ChunkNode, tier: Tier) -> None:
        self._events.append(TierEvent(TierEventKind.REMOVED, node.key, _parent_key(node), tier))

    def forgotten(self, node: ChunkNode) -> None:
        self._events.append(TierEvent(TierEventKind.FORGOTTEN, node.key, _parent_key(node)))

    def cleared(self) -> None:
        self._events.append(TierEvent(TierEventKind.CLEARED))

    def take(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)


def _parent_key(node: ChunkNode) -> Optional[ChunkKey]:
    parent = node.parent
    return None if parent is None or parent.parent is None else parent.key
