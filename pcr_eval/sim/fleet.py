"""Internet scale, on paper: N servers, routing policies and a shared tier, over PCR's own tree.

    python -m bench.fleet_sim                     # the tables and plot in bench/README (~9 min of CPU)
    python -m bench.fleet_sim --check             # only the closed-form checks
    python -m bench.fleet_sim --docs 100000 --servers 2,16 --requests 5000   # quicker

It prints a table per corpus size (``--docs``, default 10^4, 10^5 and 10^6 documents) and
writes ``results.json`` and ``fleet_sim.png`` (hit ratio, load imbalance and projected TTFT
against the number of servers, per policy, with and without the shared tier) to ``--out``.

Each server's cache is :class:`pcr_sglang.core.chunk_tree.ChunkTree` (LRU over unlocked
leaves, as the server evicts) with look-ahead protection of the next requests routed to
it (:class:`pcr_sglang.core.lookahead.LookaheadProtection`); the shared tier (Mooncake
Store's role) is one more ChunkTree, LRU, written through, ``--shared-per-server`` chunks
per server (its capacity grows with the fleet, as Mooncake segments do). One simulated
chunk stands for ``--chunk-tokens`` tokens.

Workload (RAG in retrieval order): a shared system prompt, then the document a Zipf(alpha)
draw over ``--docs`` documents picks and its next two neighbours (a topic's neighbours
in the same order, as retrieval lists them), each ``--doc-chunks`` chunks, then a question
chunk that never recurs. Reuse is prefix reuse: a document is reused only behind the same
preceding documents.

Routing: ``random``; ``round_robin``; ``cache_aware`` (SMG's policy: an approximate tree of
the prefixes routed to each server, not told of evictions; the server holding the longest
routed prefix if it covers more than its cache threshold (0.3) of the prompt, else the least
loaded; load imbalance over SMG's defaults, 32 requests and 1.1x, sends to the least
loaded); ``prefix_hash`` (a consistent hash of the system prompt and first document,
bounded load 1.25x the mean, as SMG's prefix_hash). Load is the requests a server took in
the last 4 x N routed (a stand-in for requests in flight).

Cost model per request (seconds): recomputed tokens / ``--prefill-tps`` + chunks held by
the shared tier x min(chunk bytes / link GB/s + RTT, their recompute time)
(PCR's load-or-recompute choice) + locally cached chunks x chunk bytes / ``--pcie-gbps`` (a
local hit is taken as host-resident, the conservative case); each server an M/M/1 queue
at its share of ``--rate-per-server`` x N requests/s: TTFT = s / (1 - rho). The defaults are
Llama-3.1-8B in bf16 (128 KiB of KV per token) on one GPU at 15k prefill tokens/s, PCIe at
25 GB/s and 10 GbE (1.25 GB/s) to the shared tier, where reading a 64-token chunk (8 MiB,
6.8 ms) loses to recomputing it (4.3 ms). Every fleet is priced under each link of
``--networks`` (default 10 GbE at 1.25 GB/s and 50 us, and RDMA at 25 GB/s and 10 us).

Checked against closed forms (``--check``): Che's approximation for one LRU cache of
independent objects (hit(i) = 1 - exp(-p_i T), with T solving sum_i (1 - exp(-p_i T)) = C);
random routing over N caches of C equals one cache of C; partitioned routing over N caches
of C equals one cache of N x C.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pcr_sglang.core.chunk_tree import ChunkTree
from pcr_sglang.core.keys import CacheNamespace, chunk_keys, root_key
from pcr_sglang.core.lookahead import LookaheadProtection
from pcr_tools.workload import zipf_weights

POLICIES = ("random", "round_robin", "cache_aware", "prefix_hash")
SYSTEM_CHUNK = -1


@dataclass(frozen=True)
class Workload:
    docs: int = 1_000_000
    zipf: float = 1.0
    doc_chunks: int = 4
    neighbours: int = 3
    requests: int = 20_000
    seed: int = 0


def zipf_sampler(n: int, alpha: float, rng: np.random.Generator):
    weights = np.asarray(zipf_weights(n, alpha))
    cdf = np.cumsum(weights / weights.sum())
    return lambda size: np.minimum(np.searchsorted(cdf, rng.random(size)), n - 1), weights / weights.sum()


def make_requests(w: Workload) -> list[list[bytes]]:
    """Chunk keys per request (the question chunk is unique per request)."""
    rng = np.random.default_rng(w.seed)
    sample, _ = zipf_sampler(w.docs, w.zipf, rng)
    topics = sample(w.requests)
    root = root_key(CacheNamespace("fleet-sim", "bf16", 1).chain_digest())
    requests = []
    for i, topic in enumerate(topics):
        ids = [SYSTEM_CHUNK]
        for d in range(w.neighbours):
            doc = (int(topic) + d) % w.docs
            ids.extend(doc * w.doc_chunks + j for j in range(w.doc_chunks))
        ids.append(-(2 + i))  # the question
        requests.append(chunk_keys(root, ids, 1))
    return requests


@dataclass(frozen=True)
class Costs:
    chunk_tokens: int = 64
    bytes_per_token: int = 128 << 10  # Llama-3.1-8B in bf16
    prefill_tps: float = 15_000.0
    pcie_gbps: float = 25.0
    net_gbps: float = 1.25  # 10 GbE
    rtt_us: float = 50.0

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.bytes_per_token

    def service_s(self, local: int, remote: int, computed: int) -> float:
        """Prefill time: a remote chunk is read or recomputed, whichever is faster (as
        PCR's load-or-recompute model decides)."""
        recompute = self.chunk_tokens / self.prefill_tps
        fetch = self.chunk_bytes / (self.net_gbps * 1e9) + self.rtt_us * 1e-6
        return computed * recompute + local * self.chunk_bytes / (self.pcie_gbps * 1e9) + remote * min(fetch, recompute)


class LruChains:
    """One cache: PCR's chunk tree with LRU eviction (and optional look-ahead protection)."""

    def __init__(self, capacity: int, window: int = 0):
        self.tree = ChunkTree()
        self.capacity = capacity
        self.protection = LookaheadProtection(self.tree, window) if window else None

    def match(self, keys: Sequence[bytes], touch: bool = True) -> int:
        return self.tree.match(iter(keys), touch=touch).num_chunks

    def admit(self, keys: Sequence[bytes], upcoming: Sequence[Sequence[bytes]] = ()) -> int:
        """Serve ``keys``: count the cached prefix, cache the rest (evicting LRU leaves)."""
        if self.protection is not None:
            self.protection.refresh(list(upcoming))
        outcome = self.tree.match(iter(keys))
        self.tree.lock(outcome.last_node)
        new = len(keys) - outcome.num_chunks
        overflow = self.tree.num_chunks + new - self.capacity
        if overflow > 0:
            self.tree.evict(overflow, is_protected=self.protection.__contains__ if self.protection else None)
        keep = outcome.num_chunks + min(new, max(0, self.capacity - self.tree.num_chunks))
        self.tree.insert(keys[:keep], [True] * keep)  # device values: any non-None
        self.tree.unlock(outcome.last_node)
        return outcome.num_chunks


@dataclass
class Router:
    policy: str
    servers: int
    rng: np.random.Generator
    cache_threshold: float = 0.3
    balance_abs: int = 32
    balance_rel: float = 1.1
    load_factor: float = 1.25
    inflight: int = 4
    _next: int = 0
    _recent: deque = field(default_factory=deque)
    _load: list[int] = field(default_factory=list)
    _routed: dict[bytes, set[int]] = field(default_factory=dict)  # cache_aware's approximate tree
    _ring: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._load = [0] * self.servers
        if self.policy == "prefix_hash":
            self._ring = sorted(
                (int.from_bytes(hashlib.blake2b(f"{s}/{v}".encode(), digest_size=8).digest(), "big"), s)
                for s in range(self.servers)
                for v in range(64)
            )

    def _least_loaded(self, among: Optional[Sequence[int]] = None) -> int:
        candidates = range(self.servers) if among is None else among
        return min(candidates, key=lambda s: (self._load[s], s))

    def route(self, keys: Sequence[bytes]) -> int:
        if self.policy == "random":
            server = int(self.rng.integers(self.servers))
        elif self.policy == "round_robin":
            server, self._next = self._next, (self._next + 1) % self.servers
        elif self.policy == "cache_aware":
            server = self._cache_aware(keys)
        else:
            server = self._prefix_hash(keys)
        self._recent.append(server)
        self._load[server] += 1
        if len(self._recent) > self.inflight * self.servers:
            self._load[self._recent.popleft()] -= 1
        return server

    def _cache_aware(self, keys: Sequence[bytes]) -> int:
        loads = self._load
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * max(min(loads), 1):
            server = self._least_loaded()
        else:
            holders: Optional[set[int]] = None
            depth = 0
            for key in keys:
                owners = self._routed.get(key)
                narrowed = owners if holders is None else (holders & owners if owners else set())
                if not narrowed:
                    break
                holders, depth = narrowed, depth + 1
            if holders and depth / len(keys) > self.cache_threshold:
                server = self._least_loaded(sorted(holders))
            else:
                server = self._least_loaded()
        for key in keys:
            self._routed.setdefault(key, set()).add(server)
        return server

    def _prefix_hash(self, keys: Sequence[bytes]) -> int:
        point = int.from_bytes(keys[min(1, len(keys) - 1)][:8], "big")  # system prompt + first document
        start = bisect.bisect(self._ring, (point, -1)) % len(self._ring)
        cap = self.load_factor * max(sum(self._load) / self.servers, 1.0)
        for i in range(len(self._ring)):
            server = self._ring[(start + i) % len(self._ring)][1]
            if self._load[server] + 1 <= cap:
                return server
        return self._least_loaded()


@dataclass
class Result:
    """What one fleet served: per server, its requests and its chunks by where they came from.

    The projected TTFT is a function of these and of a cost model, so one simulation is
    priced under several networks (:meth:`ttft_ms`)."""

    policy: str
    servers: int
    shared: bool
    requests: list[int]  # per server
    local_chunks: list[int]  # per server: chunks found in its own cache
    remote_chunks: list[int]  # per server: chunks only the shared tier held
    computed_chunks: list[int]  # per server
    seconds: float

    @property
    def total_chunks(self) -> int:
        return sum(self.local_chunks) + sum(self.remote_chunks) + sum(self.computed_chunks)

    @property
    def local_hit(self) -> float:
        return sum(self.local_chunks) / self.total_chunks

    @property
    def remote_hit(self) -> float:
        return sum(self.remote_chunks) / self.total_chunks

    @property
    def hit(self) -> float:
        return self.local_hit + self.remote_hit

    @property
    def imbalance(self) -> float:
        """The busiest server's requests over the mean."""
        return max(self.requests) * self.servers / sum(self.requests)

    def ttft_ms(self, costs: Costs, rate: float) -> float:
        """Mean projected TTFT at ``rate`` requests/s offered to the whole fleet: each server
        an M/M/1 queue at its share of the rate, with its mean service time under ``costs``
        (service time is linear in the chunk counts, so per-server sums suffice)."""
        total = sum(self.requests)
        weighted = 0.0
        for s in range(self.servers):
            if not self.requests[s]:
                continue
            mean_s = (
                costs.service_s(self.local_chunks[s], self.remote_chunks[s], self.computed_chunks[s]) / self.requests[s]
            )
            rho = rate * self.requests[s] / total * mean_s
            weighted += self.requests[s] * (mean_s / (1 - rho) if rho < 1 else math.inf)
        return 1000 * weighted / total


def simulate(
    requests: list[list[bytes]],
    servers: int,
    policy: str,
    local_chunks: int,
    shared_chunks: int,
    window: int = 8,
    seed: int = 0,
) -> Result:
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    router = Router(policy, servers, rng)
    caches = [LruChains(local_chunks, window) for _ in range(servers)]
    shared = LruChains(shared_chunks) if shared_chunks else None
    routed = [router.route(keys) for keys in requests]
    by_server: list[list[int]] = [[] for _ in range(servers)]
    for i, s in enumerate(routed):
        by_server[s].append(i)
    position = [0] * servers
    local, remote, computed = [0] * servers, [0] * servers, [0] * servers
    for i, keys in enumerate(requests):
        s = routed[i]
        position[s] += 1
        upcoming = [requests[j] for j in by_server[s][position[s] : position[s] + window]]
        hit = caches[s].admit(keys, upcoming)
        far = 0
        if shared is not None:
            far = max(shared.match(keys, touch=False) - hit, 0)
            shared.admit(keys)  # read what it had, write the rest through
        local[s] += hit
        remote[s] += far
        computed[s] += len(keys) - hit - far
    return Result(
        policy,
        servers,
        shared is not None,
        [len(b) for b in by_server],
        local,
        remote,
        computed,
        time.perf_counter() - started,
    )


@dataclass(frozen=True)
class Network:
    """The link to the shared tier, for pricing remote reads."""

    name: str
    gbps: float  # GB/s
    rtt_us: float


def parse_networks(text: str) -> list[Network]:
    """``NAME=GBPS@RTT_US,...`` (GB/s and microseconds), e.g. ``10GbE=1.25@50,RDMA=25@10``."""
    networks = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            name, rest = item.split("=", 1)
            gbps, rtt = rest.split("@", 1)
            networks.append(Network(name.strip(), float(gbps), float(rtt)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--networks: {item!r} is not NAME=GBPS@RTT_US") from None
        if networks[-1].gbps <= 0 or networks[-1].rtt_us < 0:
            raise argparse.ArgumentTypeError(f"--networks: {item!r} needs GBPS > 0 and RTT_US >= 0")
    if not networks:
        raise argparse.ArgumentTypeError("--networks: name at least one NAME=GBPS@RTT_US")
    return networks


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


# ---------------------------------------------------------------------------- closed forms
def che_hit_ratio(probabilities: np.ndarray, capacity: int) -> float:
    """Che's approximation of an LRU cache's hit ratio under independent requests."""
    lo, hi = 0.0, 1.0
    while np.sum(1 - np.exp(-probabilities * hi)) < capacity:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.sum(1 - np.exp(-probabilities * mid)) < capacity else (lo, mid)
    return float(np.sum(probabilities * (1 - np.exp(-probabilities * lo))))


def checks(
    docs: int = 20_000,
    alpha: float = 0.9,
    requests: int = 60_000,
    capacity: int = 1_000,
    servers: int = 8,
    seed: int = 1,
) -> list[tuple[str, float, float]]:
    """(what, simulated, closed form) for one-chunk objects under Zipf(alpha)."""
    rng = np.random.default_rng(seed)
    sample, p = zipf_sampler(docs, alpha, rng)
    root = root_key(CacheNamespace("fleet-sim-check", "bf16", 1).chain_digest())
    objects = [chunk_keys(root, [int(d)], 1) for d in sample(requests)]
    warm = requests // 3  # measured after the caches filled

    def hit_ratio(route, caches) -> float:
        hits = 0
        for i, keys in enumerate(objects):
            h = caches[route(i, keys)].admit(keys)
            hits += h if i >= warm else 0
        return hits / (requests - warm)

    one = hit_ratio(lambda i, k: 0, [LruChains(capacity)])
    rand = hit_ratio(lambda i, k: int(rng.integers(servers)), [LruChains(capacity) for _ in range(servers)])
    part = hit_ratio(lambda i, k: k[0][0] % servers, [LruChains(capacity) for _ in range(servers)])
    return [
        (f"one LRU cache of {capacity} (Che)", one, che_hit_ratio(p, capacity)),
        (f"random over {servers} caches of {capacity} (= one of {capacity})", rand, che_hit_ratio(p, capacity)),
        (
            f"partitioned over {servers} caches of {capacity} (= one of {servers * capacity})",
            part,
            che_hit_ratio(p, servers * capacity),
        ),
    ]


def plot(rows: list[dict], networks: Sequence[Network], path: Path) -> Path:
    """One column per corpus size; rows: hit ratio, load imbalance, projected TTFT per network.
    A colour per policy; solid without the shared tier, dashed with it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = sorted({r["docs"] for r in rows})
    metrics = [("hit", "hit ratio (prompt chunks reused)"), ("imbalance", "busiest server / mean")]
    metrics += [(f"ttft_ms[{n.name}]", f"projected TTFT, ms ({n.name})") for n in networks]
    fig, axes = plt.subplots(
        len(metrics), len(corpora), figsize=(4.2 * len(corpora), 3.0 * len(metrics)), squeeze=False, sharex=True
    )
    colours = dict(zip(POLICIES, ("tab:grey", "tab:blue", "tab:red", "tab:green")))
    for col, docs in enumerate(corpora):
        for row, (metric, label) in enumerate(metrics):
            ax = axes[row][col]
            for policy in POLICIES:
                for shared in (False, True):
                    points = sorted(
                        (r["servers"], _metric(r, metric))
                        for r in rows
                        if r["docs"] == docs and r["policy"] == policy and r["shared"] == shared
                    )
                    if points:
                        ax.plot(
                            *zip(*points),
                            marker="o",
                            markersize=3,
                            color=colours[policy],
                            linestyle="--" if shared else "-",
                            label=f"{policy}{' + shared tier' if shared else ''}",
                        )
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            if row == 0:
                ax.set_title(f"{docs:,} documents")
            if col == 0:
                ax.set_ylabel(label)
            if row == len(metrics) - 1:
                ax.set_xlabel("servers")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _metric(row: dict, metric: str) -> float:
    if metric.startswith("ttft_ms["):
        return row["ttft_ms"][metric[len("ttft_ms[") : -1]]
    return row[metric]


def main(argv: Optional[list[str]] = None) -> int:
    import datetime

    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet_sim",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--check", action="store_true", help="only the closed-form checks")
    parser.add_argument(
        "--docs",
        type=int_list,
        default=[10_000, 100_000, 1_000_000],
        help="corpus sizes, comma-separated (one table each)",
    )
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--doc-chunks", type=int, default=4)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--servers", type=int_list, default=[2, 8, 32, 128, 256])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--local-chunks", type=int, default=2_000, help="each server's cache, in chunks")
    parser.add_argument(
        "--shared-per-server",
        type=int,
        default=2_000,
        help="shared-tier chunks each server adds (0: no shared tier runs)",
    )
    parser.add_argument("--chunk-tokens", type=int, default=64)
    parser.add_argument("--prefill-tps", type=float, default=15_000.0)
    parser.add_argument("--pcie-gbps", type=float, default=25.0)
    parser.add_argument(
        "--networks",
        type=parse_networks,
        default=parse_networks("10GbE=1.25@50,RDMA=25@10"),
        help="links to the shared tier to price remote reads over, NAME=GB/s@RTT_us, "
        "comma-separated (one TTFT column each)",
    )
    parser.add_argument("--rate-per-server", type=float, default=4.0, help="requests/s per server offered")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default=f"bench/results/{datetime.date.today().isoformat()}/fleet_sim",
        help="folder for results.json and fleet_sim.png (default: bench/results/<today>/fleet_sim; "
        "'' to write nothing)",
    )
    args = parser.parse_args(argv)
    for flag, value in (
        ("--requests", args.requests),
        ("--local-chunks", args.local_chunks),
        ("--chunk-tokens", args.chunk_tokens),
        ("--doc-chunks", args.doc_chunks),
        ("--prefill-tps", args.prefill_tps),
        ("--pcie-gbps", args.pcie_gbps),
        ("--rate-per-server", args.rate_per_server),
        ("--zipf", args.zipf),
    ):
        if not value > 0:
            parser.error(f"{flag} must be > 0, got {value}")
    if args.shared_per_server < 0:
        parser.error(f"--shared-per-server must be >= 0, got {args.shared_per_server}")
    names = [n.name for n in args.networks]
    if len(set(names)) != len(names):
        parser.error(f"--networks: each link needs a name of its own, got {', '.join(names)}")
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)} (choose from {', '.join(POLICIES)})")
    print("Closed-form checks (one-chunk objects, Zipf 0.9, 20k objects):")
    print(f"{'case':<62} {'simulated':>9} {'formula':>9}")
    for what, simulated, formula in checks():
        print(f"{what:<62} {simulated:9.3f} {formula:9.3f}")
    if args.check:
        return 0
    prices = {
        n.name: Costs(
            args.chunk_tokens, prefill_tps=args.prefill_tps, pcie_gbps=args.pcie_gbps, net_gbps=n.gbps, rtt_us=n.rtt_us
        )
        for n in args.networks
    }
    shared_options = (False, True) if args.shared_per_server else (False,)
    rows: list[dict] = []
    for docs in args.docs:
        requests = make_requests(Workload(docs, args.zipf, args.doc_chunks, requests=args.requests, seed=args.seed))
        print(
            f"\n{args.requests} requests over {docs} documents (Zipf {args.zipf}), {args.local_chunks} chunks "
            f"per server, shared tier {args.shared_per_server} chunks per server, {args.rate_per_server:g} req/s "
            f"per server"
        )
        print(
            f"{'servers':>7} {'policy':<12} {'shared':<6} {'hit':>6} {'local':>6} {'remote':>6} {'max/mean':>8} "
            + " ".join(f"{'TTFT ' + name:>14}" for name in prices)
        )
        for n in args.servers:
            for policy in policies:
                for shared in shared_options:
                    r = simulate(
                        requests,
                        n,
                        policy,
                        args.local_chunks,
                        args.shared_per_server * n if shared else 0,
                        seed=args.seed,
                    )
                    ttft = {name: r.ttft_ms(costs, args.rate_per_server * n) for name, costs in prices.items()}
                    rows.append(
                        {
                            "docs": docs,
                            "servers": n,
                            "policy": policy,
                            "shared": shared,
                            "hit": r.hit,
                            "local_hit": r.local_hit,
                            "remote_hit": r.remote_hit,
                            "imbalance": r.imbalance,
                            "ttft_ms": ttft,
                            "seconds": r.seconds,
                        }
                    )
                    print(
                        f"{n:>7} {policy:<12} {'yes' if shared else 'no':<6} {r.hit:6.1%} {r.local_hit:6.1%} "
                        f"{r.remote_hit:6.1%} {r.imbalance:8.2f} " + " ".join(f"{v:11.1f} ms" for v in ttft.values()),
                        flush=True,
                    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "check", "networks")}
        settings["networks"] = [vars(n) for n in args.networks]
        # A queue at or past saturation (rho >= 1) has no finite TTFT: null in the JSON.
        finite = [{**r, "ttft_ms": {k: v if math.isfinite(v) else None for k, v in r["ttft_ms"].items()}} for r in rows]
        (out / "results.json").write_text(json.dumps({"settings": settings, "rows": finite}, indent=1))
        print(f"\nwrote {out / 'results.json'} and {plot(rows, args.networks, out / 'fleet_sim.png')}")
    return 0
