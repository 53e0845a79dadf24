"""KV hints: chains a request that does not exist yet will need, registered ahead of it.

A RAG pipeline knows its final prompt's documents seconds before it sends the prompt (the
look-ahead retrieval predicts them while the LLM writes the query). A *hint* carries the
chunk keys of a candidate final prompt; while it lives, the scheduler's prefetcher reads
the hinted chains' SSD-only chunks into host memory, after the waiting queue's own reads
and within the hint budget, so the final request finds them in DRAM.

A hint lives until its TTL (capped by the server), or until a request whose chain covers
the hint's is admitted (its whole group, the other candidates for the same final prompt,
is dropped then), or when more than ``max_live`` hints are live (the oldest go).
Registrations are rate-limited (a token bucket); hinted reads have a budget of their own,
in flight and landed, and at most a quarter of the host tier, so hints can neither crowd
out the waiting queue's prefetch nor grow without bound. The
keys fold in the namespace, ``extra_key`` and ``cache_salt``: a hint can only reach chains
of its own tenant.

SGLang-agnostic: the adapter parses the request's ``kv_hints`` and feeds this book.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pcr_sglang.core.keys import ChunkKey

HINT_ACTION = "pcr.lookahead_prefetch"
HINT_ACTION_VERSION = "1"


def hint_envelope(payload: dict, message_id: str, version: str = HINT_ACTION_VERSION) -> dict:
    """The ``kv_hints`` field of a request carrying one ``pcr.lookahead_prefetch`` action
    (SGLang's ``KvHintsEnvelope`` as JSON)."""
    return {"protocol_version": "1", "message_id": message_id,
            "actions": [{"action_id": "lookahead", "action_type": HINT_ACTION, "action_version": version,
                         "payload": payload}]}


class HintError(ValueError):
    """A malformed hint payload."""


@dataclass(frozen=True)
class HintPayload:
    """What a ``pcr.lookahead_prefetch`` action asks for."""

    hint_only: bool = True  # finish the carrying request without computing anything
    ttl_s: float = 15.0
    group: Optional[str] = None  # candidates of one final prompt share a group
    rank: int = 0  # lower first among a group's candidates

    @classmethod
    def parse(cls, payload: object) -> HintPayload:
        if not isinstance(payload, dict):
            raise HintError(f"{HINT_ACTION} payload must be an object, got {type(payload).__name__}")
        unknown = set(payload) - {"hint_only", "ttl_s", "group", "rank"}
        if unknown:
            raise HintError(f"{HINT_ACTION} payload has unknown fields {sorted(unknown)}")
        hint_only = payload.get("hint_only", True)
        if not isinstance(hint_only, bool):
            raise HintError(f"{HINT_ACTION} hint_only must be true or false, got {hint_only!r}")
        ttl = payload.get("ttl_s", cls.ttl_s)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= 3600:
            raise HintError(f"{HINT_ACTION} ttl_s must be a number of seconds in (0, 3600], got {ttl!r}")
        group = payload.get("group")
        if group is not None and (not isinstance(group, str) or len(group) > 256):
            raise HintError(f"{HINT_ACTION} group must be a string of at most 256 characters")
        rank = payload.get("rank", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 16:
            raise HintError(f"{HINT_ACTION} rank must be an integer in [0, 65535], got {rank!r}")
        return cls(hint_only, float(ttl), group, rank)


@dataclass(frozen=True)
class HintLimits:
    max_ttl_s: float = 30.0
    rate_per_s: float = 20.0  # registrations per second (bucket of ``burst``)
    burst: int = 40
    max_live: int = 256


@dataclass
class HintStats:
    registered: int = 0
    rate_limited: int = 0
    expired: int = 0
    consumed: int = 0  # a request covering the hint's chain was admitted
    # What hinted reads achieved is counted with the other reads (SSDStats.hint_*).


@dataclass
class Hint:
    hint_id: str
    keys: list[ChunkKey]
    group: Optional[str]
    rank: int
    deadline: float
    seq: int = 0  # registration order (newest first when ordering reads)


@dataclass
class HintBook:
    limits: HintLimits = field(default_factory=HintLimits)
    stats: HintStats = field(default_factory=HintStats)
    _hints: OrderedDict[str, Hint] = field(default_factory=OrderedDict)
    _tokens: float = -1.0
    _last_refill: Optional[float] = None
    _seq: int = 0

    def register(self, hint_id: str, keys: Sequence[ChunkKey], payload: HintPayload, now: float,
                 charge: bool = True) -> bool:
        """False when rate-limited (the hint is dropped, the request still answered).
        ``charge=False``: part of a hint already charged (its documents' chains)."""
        if charge and not self._take_token(now):
            self.stats.rate_limited += 1
            return False
        if not keys:
            return True  # nothing a chunk could hold (a prompt under one chunk): registered, empty
        ttl = min(payload.ttl_s, self.limits.max_ttl_s)
        self._seq += 1
        self._hints.pop(hint_id, None)
        self._hints[hint_id] = Hint(hint_id, list(keys), payload.group, payload.rank, now + ttl, self._seq)
        self.stats.registered += charge  # hints asked for, not the chains they cover
        while len(self._hints) > self.limits.max_live:
            self._hints.popitem(last=False)
            self.stats.expired += 1
        return True

    def _take_token(self, now: float) -> bool:
        if self._last_refill is None:
            self._tokens, self._last_refill = float(self.limits.burst), now
        self._tokens = min(float(self.limits.burst), self._tokens + (now - self._last_refill) * self.limits.rate_per_s)
        self._last_refill = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def expire(self, now: float) -> list[Hint]:
        """Drop and return the hints past their deadline."""
        gone = [h for h in self._hints.values() if h.deadline <= now]
        for hint in gone:
            del self._hints[hint.hint_id]
        self.stats.expired += len(gone)
        return gone

    def live(self) -> list[Hint]:
        """Newest group first (a group is as new as its newest candidate); within a group,
        by rank."""
        newest: dict[object, int] = {}
        for hint in self._hints.values():
            group = hint.group if hint.group is not None else ("", hint.hint_id)
            newest[group] = max(newest.get(group, 0), hint.seq)
        return sorted(self._hints.values(), key=lambda h: (
            -newest[h.group if h.group is not None else ("", h.hint_id)], h.rank, -h.seq))

    def consume(self, request_keys: Sequence[ChunkKey]) -> list[Hint]:
        """A request with chain ``request_keys`` was admitted: the hints whose whole chain
        it covers (their last chunk is in it) end, with every other candidate of their
        groups. A shared prefix alone (the system prompt) consumes nothing."""
        covered = set(request_keys)
        matched = [h for h in self._hints.values() if h.keys[-1] in covered]
        groups = {h.group for h in matched if h.group is not None}
        gone = [h for h in self._hints.values() if h in matched or (h.group is not None and h.group in groups)]
        for hint in gone:
            del self._hints[hint.hint_id]
        self.stats.consumed += len(matched)
        return gone

    def clear(self) -> None:
        """Drop every live hint (``/flush_cache``), counted as expired; the rate bucket stays."""
        self.stats.expired += len(self._hints)
        self._hints.clear()

    def __len__(self) -> int:
        return len(self._hints)
