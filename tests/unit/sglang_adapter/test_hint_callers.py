"""KV hints per caller (review N14): the tenant is the client-chosen ``cache_salt``, so a
client rotating salts used to get a fresh rate bucket each time and push out a victim
tenant's hints. Hints now also belong to their caller (the HTTP connection's peer, set in
the tokenizer process over whatever the client wrote): a caller has a rate bucket of its
own, and over ``max_live`` the caller holding the most hints loses first; of equals, the
newest caller or tenant loses."""

from __future__ import annotations

import pytest
from sglang.srt.managers.io_struct import GenerateReqInput
from starlette.requests import Request

from pcr_client.hints import hint_envelope
from pcr_sglang.core.hints import (
    CALLER_FIELD,
    CALLER_RATE_FACTOR,
    DEFAULT_CALLER,
    HintBook,
    HintLimits,
    HintPayload,
    hint_payload,
)
from pcr_sglang.sglang_adapter.kv_hints import stamp_caller, validate_kv_hints


def test_a_client_rotating_salts_is_still_one_caller_bounded_in_rate():
    book = HintBook(HintLimits(rate_per_s=1, burst=2, max_live=1000))
    caller_burst = 2 * CALLER_RATE_FACTOR
    results = [
        book.register(f"h{i}", [f"k{i}"], HintPayload(), now=0.0, tenant=f"salt:{i}", caller="peer:A")
        for i in range(caller_burst + 3)
    ]
    assert results == [True] * caller_burst + [False] * 3
    assert book.stats.rate_limited == 3
    assert book.register("b", ["kb"], HintPayload(), now=0.0, tenant="salt:0", caller="peer:B")  # B's own bucket
    assert not book.register("a", ["ka"], HintPayload(), now=0.1, tenant="salt:new", caller="peer:A")
    assert book.register(
        "a", ["ka"], HintPayload(), now=0.1 + 1.0 / CALLER_RATE_FACTOR, tenant="salt:new", caller="peer:A"
    )  # refilled at the caller's rate


def test_a_hint_over_its_tenants_rate_takes_no_token_of_its_caller():
    book = HintBook(HintLimits(rate_per_s=1, burst=1, max_live=1000))
    assert book.register("a0", ["k"], HintPayload(), now=0.0, tenant="salt:t", caller="peer:A")
    for i in range(10):  # the tenant's bucket is empty: none of these charges the caller's
        assert not book.register(f"a{i + 1}", ["k"], HintPayload(), now=0.0, tenant="salt:t", caller="peer:A")
    others = [
        book.register(f"o{i}", ["k"], HintPayload(), now=0.0, tenant=f"salt:o{i}", caller="peer:A")
        for i in range(CALLER_RATE_FACTOR)
    ]
    assert others == [True] * (CALLER_RATE_FACTOR - 1) + [False]


def test_over_max_live_the_caller_holding_the_most_loses_its_own_hints():
    book = HintBook(HintLimits(max_live=8, burst=1000))
    for i in range(3):
        book.register(f"v{i}", [f"kv{i}"], HintPayload(), now=0.0, tenant="salt:victim", caller="peer:V")
    for i in range(20):  # a new salt per hint, from one connection peer
        book.register(f"a{i}", [f"ka{i}"], HintPayload(), now=0.0, tenant=f"salt:a{i}", caller="peer:A")
    assert book.live_of("salt:victim") == 3 and book.live_of_caller("peer:A") == 5
    # A's tenants hold one hint each: of equals the newest loses, so A's newest hints go.
    assert {h.hint_id for h in book.live() if h.caller == "peer:A"} == {f"a{i}" for i in range(5)}


def test_of_tenants_holding_equally_many_the_newest_loses():
    book = HintBook(HintLimits(max_live=4, burst=1000))
    for hint_id, tenant in (("v0", "salt:victim"), ("v1", "salt:victim"), ("n0", "salt:new"), ("n1", "salt:new")):
        book.register(hint_id, [f"k{hint_id}"], HintPayload(), now=0.0, tenant=tenant)
    book.register("w", ["kw"], HintPayload(), now=0.0, tenant="salt:third")  # one over: victim and new tie
    assert book.live_of("salt:victim") == 2 and {h.hint_id for h in book.live()} == {"v0", "v1", "n1", "w"}


def test_of_callers_holding_equally_many_the_newest_loses():
    book = HintBook(HintLimits(max_live=4, burst=1000))
    for hint_id, caller in (("v0", "peer:V"), ("v1", "peer:V"), ("n0", "peer:N"), ("n1", "peer:N")):
        book.register(hint_id, [f"k{hint_id}"], HintPayload(), now=0.0, tenant=f"salt:{hint_id}", caller=caller)
    book.register("w", ["kw"], HintPayload(), now=0.0, tenant="salt:w", caller="peer:W")
    assert book.live_of_caller("peer:V") == 2 and book.live_of_caller("peer:N") == 1


# ------------------------------------------------------------------ the caller, set in the tokenizer process
def http_request(host: str) -> Request:
    return Request(
        {
            "type": "http",
            "method": "POST",
            "path": "/generate",
            "headers": [],
            "client": (host, 51234),
            "server": ("127.0.0.1", 30000),
            "query_string": b"",
        }
    )


@pytest.mark.parametrize("host, expected", [("10.0.0.7", "peer:10.0.0.7"), (None, DEFAULT_CALLER)])
def test_the_caller_is_the_connections_peer_whatever_the_client_wrote(host, expected):
    spoofed = hint_envelope({"hint_only": True, CALLER_FIELD: "peer:someone-else"}, "m1")
    obj = GenerateReqInput(input_ids=[1, 2, 3], kv_hints=spoofed)
    obj.normalize_batch_and_arguments()
    stamp_caller(None, None, obj, http_request(host) if host else None)  # None: the Engine's own request
    validate_kv_hints(None, None, obj)
    assert hint_payload(obj.kv_hints).caller == expected


def test_every_prompt_of_a_batch_gets_the_caller():
    obj = GenerateReqInput(input_ids=[[1, 2, 3], [4, 5, 6]], kv_hints=[hint_envelope({"hint_only": True}, "m1"), None])
    obj.normalize_batch_and_arguments()
    stamp_caller(None, None, obj, http_request("192.0.2.1"))
    assert hint_payload(obj.kv_hints[0]).caller == "peer:192.0.2.1" and obj.kv_hints[1] is None
    assert obj[0].kv_hints is obj.kv_hints[0]  # what the sub-request sent to the scheduler carries
