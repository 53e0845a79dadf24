"""The simulators over PCR's core tree (bench/lookahead_sim.py, bench/fleet_sim.py) run and
agree with the closed forms they are checked against."""

from __future__ import annotations

from bench import fleet_sim, lookahead_sim


def test_lookahead_sim_replays_and_the_window_never_hurts():
    params = lookahead_sim.TraceParams(requests=400, docs=60, seed=3)
    root = lookahead_sim.root_key(lookahead_sim.CacheNamespace("sim", "float16", params.chunk_size).digest())
    trace = [lookahead_sim.chunk_keys(root, t, params.chunk_size) for t in lookahead_sim.make_trace(params)]
    capacity = lookahead_sim.working_set_chunks(trace) // 10
    plain = lookahead_sim.replay(trace, capacity, window=0, queue_depth=16)
    ahead = lookahead_sim.replay(trace, capacity, window=8, queue_depth=16)
    assert 0 < plain <= ahead < 1


def test_fleet_sim_matches_che_and_the_routing_laws():
    for what, simulated, formula in fleet_sim.checks(docs=5_000, requests=30_000, capacity=300, servers=4):
        assert abs(simulated - formula) < 0.03, (what, simulated, formula)


def test_fleet_sim_shared_tier_makes_random_routing_hit_like_one_cache():
    requests = fleet_sim.make_requests(fleet_sim.Workload(docs=2_000, zipf=1.0, requests=4_000, seed=1))
    costs = fleet_sim.Costs()
    alone = fleet_sim.simulate(requests, 8, "random", 300, 0, costs, rate=8.0)
    shared = fleet_sim.simulate(requests, 8, "random", 300, 8 * 300, costs, rate=8.0)
    one = fleet_sim.simulate(requests, 1, "random", 8 * 300, 0, costs, rate=1.0)
    assert alone.remote_hit == 0 and shared.remote_hit > 0
    assert alone.hit < shared.hit <= one.hit + 0.02
    affinity = fleet_sim.simulate(requests, 8, "cache_aware", 300, 0, costs, rate=8.0)
    assert affinity.hit > alone.hit
