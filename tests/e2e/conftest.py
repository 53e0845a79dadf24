"""Fixtures shared by the e2e modules; each module defines its own ``servers``."""

from __future__ import annotations

import pytest

from pcr_tools.launcher import ServerProcess
from tests.e2e.helpers import BASELINE_ARGS, generate_greedy


@pytest.fixture(scope="session")
def baseline_server(tiny_model):
    """One server with no prefix cache for the whole session: the oracle of every module's
    token-for-token checks (each module once started its own, a server start and 50
    prompts apiece). Modules put it in their ``servers`` through ``serving(shared=...)``."""
    server = ServerProcess(tiny_model, BASELINE_ARGS).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def baseline_outputs(baseline_server, rag_prompt_ids):
    """Greedy outputs of the baseline server (no prefix cache) per prompt."""
    return [ids for ids, _ in generate_greedy(baseline_server, rag_prompt_ids)]
