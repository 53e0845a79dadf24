"""Document reuse in the scheduler, over SGLang's real CPU pool (the adapter harness): what a
marked request costs per step, and what a malformed one does there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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
    h.scheduler.docs = DocReuse(h.state, Recompute("concat"), CHUNK, 0, RopeSpec(8, 8, True, (1.0, 0.1, 0.01, 0.001)),
                                list(zip(kv.k_buffer, kv.v_buffer)), h.allocator, h.scheduler.keyer,
                                h.scheduler.executor.free_private, limits=limits)
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


@pytest.mark.parametrize("custom", ["xpcr_doc_boundsx", ["pcr_doc_bounds"],
                                    lambda bounds: {"pcr_doc_bounds": bounds, "pcr_doc_reuse": 3},
                                    lambda bounds: {"pcr_doc_bounds": bounds}],
                         ids=["string", "list", "bad-mode", "over-the-limit"])
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
