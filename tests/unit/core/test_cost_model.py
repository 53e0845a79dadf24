"""The SSD tier's load-or-recompute decision."""

from __future__ import annotations

from pcr_sglang.core.cost_model import DEFAULT_WAIT_S, LoadOrRecompute


def test_loads_until_both_rates_are_measured():
    model = LoadOrRecompute()
    assert model.decide(model.prefers_load(64))
    model.observe_read(0.5)
    assert model.decide(model.prefers_load(64))


def test_fast_disk_loads_slow_disk_recomputes_and_still_probes():
    model = LoadOrRecompute(probe_every=4)
    model.observe_prefill(tokens=1000, seconds=1.0)  # 1,000 tokens/s: a 64-token chunk is 64 ms
    model.observe_read(0.002)  # 2 ms per chunk
    assert model.decide(model.prefers_load(64))
    slow = LoadOrRecompute(probe_every=4)
    slow.observe_prefill(tokens=20000, seconds=1.0)  # 3.2 ms per 64-token chunk
    slow.observe_read(0.5)  # 500 ms per chunk from a slow disk
    verdicts = [slow.decide(slow.prefers_load(64)) for _ in range(8)]
    assert verdicts.count(True) == 2  # every 4th decision probes the disk again
    for _ in range(30):  # the disk recovers: the moving average follows
        slow.observe_read(0.001)
    assert slow.decide(slow.prefers_load(64))


def test_a_few_token_warm_up_does_not_set_the_prefill_speed():
    """A server's warm-up prefill (a few tokens, mostly the forward's fixed cost) once set
    the speed to ~50 tokens/s, and the first real request then waited 14 s for reads."""
    model = LoadOrRecompute()
    model.observe_prefill(tokens=7, seconds=0.14)
    assert model.recompute_seconds(704) == DEFAULT_WAIT_S
    model.observe_prefill(tokens=700, seconds=0.35)  # 2,000 tokens/s
    assert abs(model.recompute_seconds(704) - 0.352) < 1e-9
    model.observe_prefill(tokens=10, seconds=0.01)  # from now on short extends count too
    assert abs(model.prefill_tokens_per_second - (0.8 * 2000 + 0.2 * 1000)) < 1e-9


def test_remote_reads_are_weighed_apart_from_local_ones():
    """A remote tier 2 s a chunk away (a slow link) must not make the local SSD look slow,
    nor the other way round; its own verdict still probes now and then."""
    model = LoadOrRecompute(probe_every=4)
    model.observe_prefill(tokens=1000, seconds=0.2)  # 5,000 tokens/s: a 64-token chunk is 12.8 ms
    model.observe_read(0.002)  # local SSD: 2 ms
    assert model.prefers_remote_load(64)  # not measured yet: load
    model.observe_read(2.0, remote=True)
    model.observe_read(0.0, remote=True)  # no time (a remote read's local outcome): ignored
    assert model.read_seconds_per_chunk == 0.002 and model.remote_read_seconds_per_chunk == 2.0
    assert model.prefers_load(64) and not model.prefers_remote_load(64)
    assert [model.decide_remote(64) for _ in range(8)].count(True) == 2
    assert model.decisions_to_recompute == 0  # the local verdict's probing is its own
