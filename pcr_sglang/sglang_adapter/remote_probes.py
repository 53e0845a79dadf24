"""Probes to the shared remote tier (``--pcr-remote``): which chunks past the local tiers'
match of a waiting request's chains the remote store holds, asked once per request in one
round trip, answered in the background, and entered into the tree at the SSD level.

A collaborator of the scheduler side, not a part of it: it is given the chains' keys
(never derives them) and writes what the answers found into the step's :class:`Effects`
through :class:`CacheState` (the one owner of residency). It never calls back into the
scheduler loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pcr_sglang.core.admission import AdmissionPhase
from pcr_sglang.core.effects import Effects
from pcr_sglang.core.keys import ChunkKey
from pcr_sglang.core.orders import ProbeRemote
from pcr_sglang.core.residency import CacheState
from pcr_sglang.io.supervisor import IOSupervisor
from pcr_sglang.sglang_adapter.requests import RequestRegistry

# A probe asks for at most this many chunks past a chain's match (64k tokens at 128).
MAX_PROBE_CHUNKS = 512
# A probe answer that comes after its request stopped waiting still enters what it found
# (later requests reuse it) if it comes within this long; later ones are forgotten.
LATE_PROBE_S = 30.0


@dataclass
class _Probe:
    """A remote-tier probe in flight: for whom, which chains, and where each one's match
    ended when it was sent (the probe asked for the keys from there)."""

    rid: str
    chains: list[list[ChunkKey]]
    starts: list[int]
    sent_at: float
    deadline: float


@dataclass
class RemoteProbeStats:
    probes: int = 0  # sent
    answered: int = 0
    timed_out: int = 0  # their request stopped waiting first
    found_chunks: int = 0  # the remote tier held them
    adopted_chunks: int = 0  # entered into the tree (not there already)
    seconds_total: float = 0.0  # from send to answer, over the answered ones


class RemoteProbes:
    """The probes in flight, by probe sequence number, and their counters."""

    enabled = True  # beside NoRemoteProbes, the null collaborator without --pcr-remote

    def __init__(self, state: CacheState, io: IOSupervisor, requests: RequestRegistry, timeout_s: float):
        self.state = state
        self.io = io
        self.requests = requests
        self.timeout_s = timeout_s
        self.stats = RemoteProbeStats()
        self._probes: dict[int, _Probe] = {}
        self._seq = itertools.count(1)

    @property
    def in_flight(self) -> int:
        return len(self._probes)

    def send(self, rid: str, entry: Any, needed_keys: Sequence[Sequence[ChunkKey]]) -> None:
        """Ask the remote tier, in one round trip, which chunks past the tree's match of
        each of the request's chains (``needed_keys``) it holds (once per request)."""
        status = self.io.remote_status
        if status is not None and not status.healthy:
            entry.phase = AdmissionPhase.PROBED  # the tier is down: no probe, no wait (it reports when it is back)
            return
        chains, starts = [], []
        for keys in needed_keys:
            matched = len(self.state.match(iter(keys), touch=False).nodes)
            if matched < len(keys):
                chains.append(list(keys))
                starts.append(matched)
        if not chains:
            entry.phase = AdmissionPhase.PROBED
            return
        seq = next(self._seq)
        now = time.monotonic()
        self._probes[seq] = _Probe(rid, chains, starts, now, now + self.timeout_s)
        entry.phase, entry.probe_seq = AdmissionPhase.PROBING, seq
        self.stats.probes += 1
        self.io.submit(ProbeRemote(seq, [c[s : s + MAX_PROBE_CHUNKS] for c, s in zip(chains, starts)]))

    def awaiting(self, rid: str, needed_keys: Callable[[], Sequence[Sequence[ChunkKey]]]) -> bool:
        """Hold request ``rid`` while its probe is out and within its timeout (a probe is
        sent at its first consideration if the prefetch window did not send one;
        ``needed_keys`` is asked for only then)."""
        entry = self.requests.get(rid)
        if entry.phase is AdmissionPhase.NEW:
            if not self.state.io_healthy:
                entry.phase = AdmissionPhase.PROBED
                return False
            self.send(rid, entry, needed_keys())
        if entry.phase is not AdmissionPhase.PROBING or entry.probe_seq is None:
            return False  # probed: answered, timed out, or nothing to ask
        probe = self._probes.get(entry.probe_seq)
        if probe is not None and time.monotonic() < probe.deadline:
            return True
        if probe is not None:
            self.stats.timed_out += 1
        entry.phase = AdmissionPhase.PROBED  # timed out (a late answer still enters the tree): go on without it
        return False

    def collect(self, effects: Effects) -> None:
        """Enter what answered probes found into the tree, as SSD-level chunks."""
        now = time.monotonic()
        for seq, probe in list(self._probes.items()):
            answer = self.io.take_probe(seq)
            if answer is None:
                if now - probe.sent_at > LATE_PROBE_S:
                    del self._probes[seq]
                continue
            del self._probes[seq]
            self.stats.answered += 1
            self.stats.seconds_total += now - probe.sent_at
            for keys, start, present in zip(probe.chains, probe.starts, answer.present):
                self.stats.found_chunks += present
                self.stats.adopted_chunks += self.state.adopt_remote(keys, start, present, effects)
            entry = self.requests.peek(probe.rid)
            if entry is not None and entry.phase is AdmissionPhase.PROBING:
                entry.phase = AdmissionPhase.PROBED
        self.io.drop_probes(set(self._probes))

    def clear(self) -> None:
        """Forget every probe in flight (a flush, or keys derived under another namespace)."""
        self._probes = {}


class NoRemoteProbes:
    """No remote tier (``--pcr-remote`` off, or no I/O process to reach it): nothing is
    probed, no request waits for a probe, nothing is found. The scheduler loop and
    admission hold this instead of testing for a missing collaborator at each call."""

    enabled = False
    in_flight = 0

    def __init__(self) -> None:
        self.stats = RemoteProbeStats()

    def send(self, rid: str, entry: Any, needed_keys: Sequence[Sequence[ChunkKey]]) -> None:
        pass

    def awaiting(self, rid: str, needed_keys: Callable[[], Sequence[Sequence[ChunkKey]]]) -> bool:
        return False

    def collect(self, effects: Effects) -> None:
        pass

    def clear(self) -> None:
        pass
