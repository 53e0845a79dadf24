"""The startup warm-up's real launches (the copy and rotation kernels) leave every KV row
and every host slot but slot 0 as they were: under TRITON_INTERPRET=1 on CPU, natively on
a CUDA machine."""

from __future__ import annotations

import os

import pytest
import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec
from pcr_sglang.transfer.warmup import warm_up_on_cuda

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
LAYERS, CHUNK, HEADS, DIM, TOKENS = 3, 4, 2, 8, 16
ROPE = RopeSpec(DIM, DIM, True, (1.0, 0.1, 0.01, 0.001))


def test_the_warm_up_launches_change_no_kv_row_and_no_host_slot_but_slot_0():
    gen = torch.Generator().manual_seed(3)
    kv = [
        (
            torch.randn(TOKENS, HEADS, DIM, generator=gen, dtype=torch.float32).to(torch.bfloat16).to(DEVICE),
            torch.randn(TOKENS, HEADS, DIM, generator=gen).to(torch.bfloat16).to(DEVICE),
        )
        for _ in range(LAYERS)
    ]
    layout = HostChunkLayout(3, LAYERS, CHUNK, HEADS * DIM * 2)
    host = torch.randint(0, 255, (layout.total_bytes,), dtype=torch.uint8, generator=gen)
    if DEVICE == "cuda":
        host = host.pin_memory()
    before_kv = [(k.clone(), v.clone()) for k, v in kv]
    before_host = host.clone().view(layout.shape)
    engine = TransferEngine(kv, host, layout, LayerwiseMode.BOTH)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    report = warm_up_on_cuda(engine=engine, kv_layers=kv, rope=ROPE, on_cuda=True, synchronize=sync)
    assert report is not None and len(report.launches) == 3 * LAYERS
    for (k, v), (k0, v0) in zip(kv, before_kv):
        assert torch.equal(k.view(torch.int16), k0.view(torch.int16)) and torch.equal(
            v.view(torch.int16), v0.view(torch.int16)
        )
    assert torch.equal(host.view(layout.shape)[1:], before_host[1:])


@pytest.mark.skipif(INTERPRET, reason="compiled kernels exist only on a GPU (the interpreter compiles nothing)")
def test_after_the_warm_up_serving_launches_compile_nothing():
    """The launches serving makes (another layer, merged index tensors, deltas that are a
    row of a stacked tensor, so unaligned) hit the kernels the warm-up compiled."""
    from pcr_sglang.transfer import copy_kv, rope_shift
    from pcr_sglang.transfer.copy_kv import Direction, copy_layer
    from pcr_sglang.transfer.rope_shift import replace_layer

    def compiled() -> int:
        return sum(
            len(caches[0])
            for kernel in (copy_kv._KERNEL, rope_shift._KERNEL)
            for caches in kernel.device_caches.values()
        )

    kv = [
        (
            torch.randn(TOKENS, HEADS, DIM, device=DEVICE).to(torch.bfloat16),
            torch.randn(TOKENS, HEADS, DIM, device=DEVICE).to(torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    layout = HostChunkLayout(3, LAYERS, CHUNK, HEADS * DIM * 2)
    host = torch.zeros(layout.total_bytes, dtype=torch.uint8).pin_memory()
    engine = TransferEngine(kv, host, layout, LayerwiseMode.BOTH)
    warm_up_on_cuda(engine=engine, kv_layers=kv, rope=ROPE)
    before = compiled()
    token_slots = torch.cat([torch.arange(4, 8, device=DEVICE), torch.arange(8, 12, device=DEVICE)])
    host_slots = torch.tensor([1, 2], device=DEVICE)
    for layer in range(LAYERS):
        k, v, pointer = engine.kernel_operands(layer)
        for direction in Direction:
            copy_layer(direction, k, v, pointer, token_slots, host_slots, layer, layout)
        index = torch.tensor([[1, 2, 3], [9, 10, 11], [5, -5, 7]], device=DEVICE)
        replace_layer(k, v, index[0], index[1], index[2], ROPE, verify_slots=False)  # rows 16-byte aligned
        replace_layer(k, v, index[0][1:], index[1][1:], index[2][1:], ROPE, verify_slots=False)  # 8-byte offsets
    torch.cuda.synchronize()
    assert compiled() == before
