"""The transfer engine's CUDA algorithm on the CPU ordering model.

On a CPU pool the engine runs each copy inline, so its stream algorithm (side streams,
per-layer events, ``fence_after_forward``, ``fence_before_reuse``, the re-placement
stream) would otherwise be run by no test. Here the engine gets an
:class:`~pcr_sglang.transfer.streams.OrderingModel` as its streams: copies still run at
once on CPU tensors (the data is checked), and every copy's reads and writes are checked
against the forward's, which the tests play on the stream SGLang runs it on (the overlap
scheduler's forward stream, launched after the schedule stream's work). A conflicting
pair of accesses that no wait orders raises :class:`OrderingError` at the second one.

Each wait the engine issues on this path is needed by at least one test below: with any
one of them removed a test fails (each test's docstring names the waits it needs), except
the re-placement stream's wait for whole loads without layer-wise loads, which the compute
streams' wait for those loads already implies. The model checks the order the engine asks
for; it does not run anything on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec, shift_keys_torch
from pcr_sglang.transfer.streams import DEVICE_KV, HOST_KV, OrderingError, OrderingModel, Region

LAYERS, CHUNK, HEADS, DIM, TOKENS, SLOTS = 3, 4, 2, 8, 64, 6
ROPE = RopeSpec(DIM, DIM, True, (1.0, 0.1, 0.01, 0.001))
MODES = ["off", "load", "offload", "both"]


def device(slots, layer: int) -> Region:
    return Region(DEVICE_KV, layer, torch.as_tensor(slots, dtype=torch.int64))


def host_slot(slot: int, layer: int) -> Region:
    return Region(HOST_KV, layer, torch.tensor([slot]))


@dataclass
class Rig:
    """An engine on the ordering model, with SGLang's two streams: the scheduler's (the
    model's default stream) and the overlap scheduler's forward stream (the same one
    without overlap)."""

    model: OrderingModel
    engine: TransferEngine
    kv: list
    host: torch.Tensor  # [slot, layer, k/v, token, row bytes]
    forward_stream: object

    @property
    def schedule(self):
        return self.model.default

    def host_rows(self, slot: int, layer: int, kv: int) -> torch.Tensor:
        return self.host[slot, layer, kv].view(torch.float32).view(CHUNK, HEADS, DIM)

    def forward(self, reads=(), writes=(), owners=(), hooks: bool = True, value: float = 1.0) -> None:
        """One model forward as SGLang runs it: on the forward stream, after what the
        schedule stream issued before the launch; per layer, the new tokens' KV written
        (``set_kv_buffer``, then the offload hook), then the attention reading the
        request's tokens (the load hook first), each hook only where ``WorkerSide``
        installs it for the engine's mode. ``hooks=False``: a graph replay (no Python
        runs per layer)."""
        model, engine, stream = self.model, self.engine, self.forward_stream
        reads, writes = torch.tensor(list(reads), dtype=torch.int64), torch.tensor(list(writes), dtype=torch.int64)
        with model.use(stream):
            if stream is not self.schedule:  # SGLang: forward_stream.wait_stream(schedule_stream)
                model.wait_stream(stream, self.schedule)
            engine.begin_batch(owners)
            engine.note_forward_stream()
            for layer in range(LAYERS):
                if writes.numel():
                    self.kv[layer][0][writes] = value + layer
                    self.kv[layer][1][writes] = -(value + layer)
                    model.accesses(stream, [], [device(writes, layer)], "the forward's KV write")
                if hooks and engine.mode.offloads:  # the hooks WorkerSide installs for the mode
                    engine.on_layer_written(layer)
                if hooks and engine.mode.loads:
                    engine.wait_until(layer)
                if reads.numel() or writes.numel():
                    model.accesses(stream, [device(torch.cat([reads, writes]), layer)], [], "the forward's attention")
            engine.end_batch()


def make_rig(mode: str = "both", overlap: bool = True, seed: int = 0) -> Rig:
    gen = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(TOKENS, HEADS, DIM, generator=gen), torch.randn(TOKENS, HEADS, DIM, generator=gen))
        for _ in range(LAYERS)
    ]
    layout = HostChunkLayout(SLOTS, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.randn(layout.total_bytes // 4, generator=gen).view(torch.uint8)
    model = OrderingModel()
    engine = TransferEngine(kv, host, layout, LayerwiseMode(mode), streams=model)
    forward_stream = model.new_stream("forward") if overlap else model.default
    return Rig(model, engine, kv, host.view(layout.shape), forward_stream)


# ---------------------------------------------------------------- the model itself
def test_the_model_reports_unordered_conflicting_accesses_and_accepts_ordered_ones():
    """The checker can tell: a write on one stream and a read of the same slot on another
    conflict unless a wait orders them; reads do not conflict with reads."""
    model = OrderingModel()
    a, b = model.new_stream("a"), model.new_stream("b")
    model.accesses(a, [], [device([1, 2], 0)], "write")
    model.accesses(b, [device([3], 0)], [], "read elsewhere")  # another slot
    model.accesses(b, [device([1], 1)], [], "read of another layer")
    with pytest.raises(OrderingError, match="reads device-kv layer 0 slot 1"):
        model.accesses(b, [device([1], 0)], [], "read")
    event = model.record_event(a)
    model.wait_event(b, event)
    model.accesses(b, [device([1, 2], 0)], [], "read")
    model.accesses(a, [device([1], 0)], [], "read")  # two reads: no conflict
    with pytest.raises(OrderingError, match="writes device-kv layer 0 slot 2"):
        model.accesses(a, [], [device([2], 0)], "write")  # b's read is not ordered before it
    model.wait_stream(a, b)
    model.accesses(a, [], [device([2], 0)], "write")


def test_an_event_completes_only_when_the_device_ran_it_and_then_orders_the_host():
    model = OrderingModel()
    side = model.new_stream("side")
    model.accesses(side, [], [host_slot(0, 0)], "copy")
    event = model.record_event(side)
    assert not event.query()
    with pytest.raises(OrderingError):
        model.host_accesses(reads=[host_slot(0, 0)])
    model.finish(event)
    assert event.query()
    model.host_accesses(reads=[host_slot(0, 0)])  # the host saw the event complete


# ---------------------------------------------------------------- loads
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_the_forward_reads_a_loaded_layer_after_its_load(mode, overlap):
    """Layer-wise: at each layer the forward waits for that layer's event (``wait_until``);
    otherwise the compute streams wait for the whole load at submission."""
    rig = make_rig(mode, overlap)
    slots = [9, 3, 40, 41, 17, 5, 6, 63]
    rig.engine.load(torch.tensor(slots), [4, 1])
    rig.forward(reads=slots, writes=[20, 21])
    for layer in range(LAYERS):
        for kv in (0, 1):
            expected = torch.cat([rig.host_rows(4, layer, kv), rig.host_rows(1, layer, kv)])
            assert torch.equal(rig.kv[layer][kv][torch.tensor(slots)], expected)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_a_load_into_slots_the_last_forward_read_waits_for_that_forward(mode, overlap):
    """The slots were read by a forward still running on the forward stream, then freed
    and taken for a load: the side stream waits for the compute streams (the forward
    stream too) before it writes them."""
    rig = make_rig(mode, overlap)
    rig.forward(reads=[1, 2, 3], writes=[4])
    rig.engine.fence_before_reuse()  # the request finished: its slots are freed
    rig.engine.load(torch.tensor([1, 2, 3, 4]), [0])
    rig.forward(reads=[1, 2, 3, 4], writes=[30])


@pytest.mark.parametrize("replaced", [False, True], ids=["load", "load-and-replacement"])
def test_a_second_forward_waits_on_no_event_the_first_already_waited_for(replaced):
    """``wait_until`` clears a layer's load and re-placement events once the forward
    waited on them: a decode right after waits for nothing (no GPU wait on finished work)."""
    rig = make_rig("load")
    rig.engine.load(torch.tensor([1, 2, 3, 4]), [0])
    if replaced:
        rig.engine.replace(torch.tensor([1, 2, 3, 4]), torch.tensor([7, 8, 9, 10]), torch.tensor([1, 1, 1, 1]), ROPE)
    rig.forward(reads=[1, 2, 3, 4, 7, 8, 9, 10] if replaced else [1, 2, 3, 4], writes=[5])
    waits = rig.model.count("wait_event", rig.forward_stream)
    assert waits == LAYERS * (2 if replaced else 1)  # one per layer and kind
    rig.forward(reads=[1, 2, 3, 4, 5], writes=[6])  # a decode step
    assert rig.model.count("wait_event", rig.forward_stream) == waits


def test_layers_the_scheduler_waited_for_are_ordered_for_the_forward_by_its_launch():
    """blend's probe waits for the layers it reads (0-1 here; up to 0-4 for prophet) on the
    schedule stream (clearing their events); the forward then runs on the forward stream,
    which SGLang orders after the schedule stream at launch: the forward's reads of those
    layers are still ordered."""
    rig = make_rig("load")
    rig.engine.load(torch.tensor([1, 2, 3, 4]), [0])
    rig.engine.wait_until(0)
    rig.engine.wait_until(1)
    rig.model.accesses(rig.schedule, [device([1, 2, 3, 4], 0), device([1, 2, 3, 4], 1)], [], "the probe")
    rig.forward(reads=[1, 2, 3, 4], writes=[5])


# ---------------------------------------------------------------- offloads
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_an_offload_reads_each_layer_after_the_forward_wrote_it(mode, overlap):
    """Layer-wise: layer i's offload waits for the stream that just wrote layer i;
    otherwise ``end_batch`` issues it after waiting for the compute streams. The host
    slot is ready for the I/O process only once the device ran the copy."""
    rig = make_rig(mode, overlap)
    slots = [7, 8, 9, 30]
    rig.engine.plan_offload("r1", torch.tensor(slots), 2)
    rig.forward(reads=[1], writes=slots, owners=["r1"], value=5.0)
    for layer in range(LAYERS):
        assert torch.all(rig.host_rows(2, layer, 0) == 5.0 + layer)
    assert not rig.engine.host_slot_ready(2)  # nothing completes until the device ran it
    rig.model.finish()
    assert rig.engine.host_slot_ready(2)
    rig.model.host_accesses(reads=[host_slot(2, layer) for layer in range(LAYERS)], what="the I/O process")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_end_batch_offloads_layers_a_graph_replay_wrote_after_the_forward(overlap):
    """No per-layer hook ran (a graph replay): ``end_batch`` issues the offload's layers,
    after waiting for the compute streams."""
    rig = make_rig("offload", overlap)
    rig.engine.plan_offload("r", torch.tensor([1, 2, 3, 4]), 0)
    rig.forward(writes=[1, 2, 3, 4], owners=["r"], hooks=False, value=6.0)
    assert all(torch.all(rig.host_rows(0, layer, 0) == 6.0 + layer) for layer in range(LAYERS))


@pytest.mark.parametrize("mode", MODES)
def test_an_offloads_slots_are_rewritten_only_after_it_read_them(mode):
    """The request finished, its slots are freed (``fence_before_reuse``) and the next
    forward writes them: the compute streams wait for the side stream's copies."""
    rig = make_rig(mode)
    rig.engine.plan_offload("r1", torch.tensor([7, 8, 9, 30]), 2)
    rig.forward(writes=[7, 8, 9, 30], owners=["r1"])
    rig.engine.fence_before_reuse()
    rig.forward(writes=[7, 8, 9, 30], value=9.0)  # another request's new KV in the same slots
    assert torch.all(rig.host_rows(2, 0, 0) == 1.0)  # the offload kept what it read


# ---------------------------------------------------------------- demotions
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_a_demotion_reads_what_the_forward_wrote_and_its_slots_may_be_reused_at_once(mode, overlap):
    """``copy_to_host`` waits for the compute streams (a forward just wrote the chunk),
    and the compute streams wait for it (the slots may be reused right after the call)."""
    rig = make_rig(mode, overlap)
    rig.forward(writes=[1, 2, 3, 4], value=3.0)
    rig.engine.copy_to_host(torch.tensor([1, 2, 3, 4]), [5])
    rig.forward(writes=[1, 2, 3, 4], value=8.0)  # reused at once
    assert all(torch.all(rig.host_rows(5, layer, 0) == 3.0 + layer) for layer in range(LAYERS))


# ---------------------------------------------------------------- fence_before_reuse
@pytest.mark.parametrize("mode", MODES)
def test_a_load_no_forward_read_is_finished_before_its_slots_are_rewritten(mode):
    """The request was aborted before its forward: its slots are freed and another
    forward writes them; the load still in flight must not land after that write."""
    rig = make_rig(mode)
    rig.engine.load(torch.tensor([10, 11, 12, 13]), [3])
    rig.engine.fence_before_reuse()
    rig.forward(writes=[10, 11, 12, 13], value=4.0)
    assert torch.all(rig.kv[LAYERS - 1][0][torch.tensor([10, 11, 12, 13])] == 4.0 + LAYERS - 1)


@pytest.mark.parametrize("mode", MODES)
def test_a_replacement_no_forward_read_is_finished_before_its_slots_are_rewritten(mode):
    """A re-placement in flight on its own stream, the request aborted: the freed target
    slots are written by the next forward only after the re-placement."""
    rig = make_rig(mode)
    src, dst = torch.tensor([1, 2]), torch.tensor([30, 31])
    rig.engine.replace(src, dst, torch.tensor([3, 3]), ROPE)
    rig.engine.fence_before_reuse()
    rig.forward(writes=[30, 31], value=2.0)


# ---------------------------------------------------------------- re-placements
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_a_replacement_reads_a_loaded_chain_after_the_load_and_the_forward_reads_it_after(mode, overlap):
    """Document reuse on a host hit: each layer of the re-placement waits for that layer of
    the load (layer-wise) or the whole load, and the forward for the re-placement."""
    rig = make_rig(mode, overlap)
    chain, private = torch.tensor([9, 3, 40, 41]), torch.tensor([50, 51, 52, 53])
    delta = torch.tensor([7, 7, 7, 7])
    rig.engine.load(chain, [2])
    rig.engine.replace(chain, private, delta, ROPE)
    rig.forward(reads=private.tolist(), writes=[60])
    for layer in range(LAYERS):
        k = shift_keys_torch(rig.host_rows(2, layer, 0), delta, ROPE)
        assert torch.allclose(rig.kv[layer][0][private], k)
        assert torch.equal(rig.kv[layer][1][private], rig.host_rows(2, layer, 1))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_a_replacement_of_kv_a_forward_just_wrote_waits_for_that_forward(mode, overlap):
    """A document's canonical chain was prefilled by the forward still running (its
    chunks stashed into the tree): re-placing it waits for the compute streams."""
    rig = make_rig(mode, overlap)
    rig.forward(writes=[1, 2, 3, 4], value=7.0)
    rig.engine.replace(
        torch.tensor([1, 2, 3, 4]), torch.tensor([20, 21, 22, 23]), torch.zeros(4, dtype=torch.int64), ROPE
    )
    rig.forward(reads=[20, 21, 22, 23], writes=[24])
    assert all(torch.all(rig.kv[layer][1][torch.tensor([20, 21, 22, 23])] == -(7.0 + layer)) for layer in range(LAYERS))


def test_blends_two_replacements_of_one_request_are_ordered_against_its_probe():
    """blend: layers 0-1 of every candidate re-placed, the probe (on the schedule stream,
    after ``wait_until(0)``, ``wait_until(1)``) reads them and writes layer 1 of the
    candidates, then layers 2+ of the kept tokens are re-placed; the forward reads all."""
    rig = make_rig("load")
    chain, private = torch.tensor([9, 3, 40, 41]), torch.tensor([50, 51, 52, 53])
    rig.engine.load(chain, [2])
    rig.engine.replace(chain, private, torch.tensor([4, 4, 4, 4]), ROPE, layers=range(2))
    rig.engine.wait_until(0)
    rig.engine.wait_until(1)
    rig.model.accesses(rig.schedule, [device(private, 0), device(private, 1)], [device(private, 1)], "the probe")
    kept = private[:3]
    rig.engine.replace(chain[:3], kept, torch.tensor([4, 4, 4]), ROPE, layers=range(2, LAYERS))
    rig.forward(reads=private.tolist(), writes=[60])


# ---------------------------------------------------------------- fence_after_forward
def test_fence_after_forward_orders_a_copy_on_the_schedule_stream_after_the_forward():
    """Document reuse without the engine's re-placement (a copy on the scheduler's own
    stream) reads slots the forward still running on the forward stream wrote."""
    rig = make_rig("both")
    rig.forward(writes=[1, 2, 3, 4])
    rig.engine.fence_after_forward()
    rig.model.accesses(
        rig.schedule,
        [device([1, 2, 3, 4], layer) for layer in range(LAYERS)],
        [device([40, 41, 42, 43], layer) for layer in range(LAYERS)],
        "a copy on the schedule stream",
    )


# ---------------------------------------------------------------- everything at once
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_batches_of_loads_offloads_replacements_and_frees_stay_ordered(mode, overlap):
    """Three steps as a scheduler runs them: admissions (loads, a re-placement), a forward
    with offloads of its requests' chunks, frees and a demotion, the next admissions into
    the freed slots; every byte ends where the inline algorithm would put it."""
    rig = make_rig(mode, overlap)
    engine = rig.engine
    engine.load(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), [0, 1])
    engine.replace(torch.tensor([0, 1, 2, 3]), torch.tensor([32, 33, 34, 35]), torch.tensor([2, 2, 2, 2]), ROPE)
    engine.plan_offload("a", torch.tensor([36, 37, 38, 39]), 2)
    rig.forward(reads=[0, 1, 2, 3, 4, 5, 6, 7, 32, 33, 34, 35], writes=[36, 37, 38, 39], owners=["a"], value=1.0)
    engine.copy_to_host(torch.tensor([36, 37, 38, 39]), [3])  # evicted to host at once
    engine.fence_before_reuse()  # request a finished: its slots are freed
    engine.load(torch.tensor([36, 37, 38, 39]), [1])  # the next request's prefix into the freed slots
    engine.replace(torch.tensor([36, 37, 38, 39]), torch.tensor([0, 1, 2, 3]), torch.tensor([1, 1, 1, 1]), ROPE)
    engine.plan_offload("b", torch.tensor([44, 45, 46, 47]), 4)
    rig.forward(reads=[0, 1, 2, 3, 36, 37, 38, 39], writes=[44, 45, 46, 47], owners=["b"], value=2.0)
    engine.fence_before_reuse()
    rig.forward(writes=[36, 37, 38, 39, 44, 45, 46, 47], value=3.0)
    for layer in range(LAYERS):
        assert torch.all(rig.host_rows(2, layer, 0) == 1.0 + layer)
        assert torch.all(rig.host_rows(3, layer, 0) == 1.0 + layer)
        assert torch.all(rig.host_rows(4, layer, 0) == 2.0 + layer)
        expected = shift_keys_torch(rig.host_rows(1, layer, 0), torch.tensor([1, 1, 1, 1]), ROPE)
        assert torch.allclose(rig.kv[layer][0][torch.tensor([0, 1, 2, 3])], expected)
    rig.model.finish()
    assert all(engine.host_slot_ready(slot) for slot in range(SLOTS))
