"""TP agreement: ranks that see different I/O outcomes, health and clocks decide the same.

Two ranks are two threads here, reducing through a barrier (the same MIN a gloo
all-reduce computes); the adapter-level test gives each rank its own cache, I/O process
and store, as a ``--tp 2`` server does, and delays one rank's reads."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pcr_sglang.core.agreement import LocalView, agree
from pcr_sglang.core.orders import IoOutcome


class TwoRanks:
    """A two-rank MIN all-reduce (and set intersection) between threads."""

    def __init__(self, size: int = 2):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list = [None] * size

    def group(self, rank: int) -> "RankGroup":
        return RankGroup(self, rank)

    def _exchange(self, rank: int, value):
        self._slots[rank] = value
        self._barrier.wait(timeout=60)
        values = list(self._slots)
        self._barrier.wait(timeout=60)
        return values


class RankGroup:
    def __init__(self, ranks: TwoRanks, rank: int):
        self.ranks, self.rank, self.size = ranks, rank, ranks.size

    def reduce_min(self, values: list[int]) -> list[int]:
        everyone = self.ranks._exchange(self.rank, list(values))
        assert all(len(v) == len(values) for v in everyone), "ranks reduced vectors of different lengths"
        return [min(column) for column in zip(*everyone)]

    def intersect(self, items: set) -> set:
        everyone = self.ranks._exchange(self.rank, set(items))
        return set.intersection(*everyone)


def on_both(fn0, fn1):
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(fn0), pool.submit(fn1)
        return a.result(timeout=120), b.result(timeout=120)


def view(finished, *, healthy=True, prefers_load=True, outstanding=(1, 2, 3), waiting=()):
    return LocalView(healthy, prefers_load, list(outstanding), finished, list(waiting))


def test_an_order_is_applied_once_every_rank_finished_it_as_the_worst_outcome():
    ranks = TwoRanks()
    r0 = view({1: (IoOutcome.OK, 0.1), 2: (IoOutcome.OK, 0.1), 3: (IoOutcome.BAD, 0.1)}, waiting=[True, False])
    r1 = view({1: (IoOutcome.OK, 0.2), 3: (IoOutcome.CANCELLED, 0.2)}, healthy=False, waiting=[True, True])
    a0, a1 = on_both(lambda: agree(r0, ranks.group(0).reduce_min), lambda: agree(r1, ranks.group(1).reduce_min))
    for agreed in (a0, a1):
        assert agreed.consistent and not agreed.healthy and agreed.prefers_load
        assert [(seq, outcome) for seq, outcome, _ in agreed.outcomes] == [(1, IoOutcome.OK), (3, IoOutcome.BAD)]
        assert agreed.still_waiting == [True, False]  # rank 0's deadline passed: nobody waits
    assert a0.outcomes[0][2] == 0.1 and a1.outcomes[0][2] == 0.2  # each keeps its own timing


def test_ranks_that_disagree_on_the_outstanding_orders_stop_the_tier_on_both():
    ranks = TwoRanks()
    r0, r1 = view({}, outstanding=(1, 2)), view({}, outstanding=(1, 2, 3))
    a0, a1 = on_both(lambda: agree(r0, ranks.group(0).reduce_min), lambda: agree(r1, ranks.group(1).reduce_min))
    assert not a0.consistent and not a1.consistent and "disagree" in a0.error


def test_the_hint_clock_is_the_earliest_ranks_even_with_nothing_outstanding():
    ranks = TwoRanks()
    r0 = LocalView(True, True, [], {}, hint_clock_ms=9_000)
    r1 = LocalView(True, True, [], {}, hint_clock_ms=5_000)
    a0, a1 = on_both(lambda: agree(r0, ranks.group(0).reduce_min), lambda: agree(r1, ranks.group(1).reduce_min))
    assert a0.hint_clock_ms == a1.hint_clock_ms == 5_000
    assert agree(r0, None).hint_clock_ms == 9_000


def test_one_rank_agrees_with_itself():
    agreed = agree(view({2: (IoOutcome.OK, 0.1)}, prefers_load=False, waiting=[False]), None)
    assert agreed.outcomes == [(2, IoOutcome.OK, 0.1)] and not agreed.prefers_load
    assert agreed.still_waiting == [False]


# ---------------------------------------------------------------- two caches, two I/O processes
def run_two_ranks(tmp_path, monkeypatch, faults: str, body):
    """Two ranks of a TP group, each with its own cache, store and I/O process, running
    ``body(harness)`` in lockstep (as SGLang's schedulers do); ``faults`` is the I/O
    process's test knob."""
    pytest.importorskip("sglang")
    from tests.unit.adapter_harness import Harness

    monkeypatch.setenv("PCR_IO_TEST_FAULTS", faults)
    ranks = TwoRanks()
    h0, h1 = on_both(
        lambda: Harness(host_slots=6, ssd_path=tmp_path / "r0", tp=ranks.group(0), tp_rank=0),
        lambda: Harness(host_slots=6, ssd_path=tmp_path / "r1", tp=ranks.group(1), tp_rank=1),
    )
    try:
        return on_both(lambda: body(h0), lambda: body(h1))
    finally:
        h0.close()
        h1.close()


def read_first_prompt(h, prefill_tokens_per_second=None):
    """Persist three prompts (the first leaves host memory), then serve the first again:
    held while its SSD chunks are read, then admitted. The prefill speed sets how long a
    request waits for reads (about what recomputing them would take)."""
    from tests.unit.sglang_adapter.test_prefix_cache_adapter import persisted, prompt

    persisted(h, [prompt(100), prompt(200), prompt(300)])
    h.state.cost_model.prefill_tokens_per_second = prefill_tokens_per_second
    req = h.request(prompt(100) + [0], "r")
    held = []
    while True:
        h.step([req])
        held.append(not h.scheduler.admission.admit_now(req))
        if not held[-1]:
            break
        time.sleep(0.01)
        assert len(held) < 1000
    finished_here = len(h.scheduler.executor.finished)  # this rank's completions not yet agreed
    admitted = h.admit(req)
    h.check()
    return held, admitted, finished_here, h.state.ssd_stats.read_failures, h.scheduler.agreement.rounds


# (rank 1's delay per read, prefill tokens/s: 12 tokens to recompute take 12 s or 1 ms)
@pytest.mark.parametrize("delay_s,speed,loaded", [(0.05, 1.0, 12), (0.5, 10_000.0, 0)])
def test_ranks_whose_reads_land_at_different_times_decide_the_same_prefix(
    tmp_path, monkeypatch, delay_s, speed, loaded
):
    """Rank 1's reads arrive late. Within the request's wait both ranks load all three
    chunks; past it both recompute, although rank 0's own reads had landed: a completion
    counts on a rank only once every rank has it."""
    r0, r1 = run_two_ranks(
        tmp_path, monkeypatch, f'{{"tp_ranks": [1], "read_delay_s": {delay_s}}}', lambda h: read_first_prompt(h, speed)
    )
    held0, admitted0, finished0, _, rounds0 = r0
    held1, admitted1, finished1, _, rounds1 = r1
    assert held0 == held1 and sum(held0) >= 1  # held back the same passes on both
    assert admitted0 == admitted1 == (0, loaded)
    assert rounds0 == rounds1
    if not loaded:
        assert finished1 < 3  # rank 1's reads had not all landed when both gave up waiting


def test_a_read_that_fails_on_one_rank_is_recomputed_on_both(tmp_path, monkeypatch):
    r0, r1 = run_two_ranks(tmp_path, monkeypatch, '{"tp_ranks": [1], "fail_reads": true}', read_first_prompt)
    # Rank 1's reads all failed (its records look bad): both ranks drop them and recompute.
    assert r0[1] == r1[1] == (0, 0)
    assert r0[3] == r1[3] == 3


def test_ranks_that_fingerprint_different_weights_refuse_to_start_on_both(tmp_path):
    """Review finding: keys derive from the fingerprint each rank computes from the weights
    it reads; ranks that disagree would restore nothing and evict differently."""
    pytest.importorskip("sglang")
    from pcr_sglang.config import PCRConfigError
    from tests.unit.adapter_harness import Harness

    ranks = TwoRanks()

    def build(rank: int):
        try:
            Harness(host_slots=6, tp=ranks.group(rank), tp_rank=rank, model_fingerprint=f"weights-{rank}")
        except PCRConfigError as e:
            return str(e)
        return None

    errors = on_both(lambda: build(0), lambda: build(1))
    assert all(e is not None and "model fingerprint" in e for e in errors), errors


def test_a_kv_hint_lives_by_the_clock_the_ranks_agree_on(tmp_path):
    """Under TP every rank registers the same hint and must order the same hinted reads:
    by its own clock a rank could expire a hint that another still reads for, and their
    orders would differ (the SSD tier stops on every rank). Rank 1's clock runs three
    times as fast as rank 0's here; two of rank 0's seconds after a hint with a 5 s TTL
    (six of rank 1's), both ranks still hold it and read its chain, and its request finds
    the chain in host memory on both."""
    pytest.importorskip("sglang")
    from pcr_sglang.core.hints import HintPayload
    from tests.unit.adapter_harness import Harness
    from tests.unit.sglang_adapter.test_prefix_cache_adapter import persisted, prompt

    ranks = TwoRanks()
    tokens = prompt(100)

    def rank(r: int):
        store = tmp_path / f"r{r}"
        first = Harness(host_slots=3, ssd_path=store, tp=ranks.group(r), tp_rank=r)
        try:
            persisted(first, [tokens])
        finally:
            first.close()
        # Restarted on its store: the chain is on SSD only. Hinted reads may take a quarter
        # of the host tier: three chunks.
        h = Harness(host_slots=12, ssd_path=store, tp=ranks.group(r), tp_rank=r)
        try:
            clock = [100.0]
            rate = 3.0 if r == 1 else 1.0
            h.scheduler.kv_hints.clock = lambda: clock[0] * rate
            registered = h.scheduler.kv_hints.add(h.request(tokens + [0], "hint"), HintPayload(ttl_s=5.0))
            clock[0] += 2.0  # rank 0: 2 s later; rank 1: 6 s later, past the TTL by its own clock
            h.step()
            h.drain_io()
            live, issued = len(h.scheduler.hints), h.state.ssd_stats.hint_issued
            req = h.request(tokens + [0], "final")
            assert h.scheduler.admission.admit_now(req)
            admitted = h.admit(req)
            h.scheduler.admitted(req)
            h.step()
            h.check()
            # A second hint, then past its TTL by the agreed (rank 0's) clock: gone on both.
            h.scheduler.kv_hints.add(h.request(prompt(200) + [0], "later"), HintPayload(ttl_s=5.0))
            clock[0] += 6.0
            h.step()
            return (
                registered,
                live,
                issued,
                admitted,
                h.state.ssd_stats.hint_in_time,
                len(h.scheduler.hints),
                h.scheduler.hints.stats.expired,
                h.scheduler.agreement.broken,
                h.scheduler.agreement.digest_mismatches,
            )
        finally:
            h.close()

    r0, r1 = on_both(lambda: rank(0), lambda: rank(1))
    assert r0 == r1 == (True, 1, 3, (0, 12), 3, 0, 1, None, 0), (r0, r1)
