"""No JIT in the serving path: every Triton kernel of the transfer path is launched once at
startup, on CUDA only, over the operands serving uses. Checked on CPU by what the warm-up
calls (recording launchers in place of the kernels); the launches themselves are run
under the Triton interpreter in tests/kernels/test_warmup_triton.py. Nothing here ran on
a GPU."""

from __future__ import annotations

import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec
from pcr_sglang.transfer.warmup import warm_up_on_cuda

LAYERS, CHUNK, HEADS, DIM, TOKENS = 5, 4, 2, 8, 32
ROPE = RopeSpec(DIM, DIM, True, (1.0, 0.1, 0.01, 0.001))


def make_engine():
    kv = [(torch.zeros(TOKENS, HEADS, DIM), torch.zeros(TOKENS, HEADS, DIM)) for _ in range(LAYERS)]
    layout = HostChunkLayout(3, LAYERS, CHUNK, HEADS * DIM * 4)
    host = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    return kv, host, TransferEngine(kv, host, layout, LayerwiseMode.BOTH)


def test_on_cuda_every_kernel_is_launched_on_every_layer_with_the_serving_operands():
    kv, host, engine = make_engine()
    copies, rotations, syncs = [], [], []
    report = warm_up_on_cuda(
        engine=engine,
        kv_layers=kv,
        rope=ROPE,
        on_cuda=True,
        copy=lambda d, k, v, h, ts, hs, layer, layout: copies.append((d, k, v, h, layer, ts.tolist(), hs.tolist())),
        rotate=lambda k, v, s, d, delta, rope, use_triton, verify_slots: rotations.append(
            (k, v, s.tolist(), d.tolist(), delta.tolist(), rope, use_triton)
        ),
        synchronize=lambda: syncs.append(1),
    )
    assert report is not None and len(report.launches) == 3 * LAYERS
    assert {(int(c[0]), c[4]) for c in copies} == {(d, layer) for d in (0, 1) for layer in range(LAYERS)}
    for d, k, v, h, layer, token_slots, host_slots in copies:  # the buffers serving uses, slot 0 only
        assert k is kv[layer][0] and v is kv[layer][1] and h is engine.kernel_operands(layer)[2]
        assert token_slots == [0] * CHUNK and host_slots == [0]
    assert [(r[0], r[1]) for r in rotations] == [(k, v) for k, v in kv]
    assert all(r[2:5] == ([0], [0], [0]) and r[5] is ROPE and r[6] is True for r in rotations)
    assert syncs == [1]  # waited for once, at startup


def test_off_cuda_nothing_is_launched():
    kv, host, engine = make_engine()
    fail = lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched off CUDA"))  # noqa: E731
    assert warm_up_on_cuda(engine=engine, kv_layers=kv, rope=ROPE, copy=fail, rotate=fail, synchronize=fail) is None
    assert (
        warm_up_on_cuda(engine=None, kv_layers=kv, rope=None, on_cuda=True, copy=fail, rotate=fail, synchronize=fail)
        is None
    )
