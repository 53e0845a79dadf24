"""The cache namespace follows the weights: an update in place (SGLang's
``update_weights_from_*``, which flushes the tree cache) moves every tier to the new
weights' namespace, over PCR's cache on SGLang's real CPU KV pool, with a real SSD store
and I/O process. Before, the flush put every SSD record back under the startup namespace,
so the old weights' KV was served after the update."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from pcr_sglang.sglang_adapter import weight_updates
from pcr_sglang.sglang_adapter.fingerprint import IN_MEMORY_UPDATE_TAG
from pcr_sglang.sglang_adapter.weight_updates import WeightsIdentity, around_weight_update
from pcr_sglang.tiers.store_dir import list_namespaces
from tests.unit.adapter_harness import CHUNK, Harness, make  # noqa: F401


def prompt(start: int, chunks: int = 3) -> list[int]:
    return list(range(start, start + chunks * CHUNK))


def persisted(h: Harness, tokens: list[int]) -> None:
    h.serve(tokens)
    h.cache.evict(EvictParams(num_tokens=10**6))
    h.drain_io()


def reusable_chunks(h: Harness, tokens: list[int]) -> int:
    """Chunks of ``tokens`` some tier could serve now (device, host or SSD)."""
    match = h.state.match(iter(h.scheduler.keys.of_tokens(tokens)))
    return match.device + match.host + match.ssd


def flush(cache) -> None:
    """SGLang's ``Scheduler.flush_cache``: the tree cache's reset, then the allocator's."""
    cache.reset()
    cache.token_to_kv_pool_allocator.clear()


def flushing_update(cache, success: bool = True):
    """What SGLang's update call does once the weights are loaded: flush the tree cache
    (``flush_cache_after_weight_update``), then answer."""

    def original(manager, recv_req):
        if success:
            flush(cache)
        return SimpleNamespace(success=success)

    return original


def manager_of(h: Harness) -> SimpleNamespace:
    return SimpleNamespace(scheduler=SimpleNamespace(tree_cache=h.cache))


def test_a_flush_after_a_weight_update_restores_nothing_of_the_old_weights(make, tmp_path):
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    tokens = prompt(100)
    persisted(h, tokens)
    assert reusable_chunks(h, tokens) == 3
    flush(h.cache)  # a plain /flush_cache keeps what is persisted
    assert reusable_chunks(h, tokens) == 3

    around_weight_update("update_weights_from_tensor", flushing_update(h.cache), manager_of(h), SimpleNamespace())
    assert h.cache.namespace.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)
    assert reusable_chunks(h, tokens) == 0 and h.state.tree.ssd_chunks == 0
    h.step()
    h.check()
    # Served again under the new weights: persisted in the new namespace's directory.
    persisted(h, tokens)
    assert h.state.ssd_stats.written_chunks >= 6
    assert h.cache.store.namespace == h.cache.namespace.digest()
    h.check()


def test_keys_change_as_the_update_starts_even_without_a_flush(make, tmp_path):
    """``flush_cache: false``: SGLang keeps the device cache, but no new request's key
    matches a chunk computed before the update."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    tokens = prompt(100)
    h.serve(tokens)
    assert reusable_chunks(h, tokens) == 3

    def no_flush(manager, recv_req):
        return SimpleNamespace(success=True)

    around_weight_update("update_weights_from_distributed", no_flush, manager_of(h), SimpleNamespace())
    assert reusable_chunks(h, tokens) == 0
    assert h.cache.pending_namespace is not None  # the SSD tier moves at the next flush
    flush(h.cache)
    assert h.cache.pending_namespace is None and reusable_chunks(h, tokens) == 0
    h.check()


def test_a_disk_update_moves_to_the_checkpoints_namespace_and_a_rollback_finds_its_records(make, tmp_path):
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    model_a, model_b = tmp_path / "a", tmp_path / "b"
    for folder, byte in ((model_a, b"A"), (model_b, b"B")):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(byte * 4096)  # not safetensors: sampled as opaque bytes
    identity = WeightsIdentity(SimpleNamespace(hf_config=None), str(model_a))
    h.cache.weights_identity = identity
    tokens = prompt(100)
    around_weight_update(
        "update_weights_from_disk", flushing_update(h.cache), manager_of(h), SimpleNamespace(model_path=str(model_a))
    )  # to the checkpoint's own namespace
    assert h.cache.namespace.model_fingerprint == identity.of_checkpoint(str(model_a))
    persisted(h, tokens)
    namespace_a = h.cache.namespace

    around_weight_update(
        "update_weights_from_disk", flushing_update(h.cache), manager_of(h), SimpleNamespace(model_path=str(model_b))
    )
    assert h.cache.namespace.model_fingerprint == identity.of_checkpoint(str(model_b))
    assert reusable_chunks(h, tokens) == 0
    persisted(h, prompt(300))

    restored = h.state.ssd_stats.restored_chunks
    around_weight_update(
        "update_weights_from_disk", flushing_update(h.cache), manager_of(h), SimpleNamespace(model_path=str(model_a))
    )
    assert h.cache.namespace == namespace_a
    assert h.state.ssd_stats.restored_chunks == restored + 3  # A's records, kept for the rollback
    assert reusable_chunks(h, tokens) == 3 and reusable_chunks(h, prompt(300)) == 0
    h.check()
    # Both checkpoints' directories stay on disk (purged by `python -m pcr_tools.store_cli purge`).
    kept = {ns.digest_hex for ns in list_namespaces(tmp_path / "ssd") if ns.chunks}
    assert kept == {
        namespace_a.digest().hex(),
        replace(namespace_a, model_fingerprint=identity.of_checkpoint(str(model_b))).digest().hex(),
    }


def test_a_failed_update_gets_a_namespace_of_its_own(make, tmp_path):
    """The weights may be partly new after a failed update: nothing before it or under
    the checkpoint it tried to load is shared with what follows."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    model_b = tmp_path / "b"
    model_b.mkdir()
    (model_b / "model.safetensors").write_bytes(b"B" * 4096)
    h.cache.weights_identity = WeightsIdentity(SimpleNamespace(hf_config=None), str(tmp_path))
    tokens = prompt(100)
    persisted(h, tokens)
    around_weight_update(
        "update_weights_from_disk",
        flushing_update(h.cache, success=False),
        manager_of(h),
        SimpleNamespace(model_path=str(model_b)),
    )
    pending = h.cache.pending_namespace
    assert pending is not None and pending.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)

    def raising(manager, recv_req):
        raise RuntimeError("load failed")

    with pytest.raises(RuntimeError):
        around_weight_update("update_weights_from_tensor", raising, manager_of(h), SimpleNamespace())
    assert h.cache.pending_namespace not in (None, pending)
    flush(h.cache)
    assert reusable_chunks(h, tokens) == 0 and h.state.tree.ssd_chunks == 0
    h.check()


def test_leaving_an_in_memory_namespace_purges_its_directory(make, tmp_path):
    """No server can ever have an in-memory update's weights again: its records are
    deleted when the server moves on (RL servers update every step: they would fill the
    disk)."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    around_weight_update("update_weights_from_tensor", flushing_update(h.cache), manager_of(h), SimpleNamespace())
    persisted(h, prompt(100))
    first = h.cache.namespace.digest().hex()
    assert first in {ns.digest_hex for ns in list_namespaces(tmp_path / "ssd")}
    around_weight_update("update_weights_from_tensor", flushing_update(h.cache), manager_of(h), SimpleNamespace())
    names = {ns.digest_hex for ns in list_namespaces(tmp_path / "ssd")}
    assert first not in names and h.cache.namespace.digest().hex() in names
    persisted(h, prompt(200))
    h.check()


def test_a_disk_update_to_weights_not_on_this_machine_gets_a_namespace_of_its_own(make, tmp_path, monkeypatch):
    """review N7: a hub id is downloaded by SGLang during the call (perhaps a newer revision
    than any snapshot here), so PCR cannot fingerprint it before. It used to get a namespace
    made of its name alone, the same for every revision pushed under that name: a peer or a
    later update to ``org/model`` read the KV of another revision."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    h.cache.weights_identity = WeightsIdentity(
        SimpleNamespace(hf_config=None), str(tmp_path), download_dir=str(tmp_path / "hub")
    )
    to_hub = SimpleNamespace(model_path="org/model")
    around_weight_update("update_weights_from_disk", flushing_update(h.cache), manager_of(h), to_hub)
    first = h.cache.namespace
    assert first.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)
    persisted(h, prompt(100))
    around_weight_update("update_weights_from_disk", flushing_update(h.cache), manager_of(h), to_hub)
    assert h.cache.namespace != first and reusable_chunks(h, prompt(100)) == 0
    h.check()


def test_the_hook_leaves_other_caches_alone():
    calls = []

    def original(manager, recv_req):
        calls.append(recv_req)
        return "out"

    manager = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=object()))
    assert around_weight_update("update_weights_from_disk", original, manager, "req") == "out"
    assert calls == ["req"]
    assert weight_updates.UPDATE_METHODS[0] == "update_weights_from_disk"


def test_a_session_that_wrote_the_weights_directly_moves_the_namespace(make, tmp_path):
    """``begin_weight_update``, weights written into device memory over P2P or RDMA (no
    update call runs), ``end_weight_update``, ``/flush_cache``: the flush used to restore
    every SSD record of the old weights."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    tokens = prompt(100)
    persisted(h, tokens)
    manager = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=h.cache), _session=object())

    def end(manager, recv_req):
        manager._session = None
        return SimpleNamespace(success=True)

    around_weight_update(weight_updates.SESSION_END, end, manager, SimpleNamespace())
    assert reusable_chunks(h, tokens) == 0
    flush(h.cache)
    assert h.cache.namespace.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)
    assert reusable_chunks(h, tokens) == 0 and h.state.tree.ssd_chunks == 0
    h.check()


def test_calls_sglang_refuses_before_touching_the_weights_keep_the_cache(make, tmp_path):
    """An update from tensors outside a session, or the end of no session, changes no weight."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    tokens = prompt(100)
    persisted(h, tokens)
    start = h.cache.namespace
    manager = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=h.cache), _session=None)
    refused = lambda manager, recv_req: SimpleNamespace(success=False)  # noqa: E731
    for method in (*weight_updates.SESSION_METHODS, weight_updates.SESSION_END):
        around_weight_update(method, refused, manager, SimpleNamespace())
    assert h.cache.pending_namespace is None and h.cache.namespace == start
    assert reusable_chunks(h, tokens) == 3


def test_a_disk_update_to_files_that_look_the_same_or_cannot_be_read_gets_a_namespace_of_its_own(make, tmp_path):
    """The fingerprint samples each tensor: a checkpoint edited in a few rows can look like
    the one served. Reusing the current namespace would serve the old weights' KV; and a
    path that cannot be read must not raise in the scheduler loop."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    model_a = tmp_path / "a"
    model_a.mkdir()
    (model_a / "model.safetensors").write_bytes(b"A" * 4096)
    identity = WeightsIdentity(SimpleNamespace(hf_config=None), str(model_a))
    h.cache.weights_identity = identity
    h.cache.namespace = replace(h.cache.namespace, model_fingerprint=identity.of_checkpoint(str(model_a)))
    tokens = prompt(100)
    persisted(h, tokens)
    around_weight_update(
        "update_weights_from_disk", flushing_update(h.cache), manager_of(h), SimpleNamespace(model_path=str(model_a))
    )
    assert h.cache.namespace.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)
    assert reusable_chunks(h, tokens) == 0

    unreadable = tmp_path / "x.index.json"
    unreadable.mkdir()  # a folder where the fingerprint reads a file
    with pytest.raises(OSError):
        identity.of_checkpoint(str(tmp_path))
    around_weight_update(
        "update_weights_from_disk",
        flushing_update(h.cache, success=False),
        manager_of(h),
        SimpleNamespace(model_path=str(tmp_path)),
    )
    assert h.cache.pending_namespace.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)
    h.check()


def test_a_rekey_drops_what_was_derived_under_the_old_namespace(make, tmp_path):
    """Live hints and remote probes hold keys of the old namespace: they would read the old
    weights' chunks back from the SSD for the next requests."""
    from pcr_sglang.core.hints import HintPayload

    tokens = prompt(100)
    persisted(make(host_slots=3, ssd_path=tmp_path / "ssd"), tokens)
    h = make(host_slots=12, ssd_path=tmp_path / "ssd")  # the chain only on SSD
    req = h.request(tokens + [0], "hinted")
    assert h.scheduler.kv_hints.add(req, HintPayload(hint_only=True, ttl_s=30.0, group=None, rank=0))
    assert len(h.scheduler.hints) == 1
    around_weight_update(
        "update_weights_from_tensor", lambda m, r: SimpleNamespace(success=True), manager_of(h), SimpleNamespace()
    )
    assert len(h.scheduler.hints) == 0
    h.step()
    h.drain_io()
    assert h.state.tree.host_chunks == 0 and h.state.ssd_stats.hint_issued == 0
    h.check()


def test_the_plugin_wraps_every_call_that_can_change_the_weights():
    """Every public method of SGLang's own weight updater is either wrapped by the plugin
    (a hook on a name SGLang does not have would never run) or listed, with its reason, as
    one that changes no served weight: a method SGLang adds, or one PCR missed (as
    ``begin_weight_update`` was), fails here until it is decided."""
    import inspect

    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from pcr_sglang import plugin

    if not plugin._registered:
        plugin.register()
    public = {
        name for name, member in inspect.getmembers(SchedulerWeightUpdaterManager, callable) if not name.startswith("_")
    }
    wrapped, unchanged = set(weight_updates.WRAPPED_METHODS), set(weight_updates.WEIGHTS_UNCHANGED)
    assert not wrapped & unchanged
    assert (wrapped | unchanged) - public == set(), "names SGLang's updater does not have"
    assert public - wrapped - unchanged == set(), "neither wrapped nor listed as changing no weight"
    assert all(weight_updates.WEIGHTS_UNCHANGED.values())
    prefix = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager."
    for method in sorted(wrapped):
        hooks = HookRegistry._hooks.get(prefix + method, [])
        assert any(kind is HookType.AROUND and getattr(hook, "args", ()) == (method,) for kind, hook, _ in hooks), (
            method
        )


def session_manager(h: Harness) -> SimpleNamespace:
    return SimpleNamespace(scheduler=SimpleNamespace(tree_cache=h.cache), _session=None)


def open_session(manager, recv_req):
    if manager._session is not None:
        return SimpleNamespace(success=False)
    manager._session = object()
    return SimpleNamespace(success=True)


def close_session(manager, recv_req):
    manager._session = None
    return SimpleNamespace(success=True)


def test_kv_computed_while_a_session_writes_the_weights_is_not_kept_under_the_checkpoints_namespace(make, tmp_path):
    """review N3: requests served between ``begin_weight_update`` and its end (an in-flight
    update without ``pause_generation``) compute KV with partly written weights. It used to
    be persisted under the checkpoint's namespace, whose SSD directory is kept for a
    rollback: a rollback to that checkpoint served it."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    model_a = tmp_path / "a"
    model_a.mkdir()
    (model_a / "model.safetensors").write_bytes(b"A" * 4096)
    h.cache.weights_identity = WeightsIdentity(SimpleNamespace(hf_config=None), str(model_a))
    to_a = SimpleNamespace(model_path=str(model_a))
    around_weight_update("update_weights_from_disk", flushing_update(h.cache), manager_of(h), to_a)
    namespace_a = h.cache.namespace
    manager = session_manager(h)
    around_weight_update(weight_updates.SESSION_BEGIN, open_session, manager, SimpleNamespace())
    assert h.cache.pending_namespace.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)
    tokens = prompt(100)
    persisted(h, tokens)  # served during the session
    around_weight_update(weight_updates.SESSION_BEGIN, open_session, manager, SimpleNamespace())  # refused
    around_weight_update(weight_updates.SESSION_END, close_session, manager, SimpleNamespace())
    flush(h.cache)
    around_weight_update("update_weights_from_disk", flushing_update(h.cache), manager_of(h), to_a)  # rollback
    assert h.cache.namespace == namespace_a
    assert reusable_chunks(h, tokens) == 0
    h.check()


def test_a_begin_that_sglang_refuses_keeps_the_namespace(make, tmp_path):
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    manager = session_manager(h)
    manager._session = object()  # a session is open already: SGLang refuses the second begin
    around_weight_update(weight_updates.SESSION_BEGIN, open_session, manager, SimpleNamespace())
    assert h.cache.pending_namespace is None


@pytest.mark.parametrize(
    "method, recv_req, cpu_backup, moves",
    [
        (weight_updates.CHECK_WEIGHTS, SimpleNamespace(action="reset_tensors"), False, True),
        (weight_updates.CHECK_WEIGHTS, SimpleNamespace(action="checksum"), False, False),
        (weight_updates.CHECK_WEIGHTS, SimpleNamespace(action="snapshot"), False, False),
        (weight_updates.MEMORY_RESUME, SimpleNamespace(tags=None), False, True),
        (weight_updates.MEMORY_RESUME, SimpleNamespace(tags=["weights", "kv_cache"]), False, True),
        (weight_updates.MEMORY_RESUME, SimpleNamespace(tags=["weights"]), True, False),
        (weight_updates.MEMORY_RESUME, SimpleNamespace(tags=["kv_cache"]), False, False),
    ],
)
def test_calls_that_overwrite_the_weights_in_place_move_the_namespace(
    make, tmp_path, method, recv_req, cpu_backup, moves
):
    """``check_weights`` with ``reset_tensors`` overwrites every tensor; weights released
    without a CPU backup come back unwritten at the resume. KV computed after either must
    not match what the weights before computed."""
    h = make(host_slots=8, ssd_path=tmp_path / "ssd")
    tokens = prompt(100)
    persisted(h, tokens)
    manager = SimpleNamespace(
        scheduler=SimpleNamespace(tree_cache=h.cache, server_args=SimpleNamespace(enable_weights_cpu_backup=cpu_backup))
    )
    around_weight_update(method, lambda m, r: SimpleNamespace(success=True), manager, recv_req)
    assert (h.cache.pending_namespace is not None) == moves
    assert reusable_chunks(h, tokens) == (0 if moves else 3)
    h.check()
