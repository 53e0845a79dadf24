"""What the worst request ``pcr_doc_bounds`` allows costs the scheduler thread, per step.

Review finding 4: one request marking 2,000 two-token documents cost 1.44 s of hashing
in the scheduler thread before its warm-ups. Now a request marks at most
``--pcr-doc-max-documents`` (64) documents of at least ``--pcr-doc-min-tokens`` (16)
tokens, the leading tokens ``S`` are hashed once per request, and its warm-ups in flight
are capped (8 per request, 16 per server).

This drives PCR's cache over SGLang's real CPU KV pool and allocator the way SGLang's
scheduler does (``on_scheduler_step`` with the waiting queue, ``match_prefix`` and
``init_load_back`` at admission), without a server and without a model: what it times
is PCR's work in the scheduler thread (hashing, matching the window's chains, the
look-ahead protection, planning and copying the reused documents' KV into private
slots), not forward passes, as the thread's CPU time. A concurrent request waits in the queue throughout; each
step is timed in three phases, in one run:

* ``alone``: the concurrent request only;
* ``worst waiting``: the worst allowed request (64 documents of 16 tokens behind an
  ``S`` of ``--leading`` tokens, its documents' canonical chains cached as after its
  ``pcr_doc_warm``) ahead of it, with the warm-ups the caps let be in flight (8 canonical
  requests ``S ‖ d ‖ pad``) in the queue too; the request's first step (its keys are hashed
  then) is reported apart;
* ``admission``: the step that admits it (match, plan, copy and rotation of 64 documents).

Then, for contrast, the old unbounded cost: 2,000 two-token documents' canonical keys
hashed the old way (each ``S ‖ d ‖ pad`` from scratch, as the scheduler did before) and
the new way (``S`` once); such a request now gets HTTP 400 at the tokenizer.

Run: ``python bench/doc_bounds_step.py`` (about half a minute on two cores).
"""

from __future__ import annotations

import argparse
import statistics
import time
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from pcr_sglang.config import PCRConfig
from pcr_sglang.core import CacheNamespace
from pcr_sglang.core.keys import chunk_keys, root_key
from pcr_sglang.flags import DEFAULT_CHUNK_SIZE, DEFAULT_DOC_MAX_DOCUMENTS, DEFAULT_DOC_MIN_TOKENS
from pcr_sglang.reuse import settings as reuse_settings
from pcr_sglang.reuse.bounds import Recompute, parse_doc_bounds
from pcr_sglang.reuse.placement import DocReuse
from pcr_sglang.reuse.plan import canonical_chain_keys, canonical_tokens
from pcr_sglang.reuse.tokenizer import WarmupCaps
from pcr_sglang.sglang_adapter.factory import assemble_pcr_cache
from pcr_sglang.transfer.rope_shift import RopeSpec

LAYERS, HEADS, DIM = 2, 2, 8
PAD = 0


@dataclass
class Req:
    """The fields of SGLang's ``Req`` the cache reads (as the unit harness's ``FakeReq``)."""

    rid: str
    origin_input_ids: array
    sampling_params: object = None
    output_ids: array = field(default_factory=lambda: array("q"))
    extra_key: Optional[str] = None
    cache_salt: Optional[str] = None
    prefix_len: int = 0
    last_node: object = None
    storage_hit_length: int = 0
    storage_hit_start: Optional[int] = None
    kv: object = None


def build(chunk: int, pool: int):
    kvcache = MHATokenToKVPool(pool, 1, torch.float32, HEADS, DIM, LAYERS, "cpu", False)
    allocator = TokenToKVPoolAllocator(pool, torch.float32, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=1)
    config = PCRConfig(enabled=True, chunk_size=chunk, lookahead_window=8, doc_reuse="concat")
    cache = assemble_pcr_cache(params, config, CacheNamespace("bench", "float32", chunk), None, 0)
    cache.scheduler.docs = DocReuse(cache.state, Recompute("concat"), chunk, PAD,
                                    RopeSpec(DIM, DIM, True, (1.0, 0.1, 0.01, 0.001)),
                                    list(zip(kvcache.k_buffer, kvcache.v_buffer)), allocator,
                                    cache.scheduler.keyer, cache.scheduler.executor.free_private,
                                    limits=reuse_settings.limits(config))
    return cache, allocator


def insert(cache, allocator, tokens: list[int]) -> None:
    """Cache ``tokens``' whole chunks on the device (as a finished prefill would)."""
    slots = allocator.alloc(len(tokens))
    assert slots is not None, "the pool is too small"
    result = cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots.to(torch.int64)))
    allocator.free(slots[: result.prefix_len])
    allocator.free(slots[result.total_len:])


def worst_prompt(leading: int, documents: int, doc_tokens: int) -> tuple[list[int], list[int]]:
    tokens, bounds = [1] + [11 + i % 97 for i in range(leading - 1)], []
    for d in range(documents):
        bounds += [len(tokens), len(tokens) + doc_tokens]
        tokens += [1000 + d * doc_tokens + i for i in range(doc_tokens)]
    return tokens + [7, 7, 7, 7], bounds


def timed(fn) -> float:
    """CPU seconds of this (the scheduler's) thread: on a shared machine wall time would
    mostly count waiting for a core."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def run(args: argparse.Namespace) -> None:
    chunk, docs, doc_tokens = args.chunk, DEFAULT_DOC_MAX_DOCUMENTS, DEFAULT_DOC_MIN_TOKENS
    tokens, bounds = worst_prompt(args.leading, docs, doc_tokens)
    pool = 4 * len(tokens) + docs * 2 * chunk + 8 * args.concurrent_tokens
    cache, allocator = build(chunk, pool)
    spans = parse_doc_bounds(bounds, len(tokens))
    for span in spans:  # the documents' canonical chains, as after the request's pcr_doc_warm
        insert(cache, allocator, canonical_tokens(tokens, span, spans[0].start, chunk, PAD))
    concurrent_tokens = [2] + [300 + i % 89 for i in range(args.concurrent_tokens - 1)]
    insert(cache, allocator, concurrent_tokens[: len(concurrent_tokens) // 2])  # half of it cached
    concurrent = Req("concurrent", array("q", concurrent_tokens))
    caps = WarmupCaps()
    warmups = [Req(f"warm-{i}", array("q", canonical_tokens(tokens, spans[i], spans[0].start, chunk, PAD)),
                   SimpleNamespace(custom_params={"pcr_canonical_doc": 1}))
               for i in range(min(caps.per_request, docs))]

    def step(queue: list[Req]) -> None:
        cache.on_scheduler_step(queue)
        cache.match_prefix(MatchPrefixParams(key=RadixKey(concurrent.origin_input_ids), req=concurrent))

    alone = [timed(lambda: step([concurrent])) for _ in range(args.steps)]
    first, waiting, admission = [], [], []
    for trial in range(args.trials):
        worst = Req(f"worst-{trial}", array("q", tokens), SimpleNamespace(custom_params={
            "pcr_doc_bounds": bounds, "pcr_doc_warm": True}))
        queue = [worst, *warmups, concurrent]
        first.append(timed(lambda: step(queue)))  # its canonical keys are hashed here, once
        waiting += [timed(lambda: step(queue)) for _ in range(args.steps // args.trials)]

        def admit() -> None:
            step(queue)
            match = cache.match_prefix(MatchPrefixParams(key=RadixKey(worst.origin_input_ids), req=worst))
            worst.prefix_len, worst.last_node = match.device_prefix_len, match.last_device_node
            worst.kv = SimpleNamespace(cache_protected_len=0)
            cache.inc_lock_ref(match.last_device_node)
            try:
                loaded, _ = cache.init_load_back(InitLoadBackParams(
                    best_match_node=match.best_match_node, host_hit_length=match.host_hit_length, req=worst))
            finally:
                cache.dec_lock_ref(match.last_device_node)
            assert loaded > len(tokens) - args.leading - 8, (loaded, match.host_hit_length)

        admission.append(timed(admit))
        cache.scheduler.release(worst.rid)  # its private slots go back (it never got a row)
    cache.state.check()

    root = root_key(b"bench")
    old_tokens, old_bounds = worst_prompt(args.leading, 2000, 2)
    old_spans = parse_doc_bounds(old_bounds, len(old_tokens))
    old = timed(lambda: [chunk_keys(root, canonical_tokens(old_tokens, span, old_spans[0].start, chunk, PAD), chunk)
                         for span in old_spans])
    new = timed(lambda: canonical_chain_keys(root, old_tokens, old_spans, chunk, PAD))

    ms = lambda values: 1000 * statistics.median(values)  # noqa: E731
    print(f"PCR scheduler-thread work per step (CPU harness, no forward passes, thread CPU time), chunk {chunk}, "
          f"S {args.leading} tokens, a concurrent {args.concurrent_tokens}-token request waiting")
    print(f"{'phase':<58}{'median ms':>10}{'max ms':>9}{'n':>6}")
    rows = [
        ("alone (the concurrent request only)", alone),
        (f"worst allowed request waiting ({docs} docs x {doc_tokens} tokens, {len(warmups)} warm-ups)", waiting),
        ("  its first step (its canonical keys hashed)", first),
        ("  its admission step (match, plan, copy 64 documents)", admission),
    ]
    for name, values in rows:
        print(f"{name:<58}{ms(values):>10.3f}{1000 * max(values):>9.3f}{len(values):>6}")
    print(f"ratio worst waiting / alone (medians): {ms(waiting) / ms(alone):.2f}x; "
          f"admission step / alone: {ms(admission) / ms(alone):.2f}x")
    print(f"old unbounded request (2,000 two-token documents, S {args.leading} tokens), canonical keys: "
          f"{1000 * old:.1f} ms hashed per document from scratch (before), {1000 * new:.1f} ms with S once; "
          "now refused (HTTP 400, --pcr-doc-max-documents)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--leading", type=int, default=4096, help="tokens before the first document (S)")
    parser.add_argument("--concurrent-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--trials", type=int, default=10)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
