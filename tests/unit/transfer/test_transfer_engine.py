"""The transfer engine on CPU: when each layer of a load or offload lands, which batch runs
an offload, and when a host slot may be handed to the I/O process. (The stream algorithm a
CUDA pool runs is checked on the CPU ordering model in test_transfer_ordering.py.)"""

from __future__ import annotations

import pytest
import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine

LAYERS, CHUNK, HEADS, DIM, TOKENS, SLOTS = 3, 4, 2, 8, 64, 6


def make_engine(mode: str = "both", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(TOKENS, HEADS, DIM, generator=gen), torch.randn(TOKENS, HEADS, DIM, generator=gen))
        for _ in range(LAYERS)
    ]
    layout = HostChunkLayout(SLOTS, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.randn(layout.total_bytes // 4, generator=gen).view(torch.uint8)  # no NaN patterns
    return TransferEngine(kv, host, layout, LayerwiseMode(mode)), kv, host.view(layout.shape)


def host_rows(host, slot: int, layer: int, kv: int) -> torch.Tensor:
    return host[slot, layer, kv].view(torch.float32).view(CHUNK, HEADS, DIM)


def test_modes():
    assert LayerwiseMode("both").loads and LayerwiseMode("both").offloads
    assert LayerwiseMode("load").loads and not LayerwiseMode("load").offloads
    assert not LayerwiseMode("offload").loads and LayerwiseMode("offload").offloads
    assert not LayerwiseMode("off").loads and not LayerwiseMode("off").offloads
    with pytest.raises(ValueError):
        LayerwiseMode("sometimes")


def test_load_lands_layer_by_layer_when_the_layer_is_read():
    engine, kv, host = make_engine("load")
    slots = torch.tensor([9, 3, 40, 41, 17, 5, 6, 63])  # two chunks, scattered
    engine.load(slots, [4, 1])
    expected = {
        (layer, i): torch.cat([host_rows(host, 4, layer, i), host_rows(host, 1, layer, i)])
        for layer in range(LAYERS)
        for i in (0, 1)
    }
    assert not torch.equal(kv[0][0][slots], expected[(0, 0)])  # nothing moved yet
    assert not engine.host_slot_ready(4)  # the copy still reads the slot
    engine.wait_until(0)  # the forward reads layer 0
    assert torch.equal(kv[0][0][slots], expected[(0, 0)]) and torch.equal(kv[0][1][slots], expected[(0, 1)])
    assert not torch.equal(kv[1][0][slots], expected[(1, 0)])  # layer 1 not yet
    engine.end_batch()  # whatever the forward did not read is copied now
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][0][slots], expected[(layer, 0)])
        assert torch.equal(kv[layer][1][slots], expected[(layer, 1)])
    assert engine.pending_loads == 0 and engine.host_slot_ready(4) and engine.host_slot_ready(1)


def test_without_layerwise_loads_a_load_copies_everything_at_once():
    engine, kv, host = make_engine("off")
    slots = torch.tensor([9, 3, 40, 41])
    engine.load(slots, [2])
    assert engine.pending_loads == 0 and engine.host_slot_ready(2)
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][0][slots], host_rows(host, 2, layer, 0))


def test_fence_before_reuse_finishes_pending_loads():
    engine, kv, host = make_engine("load")
    slots = torch.tensor([1, 2, 3, 4])
    engine.load(slots, [0])
    engine.fence_before_reuse()  # the device slots are about to be freed
    assert engine.pending_loads == 0
    assert torch.equal(kv[LAYERS - 1][1][slots], host_rows(host, 0, LAYERS - 1, 1))


def test_an_offload_runs_only_in_a_batch_of_its_own_request():
    engine, kv, host = make_engine("offload")
    slots = torch.tensor([7, 8, 9, 30])
    engine.plan_offload("r1", slots, 2)
    before = host_rows(host, 2, 0, 0).clone()
    engine.begin_batch(["other"])  # another batch's forward: r1's KV is not written by it
    for layer in range(LAYERS):
        engine.on_layer_written(layer)
    engine.end_batch()
    assert torch.equal(host_rows(host, 2, 0, 0), before) and engine.planned_offloads == 1
    assert not engine.offload_ran(2) and not engine.host_slot_ready(2)
    engine.begin_batch(["other", "r1"])
    for layer in range(LAYERS):
        kv[layer][0][slots] = float(layer + 1)  # the forward writes layer `layer`
        kv[layer][1][slots] = -float(layer + 1)
        engine.on_layer_written(layer)
        assert torch.all(host_rows(host, 2, layer, 0) == layer + 1)
        assert torch.all(host_rows(host, 2, layer, 1) == -(layer + 1))
        if layer < LAYERS - 1:
            assert torch.all(host_rows(host, 2, layer + 1, 0) != layer + 2)  # not copied before written
    engine.end_batch()
    assert engine.planned_offloads == 0 and engine.offload_ran(2) and engine.host_slot_ready(2)


def test_a_batchs_offloads_and_loads_are_copied_together_layer_by_layer(monkeypatch):
    """Several requests' chunks (one transfer each) are copied with one copy per layer and
    direction, each byte where the per-chunk copies put it; a load and an offload in
    the same batch stay apart."""
    import pcr_sglang.transfer.engine as engine_module

    calls = []
    real = engine_module.copy_layer
    monkeypatch.setattr(
        engine_module,
        "copy_layer",
        lambda direction, *args: calls.append((direction, args[-2])) or real(direction, *args),
    )
    engine, kv, host = make_engine("both")
    chunks = {"r1": ([7, 8, 9, 30], 2), "r2": ([40, 41, 42, 43], 0), "r3": ([1, 12, 3, 60], 5)}
    for owner, (slots, host_slot) in chunks.items():
        engine.plan_offload(owner, torch.tensor(slots), host_slot)
    load_slots = torch.tensor([20, 21, 22, 23])
    engine.load(load_slots, [4])
    loaded = {(layer, i): host_rows(host, 4, layer, i).clone() for layer in range(LAYERS) for i in (0, 1)}
    engine.begin_batch(list(chunks))
    for layer in range(LAYERS):
        engine.wait_until(layer)  # the forward reads layer `layer` (the load), then writes it
        for owner, (slots, _) in chunks.items():
            kv[layer][0][torch.tensor(slots)] = float(layer + 1) + int(owner[1]) / 10
            kv[layer][1][torch.tensor(slots)] = -float(layer + 1) - int(owner[1]) / 10
        engine.on_layer_written(layer)
    engine.end_batch()
    for layer in range(LAYERS):
        for owner, (_, host_slot) in chunks.items():
            assert torch.all(host_rows(host, host_slot, layer, 0) == float(layer + 1) + int(owner[1]) / 10)
            assert torch.all(host_rows(host, host_slot, layer, 1) == -float(layer + 1) - int(owner[1]) / 10)
        assert torch.equal(kv[layer][0][load_slots], loaded[(layer, 0)])
        assert torch.equal(kv[layer][1][load_slots], loaded[(layer, 1)])
    # One copy per layer for the three offloads, one per layer for the load.
    assert sorted(calls) == sorted([(d, layer) for layer in range(LAYERS) for d in (0, 1)])
    assert all(engine.host_slot_ready(slot) for _, slot in chunks.values()) and engine.host_slot_ready(4)


def test_offloads_naming_one_host_slot_twice_are_copied_one_transfer_at_a_time(monkeypatch):
    """A merged scatter into one slot twice has no defined order (torch's CPU scatter
    happens to keep the last write, a GPU kernel need not): such a group is copied
    transfer by transfer, so the offload planned last wins, as it did one at a time."""
    import pcr_sglang.transfer.engine as engine_module

    calls = []
    real = engine_module.copy_layer
    monkeypatch.setattr(
        engine_module, "copy_layer", lambda direction, *args: calls.append(args[-2]) or real(direction, *args)
    )
    engine, kv, host = make_engine("offload")
    kv[0][0][torch.tensor([1, 2, 3, 4])] = 1.0
    kv[0][0][torch.tensor([5, 6, 7, 8])] = 2.0
    engine.plan_offload("a", torch.tensor([1, 2, 3, 4]), 3)
    engine.plan_offload("b", torch.tensor([5, 6, 7, 8]), 3)
    engine.begin_batch(["a", "b"])
    engine.end_batch()
    assert torch.all(host_rows(host, 3, 0, 0) == 2.0)
    assert sorted(calls) == sorted(list(range(LAYERS)) * 2)  # each transfer's own copy, per layer


def test_end_batch_finishes_an_offload_whose_layers_were_written_without_the_hook():
    engine, kv, host = make_engine("offload")
    slots = torch.tensor([1, 2, 3, 4])
    engine.plan_offload("r", slots, 0)
    engine.begin_batch(["r"])
    engine.on_layer_written(0)
    for layer in range(LAYERS):  # e.g. a graph replay wrote layers 1.. without Python calls
        kv[layer][0][slots] = 5.0
        kv[layer][1][slots] = 6.0
    engine.end_batch()
    for layer in range(1, LAYERS):
        assert torch.all(host_rows(host, 0, layer, 0) == 5.0) and torch.all(host_rows(host, 0, layer, 1) == 6.0)


def test_dropped_plans_never_run_and_free_their_slot():
    engine, kv, host = make_engine("offload")
    engine.plan_offload("gone", torch.tensor([1, 2, 3, 4]), 3)
    before = host[3].clone()
    engine.drop_plans("gone")
    engine.begin_batch(["gone"])
    for layer in range(LAYERS):
        engine.on_layer_written(layer)
    engine.end_batch()
    assert torch.equal(host[3], before) and engine.host_slot_ready(3)


def test_plans_copy_the_device_slots_they_were_given():
    engine, kv, host = make_engine("offload")
    row = torch.tensor([1, 2, 3, 4])
    engine.plan_offload("r", row, 1)
    kv[0][0][torch.tensor([1, 2, 3, 4])] = 9.0
    row[:] = torch.tensor([10, 11, 12, 13])  # SGLang rewrites the row (a duplicate chunk)
    engine.begin_batch(["r"])
    engine.end_batch()
    assert torch.all(host_rows(host, 1, 0, 0) == 9.0)


def test_copy_to_host_then_load_round_trips():
    engine, kv, host = make_engine("off")
    src, dst = torch.tensor([0, 1, 2, 3]), torch.tensor([50, 52, 54, 56])
    engine.copy_to_host(src, [5])
    assert engine.host_slot_ready(5)
    engine.load(dst, [5])
    for k, v in kv:
        assert torch.equal(k[dst], k[src]) and torch.equal(v[dst], v[src])


def test_a_cpu_pool_runs_the_inline_algorithm_unless_given_streams():
    """No streams on a CPU pool: a layer-wise load waits for the layer hook. Given streams
    (the ordering model), the CUDA algorithm runs instead: every layer issued at once."""
    from pcr_sglang.transfer.streams import OrderingModel

    engine, kv, host = make_engine("load")
    engine.load(torch.tensor([1, 2, 3, 4]), [0])
    assert engine.pending_loads == 1
    _, kv, _ = make_engine()
    layout = HostChunkLayout(SLOTS, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.randn(layout.total_bytes // 4).view(torch.uint8)
    streamed = TransferEngine(kv, host, layout, LayerwiseMode.LOAD, streams=OrderingModel())
    streamed.load(torch.tensor([1, 2, 3, 4]), [0])
    assert streamed.pending_loads == 0 and not streamed.host_slot_ready(0)  # issued, not complete
    assert torch.equal(
        kv[LAYERS - 1][0][torch.tensor([1, 2, 3, 4])],
        host.view(layout.shape)[0, LAYERS - 1, 0].view(torch.float32).view(CHUNK, HEADS, DIM),
    )


def test_layer_count_must_match_the_host_layout():
    _, kv, _ = make_engine()
    with pytest.raises(ValueError, match="layers"):
        TransferEngine(kv[:2], torch.empty(0, dtype=torch.uint8), HostChunkLayout(1, LAYERS, CHUNK, 64))


# ---------------------------------------------------------------- re-placements (document reuse)
SPEC_INV_FREQ = (1.0, 0.1, 0.01, 0.001)


def rope_spec():
    from pcr_sglang.transfer.rope_shift import RopeSpec

    return RopeSpec(DIM, DIM, True, SPEC_INV_FREQ)


def rotated_host_rows(host, slot: int, layer: int, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What re-placing host slot ``slot``'s chunk, once loaded, by ``delta`` must give."""
    from pcr_sglang.transfer.rope_shift import shift_keys_torch

    return shift_keys_torch(host_rows(host, slot, layer, 0), delta, rope_spec()), host_rows(host, slot, layer, 1)


def test_a_replacement_runs_layer_by_layer_after_that_layer_of_the_loads_it_reads():
    """Document reuse on a host hit: the document's chain is loaded into the device and
    its KV re-placed from there. Layer ``i`` of the re-placement runs when the forward
    reads layer ``i``, after layer ``i`` of the load (it rotates the loaded KV, not what
    the slots held before), and nothing of a later layer has run yet."""
    engine, kv, host = make_engine("load")
    chain = torch.tensor([9, 3, 40, 41])  # one chunk, loaded from host slot 2
    engine.load(chain, [2])
    private, delta = torch.tensor([50, 51, 52, 53]), torch.tensor([7, 7, 7, 7])
    engine.replace(chain, private, delta, rope_spec())
    untouched = [kv[layer][0][private].clone() for layer in range(LAYERS)]
    assert engine.pending_replacements == 1
    engine.wait_until(0)
    k0, v0 = rotated_host_rows(host, 2, 0, delta)
    assert torch.allclose(kv[0][0][private], k0) and torch.equal(kv[0][1][private], v0)
    assert not torch.allclose(k0, host_rows(host, 2, 0, 0))  # rotated, not copied
    for layer in range(1, LAYERS):
        assert torch.equal(kv[layer][0][private], untouched[layer])  # not yet
    engine.wait_until(1)
    assert torch.allclose(kv[1][0][private], rotated_host_rows(host, 2, 1, delta)[0])
    assert torch.equal(kv[2][0][private], untouched[2])
    engine.end_batch()  # a layer the forward did not read is re-placed at the end of its batch
    k2, v2 = rotated_host_rows(host, 2, 2, delta)
    assert torch.allclose(kv[2][0][private], k2) and torch.equal(kv[2][1][private], v2)
    assert engine.pending_replacements == 0


def test_a_replacement_of_some_layers_runs_only_those():
    """blend re-places layers 0-1 of every candidate for its probe, then the other layers
    of the tokens it keeps: a re-placement touches only its layers."""
    engine, kv, host = make_engine("load")
    src, dst, delta = torch.tensor([1, 2]), torch.tensor([30, 31]), torch.tensor([3, 3])
    before = kv[0][0][dst].clone()
    engine.replace(src, dst, delta, rope_spec(), layers=range(1, LAYERS))
    engine.end_batch()
    assert torch.equal(kv[0][0][dst], before)
    for layer in range(1, LAYERS):
        assert torch.equal(kv[layer][1][dst], kv[layer][1][src])


def test_fence_before_reuse_finishes_pending_replacements():
    """Slots about to be freed (a chain evicted, a request aborted before its forward) may
    be a pending re-placement's source or target: it runs first."""
    engine, kv, host = make_engine("load")
    src, dst, delta = torch.tensor([1, 2]), torch.tensor([30, 31]), torch.tensor([0, 0])
    engine.replace(src, dst, delta, rope_spec())
    engine.fence_before_reuse()
    assert engine.pending_replacements == 0
    assert all(torch.equal(kv[layer][0][dst], kv[layer][0][src]) for layer in range(LAYERS))


def test_without_layerwise_loads_a_replacement_runs_at_once():
    engine, kv, host = make_engine("off")
    chain = torch.tensor([9, 3, 40, 41])
    engine.load(chain, [2])
    private, delta = torch.tensor([50, 51, 52, 53]), torch.tensor([5, 5, 5, 5])
    engine.replace(chain, private, delta, rope_spec())
    assert engine.pending_replacements == 0
    for layer in range(LAYERS):
        assert torch.allclose(kv[layer][0][private], rotated_host_rows(host, 2, layer, delta)[0])
