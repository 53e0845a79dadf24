"""LayerwiseMode: which transfers overlap with the forward, the ``--pcr-layerwise`` choice.

A plain value with one job, apart from :class:`~pcr_sglang.transfer.engine.TransferEngine`
that acts on it (and re-exports it, so it is importable from the engine as before).
"""

from __future__ import annotations

import enum


class LayerwiseMode(str, enum.Enum):
    """Which transfers overlap with the forward (``--pcr-layerwise``)."""

    OFF = "off"
    LOAD = "load"
    OFFLOAD = "offload"
    BOTH = "both"

    @property
    def loads(self) -> bool:
        return self in (LayerwiseMode.LOAD, LayerwiseMode.BOTH)

    @property
    def offloads(self) -> bool:
        return self in (LayerwiseMode.OFFLOAD, LayerwiseMode.BOTH)
