"""Nothing is written through to the remote tier under an in-memory update's namespace
(review N13b), over PCR's cache with a real SSD store, I/O process and Mooncake store on
loopback. Such a namespace is a nonce no server will ever have again: its objects could
never be read and would only evict the fleet's useful ones (an RL server moves every step)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from pcr_sglang.sglang_adapter import weight_updates
from pcr_sglang.sglang_adapter.fingerprint import IN_MEMORY_UPDATE_TAG
from pcr_sglang.sglang_adapter.weight_updates import WeightsIdentity, around_weight_update
from pcr_sglang.tiers.records import RecordCodec
from pcr_sglang.tiers.remote_store import RemoteChunkStore, RemoteConfig, load_fleet_key
from pcr_tools.mooncake_services import client_config
from tests.unit.adapter_harness import make  # noqa: F401
from tests.unit.sglang_adapter.test_weight_updates import (
    flushing_update,
    manager_of,
    open_session,
    persisted,
    prompt,
    session_manager,
)
from tests.unit.tiers.test_remote_store import fleet_key, mooncake  # noqa: F401

LANDS_S = 2.0  # a loopback write lands in milliseconds


def remote_chunks(h, config_json: str, namespace_digest: bytes, tokens: list[int], wait_for: int) -> int:
    """How many leading chunks of ``tokens`` (keys as the server derives them now) the
    remote store holds under ``namespace_digest``, polled until ``wait_for`` or LANDS_S."""
    config = RemoteConfig.parse(config_json)
    store = RemoteChunkStore(
        config,
        RecordCodec(load_fleet_key(config.key_file), namespace_digest, h.cache.host_pool.layout, h.cache.store.dtype),
    )
    store.open()
    try:
        keys = h.scheduler.keys.of_tokens(tokens)
        deadline = time.monotonic() + LANDS_S
        while True:
            found = store.probe([keys])[0]
            if found >= wait_for or time.monotonic() > deadline:
                return found
            time.sleep(0.05)
    finally:
        store.close()


def test_nothing_is_written_through_to_the_remote_tier_under_an_in_memory_namespace(
    make, mooncake, fleet_key, tmp_path
):
    config_json = json.dumps(client_config(mooncake, fleet_key))
    h = make(host_slots=8, ssd_path=tmp_path / "ssd", remote_config=config_json)
    startup = h.cache.store.namespace
    persisted(h, prompt(100))
    assert h.scheduler.probes.enabled and remote_chunks(h, config_json, startup, prompt(100), 3) == 3  # written through

    # A session opens: its keys are a nonce's at once, the SSD tier moves at the next flush.
    manager = session_manager(h)
    around_weight_update(weight_updates.SESSION_BEGIN, open_session, manager, SimpleNamespace())
    persisted(h, prompt(300))
    assert remote_chunks(h, config_json, startup, prompt(300), 1) == 0
    assert not h.scheduler.probes.enabled and not h.scheduler.admission.probes.enabled

    # Weights from tensors, with the flush: the tiers move to the update's nonce namespace.
    around_weight_update("update_weights_from_tensor", flushing_update(h.cache), manager, SimpleNamespace())
    assert h.cache.namespace.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)
    persisted(h, prompt(500))
    assert remote_chunks(h, config_json, h.cache.store.namespace, prompt(500), 1) == 0
    assert not h.scheduler.probes.enabled and h.scheduler.io.config.remote_config == ""
    assert h.scheduler.admission.probes is h.scheduler.probes  # admission probes no tier the I/O process lacks

    # A checkpoint's weights again (a disk update): the remote tier comes back.
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"M" * 4096)
    h.cache.weights_identity = WeightsIdentity(SimpleNamespace(hf_config=None), str(model))
    around_weight_update(
        "update_weights_from_disk", flushing_update(h.cache), manager_of(h), SimpleNamespace(model_path=str(model))
    )
    persisted(h, prompt(700))
    assert h.scheduler.probes.enabled and h.scheduler.admission.probes is h.scheduler.probes
    assert remote_chunks(h, config_json, h.cache.store.namespace, prompt(700), 3) == 3
    h.check()
