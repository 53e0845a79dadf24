"""Scheduler step time with the most live KV hints: matched every step (before) or kept (now).

Each scheduler step used to match every live hint's whole chain from the root (in
``KvHints.live``), walk each chain twice more in the prefetch plan, and
once more to look for chunks to promote (``--pcr-hint-to-device``). The chains are now
kept matched (:mod:`pcr_sglang.core.hint_chains`) and updated by the tree's events.

The real :class:`~pcr_sglang.core.CacheState` and :class:`~pcr_sglang.core.hints.HintBook`,
``--hints`` live hints (the server's most, by default) of ``--chunks``-chunk prompts (512
chunks of 64 tokens: 32k-token prompts), no I/O process (orders stay in flight, as a slow
disk would leave them). Two states of the cache:

* ``ssd``: every chain on SSD only (after a restart); the first step orders the hint
  budget's reads, later steps find the budget full;
* ``hot``: every chain on the device (hints for documents already cached): the budget
  has room every step and nothing is left to read.

Per step: expire the book, then the prefetch plan with the live hints, then the search
for chunks to promote. The "before" column runs the code of a79cfb9 (the plan and read
ordering copied below, verbatim but for names) on the same state; "now" runs the
project's. Prints the median step time, wall clock and this process's CPU time (on a
shared machine the wall clock includes waiting for a core), over ``--repeats`` runs of
``--steps`` steps each (ten times as many for "now", which costs little), both measured
in one run, and checks that both ordered the same reads at every step both ran.

Usage: python bench/hint_step.py [--hints 256] [--chunks 512] [--steps 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from typing import Callable, Iterable, Sequence

from pcr_sglang.core import CacheState, CacheStateConfig, Effects
from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.hints import HintBook, HintLimits, HintPayload
from pcr_sglang.core.orders import ReadChunk, Reorder
from pcr_sglang.core.ssd_residency import PersistedChunk

CHUNK_TOKENS = 64


def chain_keys(prompt: int, chunks: int) -> list[bytes]:
    keys, parent = [], b"root"
    for i in range(chunks):
        parent = hashlib.blake2b(parent + f"{prompt}/{i}".encode(), digest_size=16).digest()
        keys.append(parent)
    return keys


def build(state_kind: str, hints: int, chunks: int) -> tuple[CacheState, HintBook]:
    total = hints * chunks
    config = CacheStateConfig(chunk_size=CHUNK_TOKENS, host_slots=4096, ssd_capacity_chunks=total + 1,
                              prefetch_budget_chunks=512, hint_budget_chunks=256)
    state = CacheState(config)
    book = HintBook(HintLimits(burst=hints, rate_per_s=1.0, max_ttl_s=3600.0))
    prompts = [chain_keys(p, chunks) for p in range(hints)]
    if state_kind == "ssd":
        records = []
        for keys in prompts:
            parent = bytes(16)
            for depth, key in enumerate(keys, 1):
                records.append(PersistedChunk(key, parent, depth))
                parent = key
        assert not state.restore(records)
    else:
        slot = 0
        for keys in prompts:
            state.insert(keys, list(range(slot, slot + len(keys))))
            slot += len(keys)
    for p, keys in enumerate(prompts):
        assert book.register(f"h{p}", keys, HintPayload(ttl_s=3600.0), now=0.0, tenant=f"salt:t{p % 8}")
    assert len(book) == hints
    return state, book


# ---------------------------------------------------------------- a79cfb9's step (before)
def old_order_reads(state: CacheState, nodes: Sequence[ChunkNode], effects: Effects, *, urgent: bool,
                    limit: int, hint: bool = False) -> int:
    from pcr_sglang.core.host_slots import SlotState
    from pcr_sglang.core.ssd_residency import PendingIo

    if not nodes or not state.ssd_enabled or not state.io_healthy:
        return 0
    ordered = 0
    state.tree.lock(nodes[-1])
    try:
        for node in nodes:
            seq = state._reading.get(node)
            if seq is not None:
                op = state._pending[seq]
                if urgent and not op.urgent and seq not in state._cancelling:
                    op.urgent = True
                    effects.orders.append(Reorder(seq, cancel=False))
                continue
            if node.on_host or node.on_device or not node.on_ssd or ordered >= limit:
                continue
            slot = state._take_slot(SlotState.FILLING, node, effects)
            if slot is None:
                break
            seq = next(state._seq)
            state.slots.io_begin(slot)
            state._pending[seq] = PendingIo(True, node, slot, urgent=urgent, prefetch=not urgent)
            state._reading[node] = seq
            effects.orders.append(ReadChunk(seq, node.key, slot, urgent))
            ordered += 1
    finally:
        state.tree.unlock(nodes[-1])
    if not urgent and not hint:
        state.ssd_stats.prefetch_issued += ordered
    return ordered


def old_plan_prefetch(state: CacheState, chains: Sequence[Sequence[ChunkNode]], keep: Iterable[ChunkNode],
                      effects: Effects, queue_depth: int, hinted: Sequence[Sequence[ChunkNode]] = ()) -> None:
    s = state
    s.ssd_stats.max_queue_depth = max(s.ssd_stats.max_queue_depth, queue_depth)
    needed = set(keep)
    hinted_held = len(s.unused.hinted)
    prefetching = sum(1 for op in s._pending.values()
                      if op.is_read and not op.urgent and op.node not in s.unused.hinted)
    room = s.config.host_slots // 2 - len(s._reading) - len(s.unused.landed)
    budget = min(s.config.prefetch_budget_chunks - prefetching, room)
    for chain in chains:
        needed.update(chain)
        if budget > 0:
            budget -= old_order_reads(s, chain, effects, urgent=False, limit=budget)
    hint_room = min(budget, s.config.hint_budget_chunks - hinted_held, s.config.host_slots // 4 - hinted_held)
    for chain in hinted:
        needed.update(chain)
        if hint_room > 0:
            before = {n for n in chain if n in s._reading}
            ordered = old_order_reads(s, chain, effects, urgent=False, limit=hint_room, hint=True)
            hint_room -= ordered
            if ordered:
                s.ssd_stats.hint_issued += ordered
                s.unused.hinted.update(n for n in chain if n in s._reading and n not in before)
    for node in [n for n in s.unused.landed if n not in needed]:
        s.unused.landed.discard(node)
        if node in s.unused.hinted:
            s.unused.hinted.discard(node)
            s.ssd_stats.hint_wasted += 1
        else:
            s.ssd_stats.prefetch_unused += 1
    for node, seq in s._reading.items():
        op = s._pending[seq]
        if not op.urgent and node not in needed and seq not in s._cancelling:
            s._cancelling.add(seq)
            effects.orders.append(Reorder(seq, cancel=True))
    for node in [n for n in s.unused.promoted if n not in needed]:
        s.unused.promoted.discard(node)
        s.unused.hinted.discard(node)
        s.ssd_stats.hint_wasted += 1
    s.unused.hinted = {n for n in s.unused.hinted if n in s._reading or n in s.unused.landed or n in s.unused.promoted}


def old_step(state: CacheState, book: HintBook, now: float) -> list:
    book.expire(now)
    hinted = [nodes for h in book.live() if (nodes := state.match(iter(h.keys), touch=False).nodes)]
    effects = Effects()
    old_plan_prefetch(state, [], [], effects, 0, hinted)
    for hint in book.live():  # the promotion search (KvHints.promote_hinted)
        state.promotable(state.match(iter(hint.keys), touch=False).host_nodes)
    return [o.key for o in effects.orders if isinstance(o, ReadChunk)]


# ---------------------------------------------------------------- the project's step (now)
def new_step(state: CacheState, book: HintBook, now: float) -> list:
    book.expire(now)
    effects = Effects()
    state.plan_prefetch([], [], effects, 0, book.live())
    for chain in state.hint_chains.tracked():  # the promotion search (KvHints.promote_hinted)
        state.hint_promotable(chain, 1 << 30)
    return [o.key for o in effects.orders if isinstance(o, ReadChunk)]


def measure(step: Callable, state: CacheState, book: HintBook, steps: int) -> tuple[float, float, list]:
    """Median wall and CPU seconds per step over ``steps`` steps after the first (which
    orders the budget's reads, or registers the chains), and the reads each step ordered."""
    reads = [step(state, book, 1.0)]
    wall, cpu = [], []
    for i in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        reads.append(step(state, book, 2.0 + i))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hints", type=int, default=HintLimits().max_live)
    parser.add_argument("--chunks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.hints} live hints x {args.chunks} chunks ({args.chunks * CHUNK_TOKENS} tokens each), "
          f"median step over {args.repeats} x {args.steps} steps (now: {args.repeats} x {10 * args.steps})")
    print(f"{'cache':>6} {'before ms':>10} {'now ms':>8} {'speed-up':>9} {'before CPU ms':>14} "
          f"{'now CPU ms':>11}  same reads")
    for kind in ("ssd", "hot"):
        before, now, same = [], [], True
        for _ in range(args.repeats):
            state, book = build(kind, args.hints, args.chunks)
            old = measure(old_step, state, book, args.steps)
            state, book = build(kind, args.hints, args.chunks)
            new = measure(new_step, state, book, 10 * args.steps)
            before.append(old[:2])
            now.append(new[:2])
            same &= old[2] == new[2][: args.steps + 1]
        b, n = (statistics.median(t[0] for t in before) * 1e3, statistics.median(t[0] for t in now) * 1e3)
        bc, nc = (statistics.median(t[1] for t in before) * 1e3, statistics.median(t[1] for t in now) * 1e3)
        print(f"{kind:>6} {b:10.2f} {n:8.3f} {b / n:8.0f}x {bc:14.2f} {nc:11.3f}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
