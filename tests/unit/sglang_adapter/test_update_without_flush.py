"""A weight update with ``flush_cache: false`` while a request runs: the request's KV was
computed (at least in part) with the old weights, so its chunks must not enter the tree
under the new weights' keys when it finishes. They used to: its final checkpoint keyed its
whole row under the new namespace, so later requests on the new weights reused KV of the
old ones. A request carries the generation of the keys it was admitted under; a checkpoint
of an older generation inserts nothing (its KV stays its own and is freed with its row).
Over SGLang's real CPU KV pool, allocator and request-to-token pool (the decode driver of
``test_decode_offloads``), through PCR's own wrapper of SGLang's update call."""

from __future__ import annotations

from types import SimpleNamespace

from pcr_sglang.sglang_adapter.weight_updates import around_weight_update
from tests.unit.adapter_harness import CHUNK, Harness, make  # noqa: F401
from tests.unit.sglang_adapter.test_decode_offloads import Batch


def reusable_chunks(h: Harness, tokens: list[int]) -> int:
    match = h.state.match(iter(h.scheduler.keys.of_tokens(tokens)))
    return match.device + match.host + match.ssd


def update_without_flush(h: Harness) -> None:
    def no_flush(manager, recv_req):
        return SimpleNamespace(success=True)

    around_weight_update(
        "update_weights_from_distributed",
        no_flush,
        SimpleNamespace(scheduler=SimpleNamespace(tree_cache=h.cache)),
        SimpleNamespace(),
    )


def test_a_request_running_across_an_update_without_flush_inserts_nothing_under_the_new_keys(make):
    h = make(host_slots=8)
    batch = Batch(h)
    prompt = list(range(100, 100 + 3 * CHUNK))
    old = batch.start("old", prompt)
    for step in range(CHUNK + 1):
        batch.decode(lambda req, step=step: 500 + step)
    update_without_flush(h)
    fresh = batch.start("fresh", list(range(300, 300 + 2 * CHUNK)))  # admitted under the new keys
    batch.decode(lambda req: 7)
    batch.finish(old)
    assert reusable_chunks(h, old.tokens) == 0  # nothing computed with the old weights under new keys
    batch.finish(fresh)
    assert reusable_chunks(h, fresh.tokens) == len(fresh.tokens) // CHUNK  # a new request is cached as ever
    h.check()
