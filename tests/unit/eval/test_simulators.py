"""The simulators over PCR's core tree (pcr_eval/sim/lookahead.py, pcr_eval/sim/fleet.py) run and
agree with the closed forms they are checked against."""

from __future__ import annotations

import json

import pytest

from pcr_eval.sim import fleet as fleet_sim
from pcr_eval.sim import lookahead as lookahead_sim
from pcr_sglang.core import CacheNamespace, chunk_keys, root_key


def test_lookahead_sim_replays_and_the_window_never_hurts():
    params = lookahead_sim.TraceParams(requests=400, docs=60, seed=3)
    root = root_key(CacheNamespace("sim", "float16", params.chunk_size).digest())
    trace = [chunk_keys(root, t, params.chunk_size) for t in lookahead_sim.make_trace(params)]
    capacity = lookahead_sim.working_set_chunks(trace) // 10
    plain = lookahead_sim.replay(trace, capacity, window=0, queue_depth=16)
    ahead = lookahead_sim.replay(trace, capacity, window=8, queue_depth=16)
    assert 0 < plain <= ahead < 1


def test_fleet_sim_matches_che_and_the_routing_laws():
    for what, simulated, formula in fleet_sim.checks(docs=5_000, requests=30_000, capacity=300, servers=4):
        assert abs(simulated - formula) < 0.03, (what, simulated, formula)


def test_fleet_sim_shared_tier_makes_random_routing_hit_like_one_cache():
    requests = fleet_sim.make_requests(fleet_sim.Workload(docs=2_000, zipf=1.0, requests=4_000, seed=1))
    alone = fleet_sim.simulate(requests, 8, "random", 300, 0)
    shared = fleet_sim.simulate(requests, 8, "random", 300, 8 * 300)
    one = fleet_sim.simulate(requests, 1, "random", 8 * 300, 0)
    assert alone.remote_hit == 0 and shared.remote_hit > 0
    assert alone.hit < shared.hit <= one.hit + 0.02
    affinity = fleet_sim.simulate(requests, 8, "cache_aware", 300, 0)
    assert affinity.hit > alone.hit


def test_fleet_sim_prices_remote_hits_by_the_link():
    """A remote chunk costs min(read over the link, recompute): over a slow link the shared
    tier's hits change nothing, over a fast one they lower the projected TTFT."""
    requests = fleet_sim.make_requests(fleet_sim.Workload(docs=2_000, zipf=1.0, requests=4_000, seed=1))
    alone = fleet_sim.simulate(requests, 8, "random", 300, 0)
    shared = fleet_sim.simulate(requests, 8, "random", 300, 8 * 300)
    slow = fleet_sim.Costs(net_gbps=0.1, rtt_us=1_000)
    fast = fleet_sim.Costs(net_gbps=25, rtt_us=10)
    assert shared.requests == alone.requests  # the same routing, so the same queues
    assert shared.ttft_ms(slow, rate=8.0) == pytest.approx(alone.ttft_ms(slow, rate=8.0))
    assert shared.ttft_ms(fast, rate=8.0) < 0.95 * alone.ttft_ms(fast, rate=8.0)
    # M/M/1: the same fleet at a higher offered rate waits longer.
    assert alone.ttft_ms(fast, rate=16.0) > alone.ttft_ms(fast, rate=8.0)


def test_fleet_sim_writes_its_table_json_and_plot(tmp_path, capsys):
    out = tmp_path / "sim"
    assert (
        fleet_sim.main(
            [
                "--docs",
                "500,2000",
                "--servers",
                "2,4",
                "--requests",
                "600",
                "--local-chunks",
                "100",
                "--shared-per-server",
                "100",
                "--policies",
                "round_robin,cache_aware",
                "--networks",
                "slow=1@50,fast=25@10",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # corpora x servers x policies x shared
    assert {tuple(r["ttft_ms"]) for r in rows} == {("slow", "fast")}
    assert all(0 <= r["remote_hit"] <= r["hit"] <= 1 for r in rows)
    assert (out / "fleet_sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT fast" in capsys.readouterr().out


def test_fleet_sim_refuses_bad_options():
    for bad in (
        ["--networks", "fast=25"],
        ["--networks", "x=0@1"],
        ["--networks", "a=1@1,a=2@1"],
        ["--docs", "0"],
        ["--servers", "two"],
        ["--policies", "nearest"],
        ["--requests", "0"],
        ["--prefill-tps", "0"],
        ["--rate-per-server", "-1"],
    ):
        with pytest.raises(SystemExit):
            fleet_sim.main(bad + ["--out", ""])


def test_the_tree_microbenchmark_runs():
    """The tree microbenchmark (bench/tree_microbench.py, its measuring in
    pcr_eval/sim/tree_costs.py) stopped running when the tree began to require device
    values (it inserted None): a small size keeps it from rotting again."""
    from pcr_eval.sim import tree_costs

    figures = tree_costs.measure(500, repeats=5, seed=0)
    assert set(figures) == {"match", "insert", "lock+unlock", "evict", "lookahead"}
    assert all(v > 0 for v in figures.values())
