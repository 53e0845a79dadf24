"""sglang.Engine(enable_pcr=True, ...) in-process API, against the radix cache disabled."""

from __future__ import annotations

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


def test_engine_outputs_equal_baseline(tiny_model, rag_prompt_ids):
    pcr = run_engine(tiny_model, rag_prompt_ids, enable_pcr=True, pcr_chunk_size=CHUNK_SIZE)
    baseline = run_engine(tiny_model, rag_prompt_ids, disable_radix_cache=True)
    assert [ids for ids, _ in pcr] == [ids for ids, _ in baseline]
    cached = [c for _, c in pcr]
    assert all(c % CHUNK_SIZE == 0 for c in cached)
    assert sum(cached) > 0
    assert all(c == 0 for _, c in baseline)
