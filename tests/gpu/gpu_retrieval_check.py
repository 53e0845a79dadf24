"""GPU check for look-ahead retrieval's fast tier (run it when a CUDA machine is at hand).

1. Copy bandwidth: clusters of an IVF table copied into the GPU fast tier
   (:class:`~pcr_client.rag.fast_device.DeviceClusterTier`: staged in pinned memory, copied
   on the tier's own stream, an event per cluster), against one ``copy_`` of a contiguous
   pinned buffer of the same size (what the copy engine reaches at best).
2. Overlap with decoding: a decode-loop stand-in (a stack of ``[batch, hidden] x [hidden,
   hidden]`` matmuls per step on the default stream: 2.1 GB of fp32 weights read per step
   at ``--hidden 4096 --layers 32``, an eighth of an 8B model's in bf16), each step timed
   to the end of its own stream's work, alone and while the tier copies clusters on its
   stream: the step-time ratio is what a look-ahead costs the LLM it runs beside.
3. Search: the merged search (landed clusters searched on the GPU, the rest by faiss on
   the CPU, merged) against faiss-cpu's IVF search alone at the same ``nprobe``: identical
   results (exact mode) and median latency, with every probed cluster landed, and with
   half of them.

The table is synthetic: ``--vectors`` jittered copies of ``--centres`` random centres in
``--dim`` dimensions (all-MiniLM's 384 by default), clustered by faiss. Without a GPU it
runs on the CPU (``--device cpu``, the same classes with a torch buffer and no streams) so
the script does not rot, and says so: those figures are not GPU figures.

Usage: python -m tests.gpu.gpu_retrieval_check [--vectors 1000000] [--nlist 1024] [--nprobe 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from pcr_client.rag.fast_device import DeviceClusterTier
from pcr_client.rag.ivf import IVFDatastore, normalized
from pcr_client.rag.lookahead import LookaheadRetriever


def synthetic_vectors(count: int, dim: int, centres: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((centres, dim)).astype(np.float32)
    out = np.empty((count, dim), np.float32)
    for start in range(0, count, 100_000):  # in blocks: a 1M x 384 draw at once doubles peak memory
        end = min(start + 100_000, count)
        out[start:end] = base[rng.integers(0, centres, end - start)] + 0.8 * rng.standard_normal(
            (end - start, dim)
        ).astype(np.float32)
    return normalized(out)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(datastore: IVFDatastore, device: torch.device, budget_bytes: int) -> dict:
    table = datastore.table
    order = np.argsort(-np.diff(np.asarray(table.offsets)))  # largest clusters first
    chosen, total = [], 0
    for c in order:
        if total + table.nbytes(int(c)) > budget_bytes:
            continue
        chosen.append(int(c))
        total += table.nbytes(int(c))
    tier = DeviceClusterTier(table, int(total * 1.2) + (64 << 20), device=str(device))
    try:
        start = time.perf_counter()
        tier.submit(chosen)
        assert tier.wait_landed(chosen, timeout_s=600), "clusters did not land"
        tier_s = time.perf_counter() - start
    finally:
        tier.close()
    rows = sum(table.size(c) for c in chosen)
    host = torch.empty((rows, table.dim), dtype=torch.float32, pin_memory=device.type == "cuda")
    dest = torch.empty_like(host, device=device)
    dest.copy_(host, non_blocking=True)
    sync(device)
    start = time.perf_counter()
    dest.copy_(host, non_blocking=True)
    sync(device)
    plain_s = time.perf_counter() - start
    return {
        "clusters": len(chosen),
        "bytes": total,
        "tier_gb_s": total / tier_s / 1e9,
        "tier_measured_gb_s": (tier.stats.bandwidth_bytes_s or 0) / 1e9,
        "contiguous_pinned_gb_s": total / plain_s / 1e9,
    }


def decode_overlap(
    datastore: IVFDatastore, device: torch.device, hidden: int, layers: int, batch: int, steps: int
) -> dict:
    weights = [torch.randn(hidden, hidden, device=device) / hidden**0.5 for _ in range(layers)]
    x0 = torch.randn(batch, hidden, device=device)

    def step() -> None:
        x = x0
        for w in weights:
            x = torch.tanh(x @ w)

    def timed_steps(until=None) -> list[float]:
        """``steps`` steps, or (``until``) steps until it returns True, at most 100 x ``steps``."""
        samples = []
        while len(samples) < (100 * steps if until else steps) and not (until and until()):
            start = time.perf_counter()
            step()
            if device.type == "cuda":  # this stream only: a device-wide sync would wait for the copies
                torch.cuda.current_stream(device).synchronize()
            samples.append(time.perf_counter() - start)
        return samples

    step()
    sync(device)
    alone = timed_steps()
    table = datastore.table
    clusters = list(range(table.nlist))
    tier = DeviceClusterTier(table, sum(table.nbytes(c) for c in clusters) * 2 + (64 << 20), device=str(device))
    try:
        start = time.perf_counter()
        tier.submit(clusters)  # the whole table, copied on the tier's thread and stream while the steps run
        beside = timed_steps(until=lambda: tier.stats.landed == len(clusters))
        copy_s = time.perf_counter() - start
        copied_during = tier.stats.bytes_copied
        tier.wait_landed(clusters, timeout_s=600)
    finally:
        tier.close()
    if not beside:
        beside = alone  # the copies ended before a step did: nothing to compare
    return {
        "step_ms_alone": 1000 * statistics.median(alone),
        "step_ms_with_copies": 1000 * statistics.median(beside),
        "slowdown": statistics.median(beside) / statistics.median(alone),
        "steps_during_copies": len(beside),
        "copy_s": copy_s,
        "bytes_copied_during": copied_during,
    }


def search_check(
    datastore: IVFDatastore, queries: np.ndarray, device: torch.device, nprobe: int, k: int, landed_share: float
) -> dict:
    table = datastore.table
    _, probes = datastore.probe(queries, nprobe)
    probed = sorted({int(c) for c in probes.ravel() if c >= 0})
    held = probed[: max(1, int(len(probed) * landed_share))]
    tier = DeviceClusterTier(table, sum(table.nbytes(c) for c in held) * 2 + (64 << 20), device=str(device))
    try:
        tier.submit(held)
        assert tier.wait_landed(held, timeout_s=600), "clusters did not land"
        retriever = LookaheadRetriever(datastore, embed=None, nprobe=nprobe, k=k, tier=tier)
        merged_s, faiss_s, identical, hits = [], [], 0, 0
        for q in queries:
            start = time.perf_counter()
            got = retriever.search_vectors(q[None])
            merged_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            ref_d, ref_i = datastore.search(q[None], k, nprobe)
            faiss_s.append(time.perf_counter() - start)
            hits += got.stats.hits
            identical += same_results(got.distances[0], got.ids[0], ref_d[0], ref_i[0])
        retriever.close()
    finally:
        tier.close()
    return {
        "landed_share": landed_share,
        "queries": len(queries),
        "identical": identical,
        "cluster_hit_rate": hits / probes.size,
        "merged_ms": 1000 * statistics.median(merged_s),
        "faiss_cpu_ms": 1000 * statistics.median(faiss_s),
    }


def same_results(d: np.ndarray, i: np.ndarray, ref_d: np.ndarray, ref_i: np.ndarray, tol: float = 1e-5) -> bool:
    """The same ids, but for ties at the k-th score (either side may keep either)."""
    if set(i.tolist()) == set(ref_i.tolist()):
        return True
    extra = set(i.tolist()) ^ set(ref_i.tolist())
    scores = dict(zip(np.r_[i, ref_i].tolist(), np.r_[d, ref_d].tolist()))
    return all(abs(scores[e] - ref_d[-1]) < tol for e in extra)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.gpu.gpu_retrieval_check",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vectors", type=int, default=None, help="default 1,000,000 on a GPU, 20,000 on the CPU")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--centres", type=int, default=2_000)
    parser.add_argument("--nlist", type=int, default=None, help="default 1024 on a GPU, 64 on the CPU")
    parser.add_argument("--nprobe", type=int, default=32)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--copy-gb", type=float, default=2.0, help="clusters copied for the bandwidth figure")
    parser.add_argument(
        "--hidden", type=int, default=None, help="decode stand-in width (4096 on a GPU, 256 on the CPU)"
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    gpu = device.type == "cuda"
    vectors = args.vectors or (1_000_000 if gpu else 20_000)
    nlist = args.nlist or (1024 if gpu else 64)
    hidden = args.hidden or (4096 if gpu else 256)
    nprobe = min(args.nprobe, nlist)
    if not gpu:
        print("No GPU: running on the CPU so the script does not rot. These are not GPU figures.")
    else:
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    start = time.perf_counter()
    data = synthetic_vectors(vectors, args.dim, args.centres, args.seed)
    datastore = IVFDatastore.build(data, nlist, seed=args.seed)
    print(
        f"table: {vectors:,} x {args.dim} ({data.nbytes / 1e9:.2f} GB), {nlist} clusters, built in "
        f"{time.perf_counter() - start:.1f} s"
    )
    rng = np.random.default_rng(args.seed + 1)
    queries = normalized(
        data[rng.integers(0, vectors, args.queries)]
        + 0.3 * rng.standard_normal((args.queries, args.dim)).astype(np.float32)
    )
    report = {"device": str(device), "vectors": vectors, "dim": args.dim, "nlist": nlist, "nprobe": nprobe}

    report["copy"] = copy_bandwidth(datastore, device, int(args.copy_gb * 1e9))
    c = report["copy"]
    print(
        f"\n1. copy: {c['clusters']} clusters, {c['bytes'] / 1e9:.2f} GB: fast tier {c['tier_gb_s']:.1f} GB/s "
        f"end to end (copy thread's own measure {c['tier_measured_gb_s']:.1f} GB/s), one contiguous pinned "
        f"copy_ {c['contiguous_pinned_gb_s']:.1f} GB/s"
    )

    report["overlap"] = decode_overlap(datastore, device, hidden, args.layers, args.batch, args.steps)
    o = report["overlap"]
    print(
        f"2. decode stand-in ({args.layers} x [{args.batch}, {hidden}] x [{hidden}, {hidden}]): "
        f"{o['step_ms_alone']:.2f} ms/step alone, {o['step_ms_with_copies']:.2f} ms/step while "
        f"{o['bytes_copied_during'] / 1e9:.2f} GB of clusters copied in {o['copy_s']:.2f} s "
        f"({o['steps_during_copies']} steps, x{o['slowdown']:.2f})"
    )

    report["search"] = []
    for share in (1.0, 0.5):
        s = search_check(datastore, queries, device, nprobe, args.k, share)
        report["search"].append(s)
        print(
            f"3. search, {share:.0%} of probed clusters landed: identical to faiss IVF {s['identical']}/"
            f"{s['queries']}, cluster hit rate {s['cluster_hit_rate']:.0%}, median merged {s['merged_ms']:.2f} ms, "
            f"faiss-cpu alone {s['faiss_cpu_ms']:.2f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(s["identical"] == s["queries"] for s in report["search"]) else 1


if __name__ == "__main__":
    sys.exit(main())
