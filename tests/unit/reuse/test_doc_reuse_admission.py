"""Document reuse in the scheduler, over SGLang's real CPU pool (the adapter harness): what a
marked request costs per step, what a malformed one does there, and how admission loads a
request's documents (it is told what to provide, as data, and hands the slots back)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pcr_sglang.core import keys as key_module
from pcr_sglang.reuse.bounds import DocLimits, Recompute
from pcr_sglang.reuse.placement import DocReuse
from pcr_sglang.transfer.rope_shift import RopeSpec
from tests.unit.adapter_harness import CHUNK, make  # noqa: F401 - the fixture

LEADING = [7] * 10  # S: two whole chunks and two tokens of the seam chunk
DOCS = 10
DOC_TOKENS = 4


def _with_docs(h, limits=None) -> DocReuse:
    kv = h.allocator.get_kvcache()
    h.scheduler.docs = DocReuse(
        h.state,
        Recompute("concat"),
        CHUNK,
        0,
        RopeSpec(8, 8, True, (1.0, 0.1, 0.01, 0.001)),
        list(zip(kv.k_buffer, kv.v_buffer)),
        h.allocator,
        h.scheduler.keyer,
        h.scheduler.executor.free_private,
        limits=limits,
    )
    return h.scheduler.docs


def _marked(h, rid: str, custom) -> tuple[list[int], object]:
    tokens, bounds = list(LEADING), []
    for i in range(DOCS):
        bounds += [len(tokens), len(tokens) + DOC_TOKENS]
        tokens += list(range(100 + 10 * i, 100 + 10 * i + DOC_TOKENS))
    tokens += [5, 5, 5]
    req = h.request(tokens, rid)
    req.sampling_params = SimpleNamespace(custom_params=custom(bounds) if callable(custom) else custom)
    return tokens, req


class HashCount:
    """Counts chunk hashes (every chunk key is one ``chunk_key`` call)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = key_module.chunk_key

        def counting(parent, tokens):
            self.calls += 1
            return original(parent, tokens)

        monkeypatch.setattr(key_module, "chunk_key", counting)


def test_a_marked_requests_canonical_keys_are_hashed_once_with_the_leading_tokens_once(make, monkeypatch):
    """Review finding 4: each document's canonical chain ``S ‖ d ‖ pad`` was hashed from
    scratch, ``O(documents x |S|)`` in the scheduler thread. Now ``S``'s whole chunks are
    hashed once per request and each document costs only its seam chunk onwards; the keys
    live in the request's state, so no later step, match or consideration hashes them again."""
    h = make(lookahead_window=4)
    _with_docs(h)
    count = HashCount(monkeypatch)
    tokens, req = _marked(h, "marked", lambda bounds: {"pcr_doc_bounds": bounds})
    h.step([req])
    own = (len(tokens) - 1) // CHUNK  # the request's own prefix (all but its last token)
    per_doc = -(-(len(LEADING) % CHUNK + DOC_TOKENS) // CHUNK)  # the seam chunk onwards
    assert count.calls == own + len(LEADING) // CHUNK + DOCS * per_doc, count.calls
    first = count.calls
    for _ in range(20):
        h.step([req])
    assert count.calls == first  # nothing hashed per step
    plain = h.request(tokens, "plain")
    before = count.calls
    h.match(tokens, plain)
    prefix_cache_own = count.calls - before  # what SGLang's match hashes of any prompt
    before = count.calls
    h.match(tokens, req)  # plans the documents' reuse: their keys are the request's already
    h.scheduler.admission.admit_now(req)
    assert count.calls - before == prefix_cache_own
    h.check()


@pytest.mark.parametrize(
    "custom",
    [
        "xpcr_doc_boundsx",
        ["pcr_doc_bounds"],
        lambda bounds: {"pcr_doc_bounds": bounds, "pcr_doc_reuse": 3},
        lambda bounds: {"pcr_doc_bounds": bounds},
    ],
    ids=["string", "list", "bad-mode", "over-the-limit"],
)
def test_the_scheduler_serves_a_malformed_request_without_reuse_and_never_dies(make, custom):
    """Review finding 14: the scheduler caught only DocBoundsError, and a non-dict
    ``custom_params`` holding the substring raised AttributeError in the window, the match
    and the admission count: a path that skips the tokenizer's validation killed it. Bounds
    past the server's limits (``--pcr-doc-max-documents``) are not planned either."""
    h = make(lookahead_window=4)
    docs = _with_docs(h, DocLimits(max_documents=DOCS - 1, min_tokens=1))
    tokens, req = _marked(h, "bad", custom)
    h.step([req])
    assert h.cache.report()["lookahead_protected_chunks"] == 0
    h.admit(req)
    h.scheduler.admitted(req)
    assert docs.stats.malformed == 1 and docs.stats.requests == 0
    served, _ = h.serve(tokens, "bad-served")  # a request like it is served in full
    assert served.prefix_len == 0
    h.check()


def test_the_windows_document_chains_are_what_matching_each_chain_gives(make):
    """``canonical_chain_nodes`` walks ``S``'s shared chunks once per step; it must give
    exactly each chain's own match: with ``S`` and some documents cached, and with ``S``
    cached only in part."""
    from pcr_sglang.reuse.bounds import parse_doc_bounds
    from pcr_sglang.reuse.plan import canonical_tokens

    h = make(lookahead_window=4, pool=128)
    docs = _with_docs(h)
    tokens, req = _marked(h, "marked", lambda bounds: {"pcr_doc_bounds": bounds})
    spans = parse_doc_bounds(req.sampling_params.custom_params["pcr_doc_bounds"], len(tokens))

    def expected():
        return [h.state.match(iter(keys), touch=False).nodes for keys in docs.canonical_chain_keys(req)]

    h.serve(tokens[:CHUNK], "part-of-S")
    assert docs.canonical_chain_nodes(req) == expected() and len(expected()[0]) == 1
    for span in spans[::3]:
        h.serve(canonical_tokens(tokens, span, len(LEADING), CHUNK, 0), f"warm-{span.index}")
    got = docs.canonical_chain_nodes(req)
    assert got == expected()
    assert [len(nodes) for nodes in got] == [4 if span.index % 3 == 0 else 2 for span in spans]
    h.check()


def _two_documents(h):
    """``S ‖ a ‖ b ‖ question`` with both documents' canonical chains cached: ``S ‖ a`` is
    the request's own exact prefix, ``b`` is re-placed by 6 positions."""
    from pcr_sglang.reuse.bounds import parse_doc_bounds
    from pcr_sglang.reuse.plan import canonical_tokens

    leading, a, b = [7] * 6, list(range(100, 106)), list(range(200, 206))
    tokens = leading + a + b + [5, 5, 5]
    bounds = [6, 12, 12, 18]
    for span in parse_doc_bounds(bounds, len(tokens)):
        h.serve(canonical_tokens(tokens, span, len(leading), CHUNK, 0), f"warm-{span.index}")
    req = h.request(tokens, "marked")
    req.sampling_params = SimpleNamespace(custom_params={"pcr_doc_bounds": bounds})
    req.kv = SimpleNamespace(cache_protected_len=0, req_pool_idx=0)  # SGLang's row state, set by a load
    canonical_b = canonical_tokens(tokens, parse_doc_bounds(bounds, len(tokens))[1], len(leading), CHUNK, 0)
    return tokens, req, h.state.match(iter(h.scheduler.keys.of_tokens(canonical_b)), touch=False).nodes


def test_a_load_asks_admission_for_data_and_places_the_documents_into_the_slots_it_gets(make):
    """``DocReuse.load`` takes no callbacks: it says what admission provides (the chains to
    lock and bring to the device, the slots, the fence), and ``place`` copies into the slots
    admission allocated; the request's prefix then ends with them."""
    from pcr_sglang.reuse.seam import DocLoad

    h = make()
    docs = _with_docs(h)
    tokens, req, chain_b = _two_documents(h)
    h.match(tokens, req)
    assert docs.load(req) == DocLoad([chain_b], 6, fence=True)  # no transfer engine: copied at admission
    device, loaded = h.admit(req)
    assert (device, loaded) == (12, 6) and docs.stats.load_failures == 0
    private = docs.private_slots(req.rid)
    canonical = torch.cat([n.device_value for n in chain_b])[6:12]
    for layer in range(len(h.kvcache.v_buffer)):  # V moves as it is; K is rotated by the delta
        assert torch.equal(h.kvcache.v_buffer[layer][private], h.kvcache.v_buffer[layer][canonical])
    assert h.cache.prefix_device_indices(req)[12:].tolist() == private.tolist()
    assert all(n.lock_ref == 0 for n in chain_b)  # the load's locks are given back
    h.scheduler.release(req.rid)  # its row never took the slots: they are freed
    h.check()


def test_without_room_for_the_documents_admission_places_nothing_and_it_is_counted(make):
    """Admission finds no room for the copy's slots (every chunk locked, the rest of the
    pool taken): ``place`` gets None, the request is recomputed, counted, nothing kept."""
    h = make()
    docs = _with_docs(h)
    tokens, req, chain_b = _two_documents(h)
    held = h.allocator.alloc(h.allocator.available_size() - 5)  # room for 5 of the 6 tokens
    try:
        assert h.admit(req) == (12, 0)
        assert docs.stats.load_failures == 1 and docs.private_slots(req.rid) is None
        assert docs.planned(req.rid) is None and all(n.lock_ref == 0 for n in chain_b)
    finally:
        h.allocator.free(held)
    h.check()


def test_without_room_beside_requests_in_flight_the_documents_wait_for_a_later_pass(make):
    """With other requests in the batch or running (``Admission.adding``), no room for the
    copy asks SGLang to retry admission instead of recomputing every planned token: nothing
    is kept or locked, it is counted, and once room is freed the next pass reuses them."""
    h = make()
    docs = _with_docs(h)
    tokens, req, chain_b = _two_documents(h)
    held = h.allocator.alloc(h.allocator.available_size() - 5)  # room for 5 of the 6 tokens
    try:
        with h.scheduler.admission.adding(others_in_flight=True):
            assert h.admit(req) == (12, None)
        assert docs.stats.load_deferred == 1 and docs.stats.load_failures == 0
        assert docs.private_slots(req.rid) is None and all(n.lock_ref == 0 for n in chain_b)
    finally:
        h.allocator.free(held)  # the requests in flight finished
    with h.scheduler.admission.adding(others_in_flight=True):
        assert h.admit(req) == (12, 6)
    assert docs.stats.load_failures == 0 and docs.private_slots(req.rid) is not None
    h.scheduler.release(req.rid)
    h.check()


def test_documents_wait_for_room_a_bounded_number_of_passes_then_are_recomputed(make, monkeypatch):
    from pcr_sglang.sglang_adapter import admission

    monkeypatch.setattr(admission, "MAX_ROOM_WAITS", 2)
    h = make()
    docs = _with_docs(h)
    tokens, req, chain_b = _two_documents(h)
    held = h.allocator.alloc(h.allocator.available_size() - 5)
    try:
        with h.scheduler.admission.adding(others_in_flight=True):
            assert [h.admit(req) for _ in range(3)] == [(12, None), (12, None), (12, 0)]
        assert docs.stats.load_deferred == 2 and docs.stats.load_failures == 1
        assert docs.private_slots(req.rid) is None and all(n.lock_ref == 0 for n in chain_b)
    finally:
        h.allocator.free(held)
    h.check()


def test_waiting_for_room_after_the_host_prefix_and_the_chains_came_to_the_device(make):
    """The exact prefix and the document's chain only in host memory: admission brings both
    to the device, then finds no room for the copy beside requests in flight. They stay in
    the tree (unlocked, the tree's), nothing is kept for the request, and the next pass
    reuses them from the device."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    h = make(host_slots=16)
    docs = _with_docs(h)
    tokens, req, chain_b = _two_documents(h)
    h.cache.evict(EvictParams(num_tokens=10**6))
    assert all(n.on_host and not n.on_device for n in chain_b)
    # Room for the exact prefix's 12 tokens and the chain's 8, not for the 6-token copy.
    held = h.allocator.alloc(h.allocator.available_size() - (12 + 8 + 5))
    try:
        with h.scheduler.admission.adding(others_in_flight=True) as attempt:
            assert h.admit(req) == (0, None)
        assert attempt.deferred and docs.stats.load_deferred == 1 and docs.stats.load_failures == 0
        assert all(n.on_device and n.lock_ref == 0 for n in chain_b)
        assert docs.private_slots(req.rid) is None
    finally:
        h.allocator.free(held)
    h.check()  # every slot the tree's or free
    with h.scheduler.admission.adding(others_in_flight=True):
        assert h.admit(req) == (12, 6)
    h.scheduler.release(req.rid)
    h.check()
