"""Whole servers with patch 03 (torch_native extend computes only the extend rows) against
the same install serving the original padded computation (SGLANG_TORCH_NATIVE_PADDED_EXTEND=1),
token for token, on prompts whose long prefixes are cached (radix cache and --enable-pcr).

Chunked prefill of 96 tokens makes the later chunks of every long cold prompt an extend
after a prefix too, so the bottom-right mask runs on cold prompts as well as on hits.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import pytest

from pcr_tools.launcher import ServerProcess
from tests.conftest import CHUNK_SIZE
from tests.e2e.helpers import COMMON_ARGS, serving

pytestmark = pytest.mark.e2e

PADDED_ENV = "SGLANG_TORCH_NATIVE_PADDED_EXTEND"
# torch_native named explicitly: on a GPU machine the launcher would otherwise pick another backend.
ARGS = (*COMMON_ARGS, "--attention-backend", "torch_native", "--chunked-prefill-size", "96")
SAMPLING = {"temperature": 0.0, "max_new_tokens": 12}
# The servers run in float32; the two computations differ by float32 rounding (see the unit
# test), which moves a log-probability by far less than this.
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def servers(tiny_model):
    pcr = ("--enable-pcr", "--pcr-chunk-size", str(CHUNK_SIZE))
    everything = {
        "padded": ServerProcess(tiny_model, ARGS, env={PADDED_ENV: "1"}),
        "rows": ServerProcess(tiny_model, ARGS, env={PADDED_ENV: "0"}),
        "padded_pcr": ServerProcess(tiny_model, (*ARGS, *pcr), env={PADDED_ENV: "1"}),
        "rows_pcr": ServerProcess(tiny_model, (*ARGS, *pcr), env={PADDED_ENV: "0"}),
    }
    with serving(everything):
        yield everything


def run(server: ServerProcess, prompts: Sequence[list[int]], concurrency: int) -> list[dict]:
    """Greedy generation with log-probabilities: (output ids, their logprobs, cached tokens)."""

    def one(ids: list[int]) -> dict:
        out = server.generate({"input_ids": ids, "sampling_params": SAMPLING, "return_logprob": True})
        meta = out["meta_info"]
        return {
            "ids": out["output_ids"],
            "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
            "cached": meta["cached_tokens"],
        }

    if concurrency == 1:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def workload(rag_prompt_ids: list[list[int]]) -> list[list[int]]:
    """12 RAG prompts sharing documents, then 6 of them again (fully cached: a one-token
    extend on the radix cache), then 3/4 of 6 of them followed by 1 to 166 new tokens."""
    prompts = list(rag_prompt_ids[:12])
    prompts += rag_prompt_ids[:6]
    prompts += [p[: len(p) * 3 // 4] + p[:n] for p, n in zip(rag_prompt_ids[:6], range(1, 200, 33))]
    return prompts


@pytest.mark.parametrize("cache", ["radix", "pcr"])
def test_extend_rows_only_serves_the_padded_servers_tokens(servers, rag_prompt_ids, cache):
    suffix = "" if cache == "radix" else "_pcr"
    prompts = workload(rag_prompt_ids)
    # One at a time first, then 6 at a time (extend batches mixing prefix and extend lengths);
    # the second pass finds everything cached from the first.
    for concurrency in (1, 6):
        padded = run(servers["padded" + suffix], prompts, concurrency)
        rows = run(servers["rows" + suffix], prompts, concurrency)
        assert [r["ids"] for r in rows] == [p["ids"] for p in padded]
        for r, p in zip(rows, padded):
            assert r["logprobs"] == pytest.approx(p["logprobs"], abs=LOGPROB_ATOL)
        # The same cache hits one at a time (concurrent timing may differ), and the
        # workload exercised long cached prefixes.
        if concurrency == 1:
            assert [r["cached"] for r in rows] == [p["cached"] for p in padded]
        cached = [r["cached"] for r in rows]
        assert sum(1 for c, p in zip(cached, prompts) if c >= len(p) - CHUNK_SIZE) >= 6, cached
        assert sum(1 for c in cached if c >= 200) >= 12, cached
