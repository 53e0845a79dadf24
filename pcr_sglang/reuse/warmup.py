"""When a document's canonical KV is computed: the warm-up policy and its ledger.

A document first seen at a later position has no canonical KV (``S ‖ d ‖ pad``) yet; it is
computed by a warm-up prefill. Whether that pays depends on whether the document recurs:
on a trace where no document recurs, every warm-up computes what its request computes
anyway and nothing repays it (measured in ``bench/README.md``). So the policy has two
parts:

* ``after``: a document is warmed from its ``after``-th sighting on (counted per canonical
  sequence, tenant and ``extra_key``). ``1`` warms every first sighting; the default ``2``
  serves a first sighting by plain prefill (what a server without document reuse does)
  and warms a document once it has recurred, so one-off documents cost nothing.
* ``when``: ``request`` (the request waits for its documents' warm-ups and reuses them
  itself) or ``idle`` (the request is sent at once with whatever is cached; its missing
  documents are queued and warmed one at a time while the server has nothing else in
  flight, so warm-ups never delay a request, and may never run on a busy server), or
  ``auto`` (the default: ``request`` for a request arriving while nothing else is in
  flight, whose wait delays no one else; ``idle`` for one arriving beside others: under
  load, requests waiting behind warm-ups made ``request`` slower than no document reuse).

The ledger only decides; the tokenizer side (``reuse/doc_warmer``) sends
the prefills. Its memory is bounded: the oldest sightings and warm-ups are forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, TypeVar

DEFAULT_WARMUP_WHEN = "auto"
DEFAULT_WARMUP_AFTER = 2
WARM_TTL_S = 30.0  # a document warmed this recently is not warmed again (its prefill is cheap, not free)
MAX_REMEMBERED = 1 << 16

_V = TypeVar("_V")


@dataclass(frozen=True)
class WarmupPolicy:
    when: str = DEFAULT_WARMUP_WHEN
    after: int = DEFAULT_WARMUP_AFTER
    ttl_s: float = WARM_TTL_S  # (``when`` and ``after`` are checked, naming their flags, by PCRConfig)


@dataclass
class WarmupStats:
    sightings: int = 0  # documents seen in marked requests (at any position), not queued or in flight already
    not_yet: int = 0  # sightings below the policy's ``after``: served without a warm-up
    fresh: int = 0  # warmed within the TTL: nothing to do
    ordered: int = 0  # warm-ups the ledger asked for
    completed: int = 0
    failed: int = 0
    dropped: int = 0  # idle warm-ups forgotten because the queue was full
    wait_timeouts: int = 0  # requests sent before their warm-ups were done (reuse/doc_warmer.WarmupWait)


class WarmupLedger:
    """Counts each document's sightings and remembers which were warmed, and when."""

    def __init__(self, policy: WarmupPolicy, clock: Callable[[], float], capacity: int = MAX_REMEMBERED):
        self.policy = policy
        self.clock = clock
        self.capacity = capacity
        self.stats = WarmupStats()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()
        self._warmed: OrderedDict[Hashable, float] = OrderedDict()

    def should_warm(self, key: Hashable, now: bool = False) -> bool:
        """Record one sighting of ``key``; True when it is due a warm-up (``now``: asked for
        by the request, whatever its sightings, unless it was just warmed)."""
        self.stats.sightings += 1
        warmed = self._warmed.get(key)
        if warmed is not None and self.clock() - warmed < self.policy.ttl_s:
            self.stats.fresh += 1
            return False
        count = self._seen.pop(key, 0) + 1
        self._remember(self._seen, key, count)
        # mutant: warmup-ignores-the-sighting-count
        if count < self.policy.after and not now:
            self.stats.not_yet += 1
            return False
        self.stats.ordered += 1
        return True

    def completed(self, key: Hashable) -> None:
        self.stats.completed += 1
        self._warmed.pop(key, None)
        self._remember(self._warmed, key, self.clock())

    def failed(self, key: Hashable) -> None:
        """A failed warm-up is tried again at the document's next sighting."""
        self.stats.failed += 1

    def _remember(self, table: OrderedDict[Hashable, _V], key: Hashable, value: _V) -> None:
        table[key] = value
        while len(table) > self.capacity:
            table.popitem(last=False)
