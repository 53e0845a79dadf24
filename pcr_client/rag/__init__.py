"""Retrieval for RAG pipelines served by pcr-sglang: an IVF datastore on faiss-cpu, a fast
tier the look-ahead fills while the LLM writes the query, and the merged search
(TeleRAG's design; docs/lookahead-retrieval.md).

Modules: :mod:`~pcr_client.rag.embedder` (all-MiniLM-L6-v2, offline),
:mod:`~pcr_client.rag.ivf` (index and cluster-ordered table, in DRAM or memory-mapped),
:mod:`~pcr_client.rag.fast_host` (the fast tier in host memory),
:mod:`~pcr_client.rag.budget` (how much to prefetch),
:mod:`~pcr_client.rag.lookahead` (look-ahead and merged search).
"""
