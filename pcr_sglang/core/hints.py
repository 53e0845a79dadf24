"""KV hints: chains a request that does not exist yet will need, registered ahead of it.

A RAG pipeline knows its final prompt's documents seconds before it sends the prompt (the
look-ahead retrieval predicts them while the LLM writes the query). A *hint* carries the
chunk keys of a candidate final prompt; while it lives, the scheduler's prefetcher reads
the hinted chains' SSD-only chunks into host memory, after the waiting queue's own reads
and within the hint budget, so the final request finds them in DRAM.

A hint lives until its TTL (capped by the server), or until a request whose chain covers
the hint's is admitted (its whole group, the other candidates for the same final prompt,
is dropped then), or when more than ``max_live`` hints are live on the server (the
tenant holding the most loses its oldest). Hints belong to a tenant (the request's
``cache_salt``, else its ``extra_key``, else the default tenant): each tenant has its own
rate bucket and its own group names: one tenant never rate-limits or consumes another's
hints, and pushes out another's only while that one holds more live hints than it does (a
tenant registering on and on at the limit pushes out its own). Hinted reads have a budget of their own,
in flight and landed, and at most a quarter of the host tier, so hints can neither crowd
out the waiting queue's prefetch nor grow without bound. The
keys fold in the namespace, ``extra_key`` and ``cache_salt``: a hint can only reach chains
of its own tenant. ``cache_salt`` is the client's word: a client inventing a new salt per
request is a new tenant each time. So hints also belong to a *caller*, the peer address of
the HTTP connection that sent them (set by the tokenizer process, never by the client; the
Engine's own requests are one local caller): each caller has a rate bucket too, of
``CALLER_RATE_FACTOR`` tenants' rate, and over ``max_live`` the caller holding the most
live hints loses one first (its fullest tenant's oldest): a client rotating salts is still
one caller, bounded in rate and pushing out only its own hints. Among callers or tenants
holding equally many, the newest (whose oldest live hint is the newest) loses, so a
newcomer matching a victim's count cannot push out the victim's hints.

SGLang-agnostic: the adapter parses the request's ``kv_hints`` and feeds this book.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pcr_sglang.core.keys import ChunkKey
from pcr_wire import HINT_ACTION, HINT_ACTION_VERSION

# The same action in the words SGLang's kv_hints envelope is converging on (its fork and
# PR #38891, Dynamo's ``kv.fetch@1.0``): accepted as a synonym, with the same payload.
UPSTREAM_HINT_ACTION = "kv.prefetch"
UPSTREAM_HINT_ACTION_VERSION = "1.0"
HINT_ACTION_VERSIONS = {HINT_ACTION: HINT_ACTION_VERSION, UPSTREAM_HINT_ACTION: UPSTREAM_HINT_ACTION_VERSION}
# What /server_info advertises: the upstream capability string, then PCR's own name.
HINT_CAPABILITIES = ("kv_hint.prefetch.v1", "pcr.lookahead_prefetch.v1")


def is_hint_action(action: Any) -> bool:
    """Whether a ``kv_hints`` action is a prefetch hint this server implements (under either
    name); other actions are left to whoever implements them."""
    # mutant: kv-hints-upstream-action-name-ignored
    return getattr(action, "action_type", None) in HINT_ACTION_VERSIONS


class HintError(ValueError):
    """A malformed hint payload."""


@dataclass(frozen=True)
class HintPayload:
    """What a ``pcr.lookahead_prefetch`` action asks for."""

    hint_only: bool = True  # finish the carrying request without computing anything
    ttl_s: float = 15.0
    group: Optional[str] = None  # candidates of one final prompt share a group
    rank: int = 0  # lower first among a group's candidates
    caller: Optional[str] = None  # CALLER_FIELD: set by the tokenizer process, never taken from a client

    @classmethod
    def parse(cls, payload: object) -> HintPayload:
        if not isinstance(payload, dict):
            raise HintError(f"{HINT_ACTION} payload must be an object, got {type(payload).__name__}")
        unknown = set(payload) - {"hint_only", "ttl_s", "group", "rank", CALLER_FIELD}
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
        caller = payload.get(CALLER_FIELD)
        if caller is not None and (not isinstance(caller, str) or len(caller) > 256):
            raise HintError(f"{HINT_ACTION} {CALLER_FIELD} must be a string of at most 256 characters")
        return cls(hint_only, float(ttl), group, rank, caller)


DEFAULT_TENANT = "default"
# The payload field that carries a hint's caller from the tokenizer process to the
# scheduler's book (``sglang_adapter/kv_hints``: overwritten there on every request, so a
# client never chooses it), and the caller of requests that name none.
CALLER_FIELD = "pcr_caller"
DEFAULT_CALLER = "local"
# A caller's bucket holds this many tenants' rate and burst: one client may hint for a few
# tenants of its own at full rate, never for as many as it can invent salts.
CALLER_RATE_FACTOR = 4
# A hint-only request marking documents also hints each one's canonical chain. Those hints
# count against its tenant's live hints; the request's own rate token covers this many of
# them, and each further this many take one more of the tenant's tokens (documents the
# bucket cannot pay for are not hinted): a token buys a bounded number of hints.
DOC_HINTS_PER_TOKEN = 16
# Token buckets are kept for this many tenants before the refilled ones (the same as a new
# bucket) are forgotten: a client naming a new cache_salt per request costs no memory.
_BUCKETS_KEPT = 1024


def hint_tenant(cache_salt: Optional[str], extra_key: Optional[str]) -> str:
    """The tenant whose limits and groups a hint counts against: the request's
    ``cache_salt``, else its ``extra_key``, else the default tenant (the same namespaces the
    chunk keys fold in, so a hint only ever covers chains of its own tenant)."""
    if cache_salt is not None:
        return "salt:" + cache_salt
    if extra_key is not None:
        return "extra:" + extra_key
    return DEFAULT_TENANT


@dataclass(frozen=True)
class HintLimits:
    max_ttl_s: float = 30.0
    rate_per_s: float = 20.0  # registrations per second per tenant (a bucket of ``burst``)
    burst: int = 40
    # Live hints on the server (what bounds the scheduler's per-step hint work). Over it,
    # the tenant holding the most live hints loses its oldest: a tenant registering on and
    # on pushes out its own hints once it holds the most, never those of a tenant with fewer.
    max_live: int = 256


@dataclass
class HintStats:
    registered: int = 0  # accepted
    rate_limited: int = 0  # rejected (a malformed hint gets HTTP 400 before it reaches the book)
    clipped: int = 0  # accepted with its ttl_s cut to the server's --pcr-hint-max-ttl-s
    expired: int = 0
    consumed: int = 0  # a request covering the hint's chain was admitted
    documents_unhinted: int = 0  # marked documents of hint-only requests over the rate
    # What hinted reads achieved is counted with the other reads (SSDStats.hint_*).


@dataclass
class Hint:
    hint_id: str
    keys: list[ChunkKey]
    group: Optional[str]
    rank: int
    deadline: float
    seq: int = 0  # registration order (newest first when ordering reads)
    tenant: str = DEFAULT_TENANT
    caller: str = DEFAULT_CALLER


@dataclass
class _Bucket:
    tokens: float
    last: float


@dataclass
class HintBook:
    """The live hints, per tenant: each tenant has its own rate bucket and group names,
    and the server's ``max_live`` is shared fairly among them."""

    limits: HintLimits = field(default_factory=HintLimits)
    stats: HintStats = field(default_factory=HintStats)
    _hints: OrderedDict[str, Hint] = field(default_factory=OrderedDict)  # registration order
    _by_tenant: dict[str, OrderedDict[str, Hint]] = field(default_factory=dict)
    _by_caller: dict[str, OrderedDict[str, Hint]] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _caller_buckets: dict[str, _Bucket] = field(default_factory=dict)
    _seq: int = 0
    _live: Optional[tuple[Hint, ...]] = None  # live()'s order, until the book changes

    def register(
        self,
        hint_id: str,
        keys: Sequence[ChunkKey],
        payload: HintPayload,
        now: float,
        charge: bool = True,
        tenant: str = DEFAULT_TENANT,
        caller: Optional[str] = None,
    ) -> bool:
        """False when ``tenant``'s or ``caller``'s bucket is empty (the hint is dropped, the
        request still answered; neither bucket is charged then). ``caller`` None: the
        payload's, else the local caller. ``charge=False``: part of a hint already charged
        (its documents' chains), which still counts against the tenant's live hints."""
        caller = caller or payload.caller or DEFAULT_CALLER
        if charge and not self._take_tokens(tenant, caller, now):
            self.stats.rate_limited += 1
            return False
        if not keys:
            return True  # nothing a chunk could hold (a prompt under one chunk): registered, empty
        ttl = min(payload.ttl_s, self.limits.max_ttl_s)
        if charge and payload.ttl_s > self.limits.max_ttl_s:
            self.stats.clipped += 1
        self._seq += 1
        self._remove(hint_id)
        hint = Hint(hint_id, list(keys), payload.group, payload.rank, now + ttl, self._seq, tenant, caller)
        self._hints[hint_id] = hint
        self._by_tenant.setdefault(tenant, OrderedDict())[hint_id] = hint
        self._by_caller.setdefault(caller, OrderedDict())[hint_id] = hint
        self._live = None
        self.stats.registered += charge  # hints asked for, not the chains they cover
        while len(self._hints) > self.limits.max_live:
            self._remove(self._victim())
            self.stats.expired += 1
        return True

    def register_documents(
        self,
        hint_id: str,
        chains: Sequence[Sequence[ChunkKey]],
        payload: HintPayload,
        now: float,
        tenant: str = DEFAULT_TENANT,
        caller: Optional[str] = None,
    ) -> int:
        """The per-document hints of hint-only request ``hint_id`` (registered, and
        charged, just before): ``{hint_id}#doc{n}``, one per marked document's canonical
        chain. The request's token covers the first ``DOC_HINTS_PER_TOKEN``; each further
        ``DOC_HINTS_PER_TOKEN`` take one more of ``tenant``'s tokens, and those the bucket
        cannot pay for are not hinted. Returns how many were registered."""
        caller = caller or payload.caller or DEFAULT_CALLER
        paid = DOC_HINTS_PER_TOKEN
        for n, chain in enumerate(chains):
            if n == paid:
                if not self._take_tokens(tenant, caller, now):
                    self.stats.documents_unhinted += len(chains) - n
                    return n
                paid += DOC_HINTS_PER_TOKEN
            self.register(f"{hint_id}#doc{n}", chain, payload, now, charge=False, tenant=tenant, caller=caller)
        return len(chains)

    def _victim(self) -> str:
        """The hint that goes over ``max_live``: the oldest of the fullest tenant of the
        caller holding the most live hints."""
        # mutant: hint-max-live-ignores-the-caller
        caller = _fullest(self._by_caller)
        mine: dict[str, OrderedDict[str, Hint]] = {}
        for hint_id, hint in self._by_caller[caller].items():
            mine.setdefault(hint.tenant, OrderedDict())[hint_id] = hint
        return next(iter(mine[_fullest(mine)]))

    def _remove(self, hint_id: str) -> Optional[Hint]:
        hint = self._hints.pop(hint_id, None)
        if hint is not None:
            for index, name in ((self._by_tenant, hint.tenant), (self._by_caller, hint.caller)):
                own = index[name]
                del own[hint_id]
                if not own:
                    del index[name]
            self._live = None
        return hint

    def _take_tokens(self, tenant: str, caller: str, now: float) -> bool:
        """One token from ``tenant``'s bucket and one from ``caller``'s, or none from either."""
        rate, burst = self.limits.rate_per_s, float(self.limits.burst)
        factor = CALLER_RATE_FACTOR
        own = _refilled(self._buckets, tenant, now, rate, burst)
        theirs = _refilled(self._caller_buckets, caller, now, rate * factor, burst * factor)
        # mutant: hint-rate-per-salt-only
        if own.tokens < 1.0 or theirs.tokens < 1.0:
            return False
        own.tokens -= 1.0
        theirs.tokens -= 1.0
        return True

    def expire(self, now: float) -> list[Hint]:
        """Drop and return the hints past their deadline."""
        gone = [h for h in self._hints.values() if h.deadline <= now]
        for hint in gone:
            self._remove(hint.hint_id)
        self.stats.expired += len(gone)
        return gone

    def live(self) -> tuple[Hint, ...]:
        """Newest group first (a group is as new as its newest candidate); within a group,
        by rank. Groups are per tenant. Sorted again only after the book changed (the same
        tuple until then)."""
        if self._live is None:
            newest: dict[tuple[str, int, str], int] = {}
            for hint in self._hints.values():
                group = _group_of(hint)
                newest[group] = max(newest.get(group, 0), hint.seq)
            self._live = tuple(sorted(self._hints.values(), key=lambda h: (-newest[_group_of(h)], h.rank, -h.seq)))
        return self._live

    def consume(self, request_keys: Sequence[ChunkKey]) -> list[Hint]:
        """A request with chain ``request_keys`` was admitted: the hints whose whole chain
        it covers (their last chunk is in it) end, with every other candidate of their
        groups, in their own tenant (another tenant's group of the same name stays). A
        shared prefix alone (the system prompt) consumes nothing."""
        covered = set(request_keys)
        matched = {h.hint_id for h in self._hints.values() if h.keys[-1] in covered}
        if not matched:
            return []
        groups = {_group_of(self._hints[i]) for i in matched if self._hints[i].group is not None}
        gone = [h for h in self._hints.values() if h.hint_id in matched or _group_of(h) in groups]
        for hint in gone:
            self._remove(hint.hint_id)
        self.stats.consumed += len(matched)
        return gone

    def clear(self) -> None:
        """Drop every live hint (``/flush_cache``), counted as expired; the rate buckets stay."""
        self.stats.expired += len(self._hints)
        self._hints.clear()
        self._by_tenant.clear()
        self._by_caller.clear()
        self._live = None

    def live_of(self, tenant: str) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def live_of_caller(self, caller: str) -> int:
        return len(self._by_caller.get(caller, ()))

    def __len__(self) -> int:
        return len(self._hints)


def _fullest(index: dict[str, OrderedDict[str, Hint]]) -> str:
    """The name holding the most live hints; of equals, the newest (whose oldest live hint
    is the newest): a newcomer that matches another's count loses first, never the other."""
    # mutant: hint-ties-broken-against-the-oldest
    return max(index, key=lambda name: (len(index[name]), next(iter(index[name].values())).seq))


def _refilled(buckets: dict[str, _Bucket], name: str, now: float, rate: float, burst: float) -> _Bucket:
    """``name``'s bucket, refilled up to ``now`` (a new one is full). Past ``_BUCKETS_KEPT``
    buckets, the full ones (the same as a new bucket) are forgotten first."""
    bucket = buckets.get(name)
    if bucket is None:
        if len(buckets) >= _BUCKETS_KEPT:
            for gone in [n for n, b in buckets.items() if b.tokens + (now - b.last) * rate >= burst]:
                del buckets[gone]
        bucket = buckets[name] = _Bucket(burst, now)
    bucket.tokens = min(burst, bucket.tokens + (now - bucket.last) * rate)
    bucket.last = now
    return bucket


def _group_of(hint: Hint) -> tuple[str, int, str]:
    """A hint's group, in its tenant's namespace (a hint without one is a group of its own)."""
    # mutant: hint-groups-shared-by-all-tenants
    return (hint.tenant, 0, hint.group) if hint.group is not None else (hint.tenant, 1, hint.hint_id)


def hint_payload(envelope: Any) -> Optional[HintPayload]:
    """The ``pcr.lookahead_prefetch`` action of a ``KvHintsEnvelope`` (None without one;
    duck-typed: SGLang's envelope or anything with its ``actions``).
    Raises :class:`HintError` for a malformed one."""
    actions = getattr(envelope, "actions", None) or ()
    ours = [a for a in actions if is_hint_action(a)]
    if not ours:
        return None
    if len(ours) > 1:
        names = " and ".join(sorted({a.action_type for a in ours}))
        raise HintError(f"kv_hints carries {len(ours)} prefetch actions ({names}); send one per request")
    action = ours[0]
    version = HINT_ACTION_VERSIONS[action.action_type]
    if action.action_version != version:
        raise HintError(
            f"{action.action_type} action_version {action.action_version!r} is not supported "
            f"(this server implements {version!r})"
        )
    return HintPayload.parse(action.payload)
