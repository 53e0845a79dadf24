"""Fixtures shared by the e2e modules; each module defines its own ``servers``."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import generate_greedy


@pytest.fixture(scope="module")
def baseline_outputs(servers, rag_prompt_ids):
    """Greedy outputs of the module's ``baseline`` server (no prefix cache) per prompt."""
    return [ids for ids, _ in generate_greedy(servers["baseline"], rag_prompt_ids)]
