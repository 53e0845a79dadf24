"""A restart with different weights never hits: model B has the tiny model's config, file
names, file sizes and byte-identical safetensors header, only other values in every
tensor; a PCR server with B on the SSD store model A wrote gets no hit from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pcr_sglang.launcher import ServerProcess
from tests.e2e.helpers import COMMON_ARGS, GREEDY, serving, ssd_server, wait_for_write_back

pytestmark = pytest.mark.e2e

WEIGHTS = "model.safetensors"


def _header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[: 8 + int.from_bytes(data[:8], "little")]


@pytest.fixture(scope="module")
def model_b(tiny_model, tmp_path_factory) -> str:
    """The tiny model with seeded noise added to every tensor (same dtype and shape)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("tiny-llama-b")
    shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(99)
    with safe_open(str(Path(tiny_model) / WEIGHTS), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for name, t in tensors.items():
        tensors[name] = (t + 0.05 * torch.randn(t.shape, generator=generator, dtype=t.dtype)).contiguous()
    save_file(tensors, str(folder / WEIGHTS), metadata=metadata)
    assert _header(folder / WEIGHTS) == _header(Path(tiny_model) / WEIGHTS)
    assert (folder / WEIGHTS).stat().st_size == (Path(tiny_model) / WEIGHTS).stat().st_size
    return str(folder)


@pytest.fixture(scope="module")
def prompts(rag_prompt_ids):
    """Prompts that share no chunk with each other (a distinct first token each), so any hit
    a fresh server gets comes from the store."""
    return [[3 + i, *ids] for i, ids in enumerate(rag_prompt_ids[:6])]


def _run(server, prompts):
    outs = [server.generate({"input_ids": p, "sampling_params": GREEDY}) for p in prompts]
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def test_restart_with_different_weights_never_hits(tiny_model, model_b, prompts, tmp_path_factory):
    store = tmp_path_factory.mktemp("pcr-ssd-fp") / "store"
    with serving({"a": ssd_server(tiny_model, store)}) as first:
        outputs_a, cached_a = _run(first["a"], prompts)
        state = wait_for_write_back(first["a"])
        assert cached_a == [0] * len(prompts)
        assert state["ssd"]["counters"]["written_chunks"] >= len(prompts) * 4, state["ssd"]
    records_of_a = len(list(store.rglob("*.chunk")))
    assert records_of_a >= len(prompts) * 4

    servers = {"b": ssd_server(model_b, store),
               "b_baseline": ServerProcess(model_b, (*COMMON_ARGS, "--disable-radix-cache"))}
    with serving(servers):
        restored = servers["b"].pcr_state()["ssd"]["counters"]["restored_chunks"]
        outputs_b, cached_b = _run(servers["b"], prompts)
        baseline_b, _ = _run(servers["b_baseline"], prompts)
        state = servers["b"].pcr_state(check_invariants=True)
    assert restored == 0
    assert cached_b == [0] * len(prompts)
    assert state["ssd"]["counters"]["hit_chunks"] == 0 and state["ssd"]["counters"]["on_demand_reads"] == 0
    assert state["counters"]["host_hit_chunks"] == 0 and state["counters"]["device_hit_chunks"] == 0
    assert state["invariants"]["ok"]
    assert outputs_b == baseline_b
    # The models really differ, so a false hit would have been possible to see.
    assert outputs_a != baseline_b
