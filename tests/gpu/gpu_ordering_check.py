"""GPU check of the transfer engine's CUDA branch against the CPU ordering model.

The unit tests (``tests/unit/transfer/test_transfer_ordering.py``) run the engine's stream algorithm
on :class:`~pcr_sglang.transfer.streams.OrderingModel`, which proves that the waits the
engine issues order every copy against the forward under CUDA's stream semantics as the
model states them. This script runs the same kind of scenarios on a real GPU:
:class:`~pcr_sglang.transfer.streams.CudaStreams`, the Triton copy and rotation kernels,
the host chunks in the server's pool (POSIX shared memory registered with
``cudaHostRegister``), and a forward played on a stream of its own (the overlap
scheduler's), launched after the schedule stream's work. At each layer the forward's
stream snapshots the KV it attends to; after the run, every snapshot, every offloaded host
row and every re-placed row must equal what the same scenario leaves on the ordering
model (where copies run inline and the model raises if any access is unordered).

A missing wait must show as wrong data, so every copy and re-placement is made slow on
purpose: each time the engine enters one of its own streams, a spin kernel
(``torch.cuda._sleep``) of ``--sleep-ms`` runs there first. With the engine's waits the
forward still reads the right bytes; the negative control runs the same scenarios with
every ``wait_event`` / ``wait_stream`` dropped and counts the reads that then go wrong
(it must find some, or the check could not tell).

Without a GPU it runs a reduced form and says so: the scenarios on the ordering model
against the engine's inline CPU algorithm (no streams), so the script does not rot.

Usage: python tests/gpu/gpu_ordering_check.py [--layers 4] [--tokens 4096] [--sleep-ms 2]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec
from pcr_sglang.transfer.streams import DEVICE_KV, CudaStreams, OrderingModel, Region

logger = logging.getLogger(__name__)

HEADS, DIM = 4, 32
MODES = ("off", "load", "offload", "both")


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int  # device pool slots
    chunk: int  # tokens per host chunk
    host_slots: int

    @property
    def rope(self) -> RopeSpec:
        return RopeSpec(DIM, DIM, True, tuple(10000.0 ** (-2 * i / DIM) for i in range(DIM // 2)))


class SlowCudaStreams(CudaStreams):
    """CUDA's streams, with a spin kernel at the start of every use of an engine stream
    (so its copies finish long after the forward could read), and optionally without any
    wait (the negative control)."""

    def __init__(self, device: torch.device, sleep_cycles: int, drop_waits: bool = False):
        super().__init__(device)
        self.sleep_cycles = sleep_cycles
        self.drop_waits = drop_waits
        self._engine_streams: list[torch.cuda.Stream] = []

    def new_stream(self, name: str) -> torch.cuda.Stream:
        stream = super().new_stream(name)
        self._engine_streams.append(stream)
        return stream

    @contextlib.contextmanager
    def use(self, stream: torch.cuda.Stream) -> Iterator[None]:
        with super().use(stream):
            if any(stream == own for own in self._engine_streams):
                torch.cuda._sleep(self.sleep_cycles)
            yield

    def launch_wait(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        """SGLang's own wait at a forward's launch (not the engine's): never dropped."""
        super().wait_stream(stream, other)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        if not self.drop_waits:
            super().wait_event(stream, event)

    def wait_stream(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        if not self.drop_waits:
            super().wait_stream(stream, other)


@dataclass
class Run:
    """One scenario on one kind of streams: what the forward read at each layer, in order."""

    streams: Any
    engine: TransferEngine
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    host: torch.Tensor  # flat bytes
    layout: HostChunkLayout
    schedule: Any
    forward_stream: Any
    shape: Shape
    reads: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def slots(self, values) -> torch.Tensor:
        return torch.as_tensor(list(values), dtype=torch.int64).to(self.kv[0][0].device)

    def forward(self, label: str, reads=(), writes=(), owners=(), value: float = 1.0) -> None:
        """A model forward as SGLang runs it: on the forward stream, after the schedule
        stream's work; per layer the new tokens' KV written, the offload hook, the load
        hook, then the attention's read of the request's tokens (snapshotted)."""
        engine, streams, stream = self.engine, self.streams, self.forward_stream
        read_slots = self.slots(list(reads) + list(writes))
        write_slots = self.slots(writes)
        record = getattr(streams, "records_accesses", False)  # the model's bookkeeping (CPU tensors)
        with streams.use(stream):
            if stream != self.schedule:  # SGLang: forward_stream.wait_stream(schedule_stream)
                getattr(streams, "launch_wait", streams.wait_stream)(stream, self.schedule)
            engine.begin_batch(owners)
            engine.note_forward_stream()
            for layer in range(self.shape.layers):
                if write_slots.numel():
                    self.kv[layer][0][write_slots] = value + layer
                    self.kv[layer][1][write_slots] = -(value + layer)
                    if record:
                        streams.accesses(stream, [], [Region(DEVICE_KV, layer, write_slots)], "forward write")
                if engine.mode.offloads:
                    engine.on_layer_written(layer)
                if engine.mode.loads:
                    engine.wait_until(layer)
                if read_slots.numel():
                    if record:
                        streams.accesses(stream, [Region(DEVICE_KV, layer, read_slots)], [], "forward read")
                    for kv in (0, 1):
                        self.reads.append((f"{label} layer {layer} {'KV'[kv]}", self.kv[layer][kv][read_slots].clone()))
            engine.end_batch()

    def outcome(self) -> list[tuple[str, torch.Tensor]]:
        """Everything the scenario's data depends on, on the CPU: the forward's reads, the
        host pool, the device pool."""
        if self.kv[0][0].is_cuda:
            torch.cuda.synchronize()
        out = [(name, t.cpu()) for name, t in self.reads]
        out.append(("host pool", self.host.clone().view(torch.float32)))
        for layer, (k, v) in enumerate(self.kv):
            out += [(f"device pool layer {layer} K", k.cpu()), (f"device pool layer {layer} V", v.cpu())]
        return out


def _initial(shape: Shape, seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, HostChunkLayout]:
    gen = torch.Generator().manual_seed(seed)
    kv = [
        (torch.randn(shape.tokens, HEADS, DIM, generator=gen), torch.randn(shape.tokens, HEADS, DIM, generator=gen))
        for _ in range(shape.layers)
    ]
    layout = HostChunkLayout(shape.host_slots, shape.layers, shape.chunk, HEADS * DIM * 4)
    host = torch.randn(layout.total_bytes // 4, generator=gen).view(torch.uint8)
    return kv, host, layout


# --------------------------------------------------------------------- scenarios
def scenario_loads(run: Run, s: Shape) -> None:
    """Loads read by the next forward (layer-wise: each layer after its own load)."""
    n = 2 * s.chunk
    run.engine.load(run.slots(range(0, n)), [3, 1])
    run.forward("load", reads=range(0, n), writes=range(n, n + 4))


def scenario_load_into_freed_slots(run: Run, s: Shape) -> None:
    """A load into slots the previous forward read: written only after that forward."""
    n = s.chunk
    run.forward("first", reads=range(0, n), writes=range(n, n + 2))
    run.engine.fence_before_reuse()
    run.engine.load(run.slots(range(0, n)), [0])
    run.forward("second", reads=range(0, n), writes=range(n + 2, n + 4))


def scenario_offload_then_reuse(run: Run, s: Shape) -> None:
    """Offloads read each layer after the forward wrote it; the freed slots are rewritten
    only after the offload read them."""
    n = 2 * s.chunk
    run.engine.plan_offload("a", run.slots(range(0, s.chunk)), 2)
    run.engine.plan_offload("b", run.slots(range(s.chunk, n)), 4)
    run.forward("offload", reads=range(n, n + 8), writes=range(0, n), owners=["a", "b"], value=5.0)
    run.engine.fence_before_reuse()
    run.forward("reuse", writes=range(0, n), value=9.0)


def scenario_demotion(run: Run, s: Shape) -> None:
    """A demotion reads what the forward just wrote; its slots are reused at once."""
    run.forward("write", writes=range(0, s.chunk), value=3.0)
    run.engine.copy_to_host(run.slots(range(0, s.chunk)), [5])
    run.forward("reuse", writes=range(0, s.chunk), value=8.0)


def scenario_replacement(run: Run, s: Shape) -> None:
    """Document reuse on a host hit: load, re-place with a position delta, forward."""
    n = 2 * s.chunk
    chain, private = run.slots(range(0, n)), run.slots(range(n, 2 * n))
    run.engine.load(chain, [2, 6])
    run.engine.replace(chain, private, torch.full((n,), 7, dtype=torch.int64, device=chain.device), s.rope)
    run.forward("replaced", reads=range(n, 2 * n), writes=range(2 * n, 2 * n + 4))


def scenario_replacement_of_fresh_kv(run: Run, s: Shape) -> None:
    """Re-placing KV the forward still running just wrote."""
    n = s.chunk
    run.forward("prefill", writes=range(0, n), value=7.0)
    run.engine.replace(
        run.slots(range(0, n)),
        run.slots(range(n, 2 * n)),
        torch.zeros(n, dtype=torch.int64, device=run.kv[0][0].device),
        s.rope,
    )
    run.forward("replaced", reads=range(n, 2 * n), writes=range(2 * n, 2 * n + 2))


def scenario_steps(run: Run, s: Shape) -> None:
    """Three scheduler steps mixing loads, a re-placement, offloads, a demotion and frees."""
    c, e = s.chunk, run.engine
    dev = run.kv[0][0].device
    e.load(run.slots(range(0, 2 * c)), [0, 1])
    e.replace(
        run.slots(range(0, c)),
        run.slots(range(4 * c, 5 * c)),
        torch.full((c,), 2, dtype=torch.int64, device=dev),
        s.rope,
    )
    e.plan_offload("a", run.slots(range(5 * c, 6 * c)), 2)
    run.forward("step 1", reads=[*range(0, 2 * c), *range(4 * c, 5 * c)], writes=range(5 * c, 6 * c), owners=["a"])
    e.copy_to_host(run.slots(range(5 * c, 6 * c)), [3])
    e.fence_before_reuse()
    e.load(run.slots(range(5 * c, 6 * c)), [1])
    e.replace(
        run.slots(range(5 * c, 6 * c)), run.slots(range(0, c)), torch.ones(c, dtype=torch.int64, device=dev), s.rope
    )
    e.plan_offload("b", run.slots(range(6 * c, 7 * c)), 4)
    run.forward(
        "step 2", reads=[*range(0, c), *range(5 * c, 6 * c)], writes=range(6 * c, 7 * c), owners=["b"], value=2.0
    )
    e.fence_before_reuse()
    run.forward("step 3", writes=range(5 * c, 7 * c), value=3.0)


SCENARIOS: dict[str, Callable[[Run, Shape], None]] = {
    "loads": scenario_loads,
    "load into freed slots": scenario_load_into_freed_slots,
    "offload then reuse": scenario_offload_then_reuse,
    "demotion": scenario_demotion,
    "re-placement after a load": scenario_replacement,
    "re-placement of fresh KV": scenario_replacement_of_fresh_kv,
    "three steps": scenario_steps,
}


# --------------------------------------------------------------------- runs
def run_on_model(name: str, mode: str, shape: Shape, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The scenario on the ordering model (CPU): raises OrderingError on an unordered access."""
    kv, host, layout = _initial(shape, seed)
    model = OrderingModel()
    engine = TransferEngine(kv, host, layout, LayerwiseMode(mode), streams=model)
    run = Run(model, engine, kv, host, layout, model.default, model.new_stream("forward"), shape)
    SCENARIOS[name](run, shape)
    model.finish()
    return run.outcome()


def run_inline(name: str, mode: str, shape: Shape, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The scenario on the engine's CPU algorithm (no streams): the reduced form."""
    kv, host, layout = _initial(shape, seed)
    engine = TransferEngine(kv, host, layout, LayerwiseMode(mode))
    run = Run(_NoStreams(), engine, kv, host, layout, None, None, shape)
    SCENARIOS[name](run, shape)
    return run.outcome()


class _NoStreams:
    """The forward's side of a CPU run: the current thread, no streams."""

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def run_on_gpu(
    name: str, mode: str, shape: Shape, seed: int, sleep_cycles: int, drop_waits: bool
) -> list[tuple[str, torch.Tensor]]:
    from pcr_sglang.tiers.host_pool import HostChunkPool

    device = torch.device("cuda")
    kv_cpu, host_cpu, layout = _initial(shape, seed)
    kv = [(k.to(device), v.to(device)) for k, v in kv_cpu]
    with HostChunkPool(layout) as pool:  # the server's host tier: shm + cudaHostRegister
        if not pool.pinned:
            raise RuntimeError("the host pool is not registered with CUDA")
        pool.buffer.copy_(host_cpu)
        streams = SlowCudaStreams(device, sleep_cycles, drop_waits)
        engine = TransferEngine(kv, pool.buffer, layout, LayerwiseMode(mode), streams=streams)
        schedule = torch.cuda.current_stream(device)
        torch.cuda.synchronize()
        run = Run(streams, engine, kv, pool.buffer, layout, schedule, torch.cuda.Stream(device), shape)
        SCENARIOS[name](run, shape)
        outcome = run.outcome()  # synchronizes before the pool goes
    return outcome


def compare(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the values that differ (RoPE rows to float32 rounding, the rest exactly)."""
    if len(got) != len(want):
        return [f"{len(got)} values against {len(want)}"]
    wrong = []
    for (name, a), (_, b) in zip(got, want):
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
            wrong.append(name)
    return wrong


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096, help="device pool slots")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per host chunk")
    parser.add_argument("--sleep-ms", type=float, default=2.0, help="spin before each copy on an engine stream (GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="the reduced CPU form even where a GPU is present")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    shape = Shape(args.layers, args.tokens, args.chunk, host_slots=8)
    if 8 * shape.chunk > shape.tokens:
        parser.error(f"--tokens must be at least 8 x --chunk ({8 * shape.chunk})")
    if not gpu:
        print(
            "No GPU: the reduced form (the scenarios on the ordering model against the engine's inline CPU "
            "algorithm), so the script does not rot. The CUDA branch is not run."
        )
        shape = Shape(min(args.layers, 3), 8 * 8, 8, host_slots=8)
    else:
        # torch.cuda._sleep counts cycles; measure how many make a millisecond here.
        probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        probe[0].record()
        torch.cuda._sleep(1_000_000)
        probe[1].record()
        torch.cuda.synchronize()
        sleep_cycles = int(args.sleep_ms * 1_000_000 / max(probe[0].elapsed_time(probe[1]), 1e-3))
        print(f"GPU: {torch.cuda.get_device_name()}; each engine-stream copy starts after a {args.sleep_ms} ms spin")
    start = time.perf_counter()
    failures, control_wrong, control_total = 0, 0, 0
    for name in SCENARIOS:
        for mode in MODES:
            want = run_on_model(name, mode, shape, args.seed)  # OrderingError here: the model refuses the order
            if gpu:
                wrong = compare(run_on_gpu(name, mode, shape, args.seed, sleep_cycles, drop_waits=False), want)
                dropped = compare(run_on_gpu(name, mode, shape, args.seed, sleep_cycles, drop_waits=True), want)
                control_total += 1
                control_wrong += bool(dropped)
                note = f"; without waits {len(dropped)} wrong" if dropped else "; without waits still right"
            else:
                wrong = compare(run_inline(name, mode, shape, args.seed), want)
                note = ""
            failures += bool(wrong)
            status = "ok" if not wrong else f"WRONG: {', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}"
            print(f"  {name:28s} {mode:8s} {status}{note}")
    print(f"{len(SCENARIOS) * len(MODES)} runs, {failures} with wrong data, in {time.perf_counter() - start:.1f} s")
    if gpu:
        print(f"negative control (every wait dropped): {control_wrong} of {control_total} runs read wrong data")
        if control_wrong == 0:
            print("the control found nothing: the check cannot tell a missing wait at this --sleep-ms")
            return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
