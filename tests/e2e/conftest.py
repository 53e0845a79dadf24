"""Fixtures shared by the e2e modules; each module defines its own ``servers``."""

from __future__ import annotations

import pytest

from pcr_tools.launcher import ServerProcess
from tests.e2e.helpers import BASELINE_ARGS, generate_greedy

# The modules run two at a time on pytest-xdist workers (scripts/test.sh), which take them
# in collection order: the longest first, so that the last to start is a short one and no
# worker idles while the other finishes a long module. Wall time of each, servers included,
# on the 2-core machine (2026-12-06): doc_reuse ~9 min, http_server ~8, sglang_kits ~5 (with
# other work beside it), fingerprint ~4.5, torch_native_extend ~3, ragbench ~2.5, flags ~1.5,
# engine ~1. A module not listed goes first (its weight is unknown); the paced modules run
# one after another, in any order.
MODULES_LONGEST_FIRST = (
    "test_doc_reuse.py",
    "test_http_server.py",
    "test_sglang_kits.py",
    "test_fingerprint.py",
    "test_torch_native_extend.py",
    "test_ragbench.py",
    "test_flags.py",
    "test_engine.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(MODULES_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, -1))  # stable: a module's own order stays


@pytest.fixture(scope="session")
def baseline_server(tiny_model):
    """One server with no prefix cache for the whole session: the oracle of every module's
    token-for-token checks (each module once started its own, a server start and 50
    prompts apiece). Modules put it in their ``servers`` through ``serving(shared=...)``."""
    server = ServerProcess(tiny_model, BASELINE_ARGS).start()
    yield server
    server.kill()  # as the modules' servers are (tests.e2e.helpers.serving)


@pytest.fixture(scope="session")
def baseline_outputs(baseline_server, rag_prompt_ids):
    """Greedy outputs of the baseline server (no prefix cache) per prompt."""
    return [ids for ids, _ in generate_greedy(baseline_server, rag_prompt_ids)]
