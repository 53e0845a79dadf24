"""The client library of pcr-sglang: what an application runs to send requests that use
the server's features. It imports nothing of the server package (:mod:`pcr_sglang`), and
the server imports nothing of it (``tests/unit/test_layering.py``); the request fields both
spell alike are in :mod:`pcr_wire`.

Modules: :mod:`~pcr_client.prompt` (a prompt with its documents marked, for
``--pcr-doc-reuse``), :mod:`~pcr_client.frontend` (the same from SGLang's frontend DSL:
``doc()`` and ``DocReuseEndpoint``), :mod:`~pcr_client.hints` (the ``kv_hints`` field of a
prefetch hint), :mod:`~pcr_client.rag` (retrieval with look-ahead, and RAG pipelines that
hint their final prompt) and :mod:`~pcr_client.paths` (where derived data is cached).
"""
