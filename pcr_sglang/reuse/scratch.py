"""Document reuse's GPU scratch, taken out of SGLang's KV pool at startup.

Two things of document reuse take GPU memory outside SGLang's own budget, at moments
SGLang does not plan for: blend's probe (``reuse/blend_select.py``: 3-5 decoder layers run
at admission, beside the forward in flight; held to ``--pcr-blend-probe-mb``) and the
position mask of a forward with permuted rows (``reuse/rows.py``: a byte per query and
key; held to ``--pcr-position-mask-mb`` at admission, ``reuse/batch_mask.py``). SGLang
sizes its KV pool from the free memory minus a slack it keeps for activations
(``--mem-fraction-static``); memory PCR then takes at admission comes out of that slack,
and the forward in flight can run out of memory. So both budgets are taken from the KV
pool when SGLang sizes it (``KVCacheConfigurator._profile_available_bytes``, the way it
takes its own multimodal reservation there): the slack stays SGLang's, and the pool holds
that many fewer tokens. Only on CUDA, where the pool is sized from free GPU memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pcr_sglang.config import PCRConfig
from pcr_sglang.reuse.bounds import EXACT_MODES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScratchReserve:
    """Bytes taken from the KV pool for document reuse's scratch, by what needs them."""

    probe: int = 0  # blend's probe: --pcr-blend-probe-mb
    mask: int = 0  # a forward's position mask: --pcr-position-mask-mb

    @property
    def total(self) -> int:
        return self.probe + self.mask


def scratch_reserve(config: PCRConfig) -> ScratchReserve:
    """What ``config`` needs reserved: nothing for exact modes (no permuted row, no
    probe); the position mask for every mode that may permute a row (``concat`` computes
    an uncached document in place where the attention allows); the probe for ``blend``."""
    if config.doc_reuse in EXACT_MODES:
        return ScratchReserve()
    probe = int(config.blend_probe_mb) << 20 if config.doc_reuse == "blend" else 0
    return ScratchReserve(probe=probe, mask=int(config.position_mask_mb) << 20)


def reserve_from_kv_pool(available_bytes: int, reserve: ScratchReserve, device: str) -> int:
    """The KV pool's byte budget once ``reserve`` is taken out of ``available_bytes``
    (SGLang's figure) on CUDA; unchanged elsewhere. Refuses, naming the flags, when
    nothing would be left for the pool."""
    if not reserve.total or not str(device).startswith("cuda"):
        return available_bytes
    # mutant: gpu-scratch-not-reserved-from-the-kv-pool
    left = available_bytes - reserve.total
    if left <= 0:
        raise ValueError(
            f"PCR document reuse reserves {reserve.total / 2**20:.0f} MiB of GPU scratch "
            f"(--pcr-blend-probe-mb {reserve.probe >> 20}, --pcr-position-mask-mb {reserve.mask >> 20}) and "
            f"SGLang's KV pool had only {available_bytes / 2**20:.0f} MiB: lower those flags or raise "
            "--mem-fraction-static"
        )
    logger.info(
        "PCR document reuse: %d MiB of GPU scratch reserved from the KV pool (blend probe %d MiB, "
        "position mask %d MiB); the pool is sized from the remaining %d MiB",
        reserve.total >> 20,
        reserve.probe >> 20,
        reserve.mask >> 20,
        left >> 20,
    )
    return left
