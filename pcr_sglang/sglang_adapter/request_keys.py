"""What a waiting or admitted SGLang request's chunk keys are.

Keys come from the server's one :class:`~pcr_sglang.core.keys.ChainKeyer`; this module
only says which tokens of a ``Req`` SGLang will match, and (with document reuse) which
canonical document chains the request will reuse besides its own prefix. The keys of the
requests in the look-ahead window are hashed once, when they enter it, and read from here
by the window, admission and the remote probes (a memo, not per-request state: a request
keeps the keys it was hashed to when it entered the window, and the memo forgets the
requests that left it).
"""

from __future__ import annotations

from typing import Any, Sequence

from pcr_sglang.core.chunk_tree import ChunkNode
from pcr_sglang.core.keys import ChainKeyer, ChunkKey, RequestTenant
from pcr_sglang.core.residency import CacheState
from pcr_sglang.req import PcrReq, request_tenant
from pcr_sglang.reuse.disabled import NoDocReuse
from pcr_sglang.reuse.seam import SchedulerDocReuse


def matchable_tokens(req: PcrReq) -> Any:
    """What SGLang will match for ``req``: the prompt (and any output of a retracted
    request) up to the request's own limit (at most all but the last token, which is
    always computed; less with logprobs from an earlier position; nothing with embedding
    overrides)."""
    if getattr(req, "positional_embed_overrides", None) is not None:
        return req.origin_input_ids[:0]
    tokens = req.origin_input_ids + req.output_ids if len(req.output_ids) else req.origin_input_ids
    limit = getattr(req, "_compute_max_prefix_len", None)
    cap = limit(len(tokens)) if limit is not None else len(tokens) - 1
    return tokens[: max(min(cap, len(tokens) - 1), 0)]


class RequestKeys:
    def __init__(self, keyer: ChainKeyer, state: CacheState):
        self.keyer = keyer
        self.state = state
        self.docs: SchedulerDocReuse = NoDocReuse()  # DocReuse, with --pcr-doc-reuse
        self._window: dict[str, list[ChunkKey]] = {}

    def of_tokens(self, tokens: Sequence[int], tenant: RequestTenant = RequestTenant()) -> list[ChunkKey]:
        """The chunk keys of ``tokens`` (whole chunks only) under ``tenant``'s root."""
        return self.keyer.request_keys(tokens, tenant)

    def own(self, req: PcrReq) -> list[ChunkKey]:
        """The keys of what SGLang will match for ``req``."""
        keys = self._window.get(req.rid)
        if keys is not None:
            return keys
        return self.keyer.request_keys(matchable_tokens(req), request_tenant(req))

    def needed(self, req: PcrReq) -> list[list[ChunkKey]]:
        """The chains a waiting request will reuse: its prefix, and with document reuse the
        canonical chains of the documents it marked."""
        own = self.own(req)
        return [own, *self.docs.canonical_chain_keys(req)]

    def needed_chains(self, req: PcrReq) -> list[list[ChunkNode]]:
        """The cached part of each chain of :meth:`needed` (document chains share their
        leading chunks: :meth:`DocReuse.canonical_chain_nodes` walks those once)."""
        own = self.state.match(iter(self.own(req)), touch=False).nodes
        # mutant: queue-prefetch-skips-document-chains
        return [own, *self.docs.canonical_chain_nodes(req)]

    def refresh_window(self, window: Sequence[PcrReq]) -> None:
        """The window's requests' keys for this step (a request still in the window keeps
        the keys it was hashed to when it entered: its tokens do not change while it waits)."""
        self._window = {req.rid: self.own(req) for req in window}

    def forget(self) -> None:
        """Drop this step's memo (a flush, or keys derived under another namespace)."""
        self._window = {}
