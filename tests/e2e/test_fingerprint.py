"""A restart with different weights never hits: model B has the tiny model's config, file
names, file sizes and byte-identical safetensors header, only other values in every
tensor; a PCR server with B on the SSD store model A wrote gets no hit from it. Nor does a
server whose weights are updated in place from A to B (``/update_weights_from_disk``),
and one updated back to A finds A's records again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import requests

from pcr_tools.launcher import ServerProcess
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


@pytest.fixture(scope="module")
def baseline_b(model_b, prompts):
    """Model B's outputs without any cache."""
    with serving({"b_baseline": ServerProcess(model_b, (*COMMON_ARGS, "--disable-radix-cache"))}) as servers:
        return _run(servers["b_baseline"], prompts)[0]


def _run(server, prompts):
    outs = [server.generate({"input_ids": p, "sampling_params": GREEDY}) for p in prompts]
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def test_restart_with_different_weights_never_hits(tiny_model, model_b, prompts, baseline_b, tmp_path_factory):
    store = tmp_path_factory.mktemp("pcr-ssd-fp") / "store"
    with serving({"a": ssd_server(tiny_model, store)}) as first:
        outputs_a, cached_a = _run(first["a"], prompts)
        state = wait_for_write_back(first["a"])
        assert cached_a == [0] * len(prompts)
        assert state["ssd"]["counters"]["written_chunks"] >= len(prompts) * 4, state["ssd"]
    records_of_a = len(list(store.rglob("*.chunk")))
    assert records_of_a >= len(prompts) * 4

    servers = {"b": ssd_server(model_b, store)}
    with serving(servers):
        restored = servers["b"].pcr_state()["ssd"]["counters"]["restored_chunks"]
        outputs_b, cached_b = _run(servers["b"], prompts)
        state = servers["b"].pcr_state(check_invariants=True)
    assert restored == 0
    assert cached_b == [0] * len(prompts)
    assert state["ssd"]["counters"]["hit_chunks"] == 0 and state["ssd"]["counters"]["on_demand_reads"] == 0
    assert state["counters"]["host_hit_chunks"] == 0 and state["counters"]["device_hit_chunks"] == 0
    assert state["invariants"]["ok"]
    assert outputs_b == baseline_b
    # The models really differ, so a false hit would have been possible to see.
    assert outputs_a != baseline_b


def _update_weights(server, model_path: str) -> None:
    r = requests.post(f"{server.base_url}/update_weights_from_disk", json={"model_path": model_path}, timeout=300)
    assert r.status_code == 200 and r.json()["success"], r.text


def test_a_weight_update_in_place_never_serves_the_old_weights_kv(
    tiny_model, model_b, prompts, baseline_b, tmp_path_factory
):
    """The namespace follows the weights: after ``/update_weights_from_disk`` to B, no KV
    of A is served from any tier (the flush used to restore every SSD record of A under the
    startup namespace), and outputs equal a fresh server's on B; after an update back to A,
    A's records (kept on disk for a rollback) are served again."""
    store = tmp_path_factory.mktemp("pcr-ssd-update") / "store"
    with serving({"a": ssd_server(tiny_model, store)}) as servers:
        server = servers["a"]
        outputs_a, _ = _run(server, prompts)
        written = wait_for_write_back(server)["ssd"]["counters"]["written_chunks"]
        assert written >= len(prompts) * 4
        before = server.pcr_state()["namespace"]["model_fingerprint"]

        hits_before = server.pcr_state()["ssd"]["counters"]["hit_chunks"]
        _update_weights(server, model_b)
        outputs_b, cached_b = _run(server, prompts)
        state = server.pcr_state(check_invariants=True)
        assert cached_b == [0] * len(prompts)
        assert state["ssd"]["counters"]["hit_chunks"] == hits_before
        assert state["ssd"]["counters"]["on_demand_reads"] == 0
        assert state["invariants"]["ok"]
        assert outputs_b == baseline_b
        assert state["namespace"]["model_fingerprint"] != before

        wait_for_write_back(server)
        _update_weights(server, tiny_model)
        assert server.pcr_state()["namespace"]["model_fingerprint"] == before
        outputs_again, cached_again = _run(server, prompts)
        state = server.pcr_state(check_invariants=True)
        assert outputs_again == outputs_a
        assert sum(cached_again) > 0 and state["ssd"]["counters"]["hit_chunks"] > hits_before
        assert state["invariants"]["ok"]

        # review N3, through SGLang's real updater: opening a session moves the keys at
        # once (weights may be written in device memory from then on), so what is served
        # during it neither reads nor is kept under A's namespace; the flush moves the tiers.
        for route in ("begin_weight_update", "flush_cache"):
            r = requests.post(f"{server.base_url}/{route}", json={}, timeout=60)
            assert r.status_code == 200, (route, r.text)
        assert server.pcr_state()["namespace"]["model_fingerprint"].startswith("in-memory-update:")
        outputs_session, cached_session = _run(server, prompts)
        r = requests.post(f"{server.base_url}/end_weight_update", json={}, timeout=60)
        assert r.status_code == 200, r.text
    assert outputs_session == outputs_a and cached_session == [0] * len(prompts)
