"""GPU check of what a serving step asks of the scheduler thread, and of document reuse's scratch.

The unit tests check these on CPU by what the code calls (a recording stand-in for
``torch.cuda``: ``tests/unit/transfer/test_cuda_branch_recorded.py``,
``tests/unit/reuse/test_rows_no_sync.py``, ``tests/unit/reuse/test_scratch_budget.py``).
Here the same code runs on a GPU, measured by CUDA itself:

* ``step``: a transfer engine on CUDA (its own streams, a pinned host pool, the Triton
  kernels compiled by the startup warm-up) runs steps with 4 host-hit loads, 16 documents
  re-placed and 2 offloads written layer by layer, then the permuted-rows step (positions
  and the Triton position mask, SGLang's ``*_cpu`` companions unset). Under
  ``torch.cuda.set_sync_debug_mode("error")`` any synchronizing call raises; uploads from
  memory that is not pinned are counted; the caching allocator's allocation counter must
  not move while the layer hooks past layer 0 run; the Triton kernel caches must not grow
  (nothing compiled after the warm-up).
* ``probe``: blend's probe on a stand-in decoder of a 1B-class shape (bf16), for a few
  sizes and selectors: the peak memory one selection allocates, against
  ``BlendProbe.scratch_estimate`` (what ``--pcr-blend-probe-mb`` is held to). It must not
  exceed it.
* ``mask``: the Triton position mask of a batch (one permuted request, three plain ones):
  its peak against ``position_mask_bytes`` (what ``--pcr-position-mask-mb`` bounds per
  request).

Prints one table (check, figure, limit, verdict) and exits 1 if a check failed. Without a
GPU it runs the same code on CPU and says so: nothing is measured there.

Usage: python tests/gpu/gpu_step_check.py [--layers 8] [--probe-sizes 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from pcr_sglang.reuse import rows as permuted_rows
from pcr_sglang.reuse.forward_plan import ForwardPlans
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec
from pcr_sglang.transfer.warmup import warm_up_on_cuda

HEADS, DIM, CHUNK, DOCS = 4, 128, 64, 16


@dataclass
class Row:
    check: str
    figure: str
    limit: str
    ok: Optional[bool]  # None: not measured (CPU)

    @property
    def verdict(self) -> str:
        return "n/a (CPU)" if self.ok is None else ("PASS" if self.ok else "FAIL")


class _Batch(SimpleNamespace):
    """A stand-in for SGLang's ``ScheduleBatch`` (weakly referenceable, as it is)."""


class PageableUploads(TorchFunctionMode):
    """Counts host-to-device copies whose source is not pinned (pageable: PyTorch makes
    them synchronous whatever ``non_blocking`` says), and tensors made on the device
    straight from host values (``torch.tensor(..., device=cuda)``, pageable too)."""

    def __init__(self) -> None:
        super().__init__()
        self.pageable: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            if dst.device.type == "cuda" and src.device.type == "cpu" and not src.is_pinned():
                self.pageable.append("copy_")
        elif name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if (name == "cuda" or str(target).startswith("cuda")) and not args[0].is_pinned():
                self.pageable.append(name)
        elif name in ("tensor", "as_tensor") and str(kwargs.get("device", "")).startswith("cuda"):
            self.pageable.append(name)
        return func(*args, **kwargs)


def _compiled_kernels() -> Optional[int]:
    """How many specializations of the copy and rotation kernels Triton holds (None if this
    Triton does not say)."""
    from pcr_sglang.transfer import copy_kv, rope_shift

    try:
        return sum(
            len(caches[0])
            for kernel in (copy_kv._KERNEL, rope_shift._KERNEL)
            for caches in kernel.device_caches.values()
        )
    except (AttributeError, TypeError, IndexError):
        return None


def _allocations(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0)) if device.type == "cuda" else 0


@contextlib.contextmanager
def _sync_errors(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_step(device: torch.device, layers: int, steps: int) -> list[Row]:
    cuda = device.type == "cuda"
    tokens, host_slots = 8192, 64
    rope = RopeSpec(DIM, DIM, True, tuple(10000.0 ** (-2 * i / DIM) for i in range(DIM // 2)))
    kv = [
        (
            torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16, device=device),
            torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16, device=device),
        )
        for _ in range(layers)
    ]
    layout = HostChunkLayout(host_slots, layers, CHUNK, HEADS * DIM * 2)
    host = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    if cuda:
        host = host.pin_memory()
    engine = TransferEngine(kv, host, layout, LayerwiseMode.BOTH)
    warm_up_on_cuda(engine=engine, kv_layers=kv, rope=rope)  # synchronizes, before the checked steps
    compiled = _compiled_kernels()
    pageable = PageableUploads()
    per_layer = 0

    def step(i: int) -> None:
        nonlocal per_layer
        base = 256 + (i % 4) * 1024
        for j in range(4):  # host hits
            engine.load(torch.arange(base + j * CHUNK, base + (j + 1) * CHUNK, device=device), [j])
        for doc in range(DOCS):  # re-placed documents
            src = torch.arange(4096 + doc * 32, 4096 + doc * 32 + 32, device=device)
            engine.replace(src, src + 2048, torch.full((32,), 5, dtype=torch.int64, device=device), rope)
        for j in range(2):
            start = base + 512 + j * CHUNK
            engine.plan_offload("r", torch.arange(start, start + CHUNK, device=device), 8 + (2 * i + j) % 32)
        engine.note_forward_stream()
        engine.begin_batch(["r"])
        after_first = 0
        for layer in range(layers):
            engine.wait_until(layer)
            engine.on_layer_written(layer)
            if layer == 0:
                after_first = _allocations(device)
        per_layer += _allocations(device) - after_first
        engine.end_batch()
        engine.fence_before_reuse()
        for slot in range(host_slots):
            engine.host_slot_ready(slot)

    # The permuted-rows step's inputs, made before the checked steps (making them uploads).
    mode = SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: False)
    forward = SimpleNamespace(
        positions=torch.zeros(3 + 6, dtype=torch.int64, device=device),
        forward_mode=mode,
        extend_prefix_lens=torch.tensor([4, 2], device=device),
        extend_seq_lens=torch.tensor([3, 6], device=device),
        seq_lens=torch.tensor([7, 8], device=device),
        extend_prefix_lens_cpu=None,
        extend_seq_lens_cpu=None,
        seq_lens_cpu=None,
    )
    pool_rows = torch.tensor([7, 3], device=device)
    reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=7)), SimpleNamespace(kv=SimpleNamespace(req_pool_idx=3))]
    batch = _Batch(reqs=reqs, prefix_lens=[4, 2], extend_lens=[3, 6])
    permuted = {1: torch.tensor([0, 1, 5, 4, 3, 2, 6, 7])}
    backend = SimpleNamespace(forward_metadata=SimpleNamespace(custom_mask=None, mask_indptr=None))

    def rows_step() -> None:
        """SGLang's ``*_cpu`` companions unset: the lengths come from the batch's lists."""
        plans = ForwardPlans()
        plans.prepared(batch, permuted)
        plan = plans.bind(forward, batch)
        assert plan is not None
        rows = plan.for_attention(pool_rows)  # checked by a device-side assert
        assert rows is not None
        permuted_rows.set_triton_position_mask(backend, forward, rows, plan, plans)
        if plans.host_waits:
            raise RuntimeError(f"{plans.host_waits} lengths read from the device")

    step(0)  # the first step makes the compute stream's event ring (once)
    rows_step()  # and the permuted rows' pinned ring (once per device)
    if cuda:
        torch.cuda.synchronize()
    error = ""
    start = time.perf_counter()
    try:
        with _sync_errors(cuda), pageable:
            for i in range(1, steps + 1):
                step(i)
                rows_step()
    except RuntimeError as e:  # a synchronizing call under the debug mode
        error = str(e).splitlines()[0][:120]
    seconds = (time.perf_counter() - start) / steps
    # Negative controls: the two detectors see what they are for.
    control = PageableUploads()
    caught = False
    with control:
        torch.ones(4).to(device)
    try:
        with _sync_errors(cuda):
            torch.ones(1, device=device).sum().item()
    except RuntimeError:
        caught = True
    if cuda:
        torch.cuda.synchronize()
    measured = None if not cuda else True
    after = _compiled_kernels()
    return [
        Row("step: synchronizing calls (sync debug mode)", error or "none", "none", None if not cuda else not error),
        Row(
            "step: uploads from pageable memory",
            str(len(pageable.pageable)),
            "0",
            None if not cuda else not pageable.pageable,
        ),
        Row("step: allocations in layer hooks past layer 0", str(per_layer), "0", None if not cuda else per_layer == 0),
        Row(
            "step: kernels compiled after the warm-up",
            "unknown (Triton keeps no cache here)" if compiled is None or after is None else str(after - compiled),
            "0",
            None if not cuda or compiled is None or after is None else after == compiled,
        ),
        Row("control: .item() under the debug mode raises", str(caught), "True", None if not cuda else caught),
        Row(
            "control: a pageable upload is counted",
            str(len(control.pageable)),
            "1",
            None if not cuda else len(control.pageable) == 1,
        ),
        Row("step: host time per step (16 docs, 4 loads, 2 offloads)", f"{seconds * 1e3:.1f} ms", "-", measured),
    ]


def _stand_in_decoder(
    layers: int, hidden: int, heads: int, kv_heads: int, dim: int, inter: int, device: torch.device, dtype: torch.dtype
) -> Any:
    """The modules blend's probe drives (``model.model.embed_tokens`` and ``layers``), in a
    1B-class shape; weights random (memory, not accuracy, is measured)."""

    def linear(n_in: int, n_out: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, None]]:
        layer = torch.nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype)
        return lambda x: (layer(x), None)

    def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = positions[:, None].to(q.dtype)
        return q * angle.cos(), k * angle.sin()

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Linear(hidden, 2 * inter, bias=False, device=device, dtype=dtype)
            self.down_proj = torch.nn.Linear(inter, hidden, bias=False, device=device, dtype=dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(torch.nn.functional.silu(gate) * up)

    def layer() -> Any:
        attn = SimpleNamespace(
            qkv_proj=linear(hidden, (heads + 2 * kv_heads) * dim),
            o_proj=linear(heads * dim, hidden),
            rotary_emb=rope,
            q_size=heads * dim,
            kv_size=kv_heads * dim,
            head_dim=dim,
            scaling=dim**-0.5,
        )
        return SimpleNamespace(
            self_attn=attn,
            input_layernorm=torch.nn.LayerNorm(hidden, device=device, dtype=dtype),
            post_attention_layernorm=torch.nn.LayerNorm(hidden, device=device, dtype=dtype),
            mlp=Mlp(),
        )

    torch.manual_seed(0)
    return SimpleNamespace(
        model=SimpleNamespace(
            embed_tokens=torch.nn.Embedding(32000, hidden, device=device, dtype=dtype),
            layers=[layer() for _ in range(layers)],
        )
    )


def check_probe(device: torch.device, sizes: list[int], small: bool) -> list[Row]:
    from pcr_sglang.reuse.blend_select import BlendProbe, probe_layers

    cuda = device.type == "cuda"
    if small:
        shape = dict(hidden=64, heads=4, kv_heads=2, dim=16, inter=128)
    else:
        shape = dict(hidden=2048, heads=16, kv_heads=4, dim=128, inter=5632)
    dtype = torch.bfloat16 if cuda else torch.float32
    n_layers = probe_layers(16)
    model = _stand_in_decoder(n_layers, device=device, dtype=dtype, **shape)
    pool_tokens = 2 * max(sizes) + max(sizes) // 2 + 1024
    kv = [
        (
            torch.randn(pool_tokens, shape["kv_heads"], shape["dim"], device=device, dtype=dtype),
            torch.randn(pool_tokens, shape["kv_heads"], shape["dim"], device=device, dtype=dtype),
        )
        for _ in range(n_layers)
    ]
    probe = BlendProbe(model, kv)
    rows = []
    for tokens in sizes:
        prefix, question = tokens // 2, min(256, max(tokens // 16, 1))
        for selector in ("deviation", "gradual", "prophet"):
            ids = torch.randint(0, 32000, (tokens,), device=device)
            positions = torch.arange(prefix, prefix + tokens, device=device)
            prefix_slots = torch.arange(prefix, device=device)
            reused = torch.arange(prefix, prefix + tokens, device=device)
            candidates = torch.arange(tokens // 8, tokens, device=device)
            anchored = torch.zeros(candidates.shape[0], dtype=torch.bool, device=device)
            question_ids = torch.randint(0, 32000, (question,), device=device)
            count = max(1, tokens // 7)
            estimate = probe.scratch_estimate(tokens, prefix, question if selector == "prophet" else 0)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            probe.select(
                ids,
                positions,
                prefix_slots,
                reused,
                candidates,
                count,
                anchored,
                selector,
                question_ids if selector == "prophet" else None,
            )
            if cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated(device) - base
                rows.append(
                    Row(
                        f"probe: {selector}, {tokens} tokens after {prefix}",
                        f"{peak / 2**20:.0f} MiB ({peak / estimate:.2f} of the estimate)",
                        f"{estimate / 2**20:.0f} MiB",
                        peak <= estimate,
                    )
                )
            else:
                rows.append(Row(f"probe: {selector}, {tokens} tokens after {prefix}", "ran", "-", None))
    return rows


def check_mask(device: torch.device, extend: int) -> list[Row]:
    cuda = device.type == "cuda"
    prefix_lens = [extend, 4 * extend, 0, 2 * extend]
    extend_lens = [extend, extend // 2, extend, extend // 4]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    order = list(range(seq_lens[0]))
    order[extend // 2 : extend] = reversed(order[extend // 2 : extend])  # a permuted prefix
    rows = {0: torch.tensor(order, dtype=torch.int64, device=device)}
    need = permuted_rows.position_mask_bytes(prefix_lens, extend_lens)
    slack = 8 * sum(seq_lens) + (1 << 20)  # each plain request's arange of positions, the indptr
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    mask, _ = permuted_rows.triton_position_mask(rows, seq_lens, prefix_lens, device)
    if not cuda:
        return [Row(f"mask: batch of 4, {need / 2**20:.0f} MiB of mask", "ran", "-", None)]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    return [
        Row(
            f"mask: batch of 4 ({need / 2**20:.0f} MiB of mask)",
            f"{peak / 2**20:.1f} MiB",
            f"{(need + slack) / 2**20:.1f} MiB",
            peak <= need + slack and mask.numel() == need,
        )
    ]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--probe-sizes", default="1024,4096,16384")
    parser.add_argument("--mask-extend", type=int, default=4096)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    sizes = [int(s) for s in args.probe_sizes.split(",")]
    if cuda:
        print(f"GPU: {torch.cuda.get_device_name()}")
    else:
        print("No GPU: the same code runs on CPU, nothing is measured (NOT a GPU check)")
        sizes = [min(s, 64) for s in sizes[:1]]
    rows = check_step(device, args.layers if cuda else 2, args.steps if cuda else 1)
    rows += check_probe(device, sizes, small=not cuda)
    rows += check_mask(device, args.mask_extend if cuda else 16)
    width = max(len(r.check) for r in rows)
    print(f"| {'check':{width}} | figure | limit | verdict |")
    print(f"| {'-' * width} | --- | --- | --- |")
    for r in rows:
        print(f"| {r.check:{width}} | {r.figure} | {r.limit} | {r.verdict} |")
    failed = [r for r in rows if r.ok is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
