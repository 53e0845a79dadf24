from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
# sglang.Engine registers an atexit shutdown that logs after pytest has closed its
# capture streams; don't print a "Logging error" traceback for that at exit.
logging.raiseExceptions = False

CHUNK_SIZE = 16
SLOW_PHASE_S = 30.0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Print each slow test phase as it ends, with the wall clock: if CI stops the suite at
    its time limit, the tail of its output still says where the time went."""
    if report.duration >= SLOW_PHASE_S:
        import time

        print(f"\n[{time.strftime('%H:%M:%S')}] {report.duration:.0f} s {report.when} {report.nodeid}", flush=True)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from pcr_tools.models.tiny_llama import build_tiny_llama

    return str(build_tiny_llama())


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def rag_prompt_ids(tokenizer) -> list[list[int]]:
    """50 RAG prompts over Wikipedia articles that share documents (Zipf popularity)."""
    from pcr_tools.workload import RagWorkloadParams, make_rag_workload

    params = RagWorkloadParams(num_requests=50, doc_pool_size=40, min_docs=3, max_docs=5, max_doc_chars=700, seed=7)
    return [tokenizer.encode(r.plain_prompt()) for r in make_rag_workload(params)]
