"""Compile every Triton kernel of the transfer path at startup, on every rank.

A Triton kernel is compiled at its first launch with a new specialization: seconds of
stall in the scheduler thread, at the first host hit or the first document admission,
at different moments on different TP ranks. This module launches each kernel once over
the operands it will see in serving (the same KV buffers, the same host pool address,
the same dtypes and head layout; the kernels do not specialize on the layer index or on
the index tensors' alignment, so one set of launches covers every later one), where the
cache is assembled, on CUDA only.

The launches are harmless: the copy moves token slot 0 (SGLang's padding slot, never a
request's) to host slot 0 and back, before any request can hold either; the rotation
re-places slot 0 onto itself with delta 0, which keeps its bits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from pcr_sglang.transfer.copy_kv import Direction, copy_layer_triton
from pcr_sglang.transfer.engine import TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec, replace_layer

logger = logging.getLogger(__name__)


@dataclass
class WarmupReport:
    """What the warm-up launched: ``(kernel, layer, detail)`` per launch, and its time."""

    launches: list[tuple[str, int, str]] = field(default_factory=list)
    seconds: float = 0.0


def warm_up_copy(engine: TransferEngine, report: WarmupReport, copy: Callable[..., None] = copy_layer_triton) -> None:
    """The copy kernel, both directions, every layer, on ``engine``'s operands (its KV
    buffers and the host pool as the kernel gets it: on CUDA the device address)."""
    layout = engine.layout
    for layer in range(engine.num_layers):
        k, v, host = engine.kernel_operands(layer)
        token_slots = torch.zeros(layout.chunk_size, dtype=torch.int64, device=k.device)
        host_slots = torch.zeros(1, dtype=torch.int64, device=k.device)
        # mutant: gpu-warm-up-copies-one-direction
        for direction in (Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE):
            copy(direction, k, v, host, token_slots, host_slots, layer, layout)
            report.launches.append(("copy", layer, direction.name))


def warm_up_rotation(
    kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    rope: RopeSpec,
    report: WarmupReport,
    rotate: Callable[..., None] = replace_layer,
) -> None:
    """The rotation kernel on every layer's buffers with the model's RoPE: slot 0 onto
    itself, delta 0 (bits kept)."""
    for layer, (k, v) in enumerate(kv_layers):
        slot = torch.zeros(1, dtype=torch.int64, device=k.device)
        rotate(
            k,
            v,
            slot,
            slot,
            torch.zeros(1, dtype=torch.int64, device=k.device),
            rope,
            use_triton=True,
            verify_slots=False,
        )
        report.launches.append(("rope", layer, rope.signature()))


def warm_up_on_cuda(
    *,
    engine: Optional[TransferEngine] = None,
    kv_layers: Optional[Sequence[tuple[torch.Tensor, torch.Tensor]]] = None,
    rope: Optional[RopeSpec] = None,
    on_cuda: Optional[bool] = None,
    copy: Callable[..., None] = copy_layer_triton,
    rotate: Callable[..., None] = replace_layer,
    synchronize: Optional[Callable[[], None]] = None,
) -> Optional[WarmupReport]:
    """Where the cache is assembled (on each rank): compile the copy kernel for ``engine``
    and the rotation kernel for ``kv_layers`` with ``rope``, if they run on CUDA (elsewhere
    the torch paths run and nothing is compiled: returns None); waits for the launches.

    ``on_cuda``, ``copy``, ``rotate``, ``synchronize``: decided from the buffers' device,
    and the real launchers; tests pass recorders to check on CPU what this calls."""
    if engine is None and (kv_layers is None or rope is None):
        return None
    if on_cuda is None:  # the engine's device, else the KV layers' (one of them is set: see above)
        if engine is not None:
            on_cuda = engine.device.type == "cuda"
        elif kv_layers is not None:
            on_cuda = kv_layers[0][0].device.type == "cuda"
    if not on_cuda:
        return None
    report = WarmupReport()
    start = time.monotonic()
    with torch.no_grad():
        if engine is not None:
            warm_up_copy(engine, report, copy)
        if kv_layers is not None and rope is not None:
            # mutant: gpu-warm-up-skips-the-rotation-kernel
            warm_up_rotation(kv_layers, rope, report, rotate)
    (synchronize or torch.cuda.synchronize)()
    report.seconds = time.monotonic() - start
    logger.info(
        "PCR: compiled the transfer kernels at startup (%s: %d launches, %.1f s)",
        ", ".join(sorted({kernel for kernel, _, _ in report.launches})),
        len(report.launches),
        report.seconds,
    )
    return report
