"""sglang.Engine(enable_pcr=True, ...) in-process API, against the radix cache disabled.

The Engine runs in a process of its own: ``Engine.shutdown`` kills every child process of
the process it runs in, which in pytest's would include the session's baseline server."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.conftest import CHUNK_SIZE
from tests.e2e.helpers import GREEDY

pytestmark = pytest.mark.e2e

ENGINE_KWARGS = dict(
    device="cpu", attention_backend="torch_native", dtype="float32", max_total_tokens=24000,
    context_length=4096, log_level="warning",
)


def run_engine(model_path, prompts, **kwargs):
    import sglang as sgl

    engine = sgl.Engine(model_path=model_path, **ENGINE_KWARGS, **kwargs)
    try:
        outputs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
    finally:
        engine.shutdown()
    return [(o["output_ids"], o["meta_info"]["cached_tokens"]) for o in outputs]


def test_engine_outputs_equal_baseline(tiny_model, rag_prompt_ids, baseline_outputs):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pcr = pool.submit(run_engine, tiny_model, rag_prompt_ids, enable_pcr=True, pcr_chunk_size=CHUNK_SIZE).result()
    assert [ids for ids, _ in pcr] == baseline_outputs  # the baseline server's: no prefix cache
    cached = [c for _, c in pcr]
    assert all(c % CHUNK_SIZE == 0 for c in cached)
    assert sum(cached) > 0
