"""The words a request and the server agree on: the one definition both sides import.

The client library (:mod:`pcr_client`) writes these fields and the server (:mod:`pcr_sglang`)
reads them, and neither package may import the other (``tests/unit/test_layering.py``). So
what both must spell alike lives here, in a package that imports nothing at all: a client
and a server built from the same release can never disagree on a name.

Only names both sides need belong here. What only the server checks (the other
``custom_params`` of document reuse, its modes and limits, the hint payload's parser) stays
in the server package (:mod:`pcr_sglang.reuse.bounds`, :mod:`pcr_sglang.core.hints`).
"""

from __future__ import annotations

# ---------------------------------------------------------------- document reuse (--pcr-doc-reuse)
# ``sampling_params.custom_params`` of a request marking its documents: their token offsets
# (a flat ``[s0, e0, s1, e1, ...]``) and the reuse mode it asks for.
DOC_BOUNDS_PARAM = "pcr_doc_bounds"
DOC_MODE_PARAM = "pcr_doc_reuse"
# How a document is written into the prompt, by the client's prompt builder and by the
# server when it renders a chat request's ``documents`` (``--pcr-doc-format``'s default):
# the same documents must become the same tokens on either path.
DEFAULT_DOC_FORMAT = "Document: {doc}\n\n"

# ---------------------------------------------------------------- KV hints (kv_hints)
# The ``kv_hints`` action a client sends to have a future prompt's chains prefetched, and
# the version of its payload this release speaks.
HINT_ACTION = "pcr.lookahead_prefetch"
HINT_ACTION_VERSION = "1"
