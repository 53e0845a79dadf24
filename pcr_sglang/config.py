"""PCRConfig: the PCR flags, parsed and validated in one place.

SGLang-agnostic: built from any object carrying the ``Pcr`` namespace's fields (the
resolved ``ServerArgs`` in a server, a plain namespace in tests and benchmarks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pcr_sglang.server_args_fields import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_LAYERWISE,
    DEFAULT_LOOKAHEAD_WINDOW,
    LAYERWISE_CHOICES,
)

logger = logging.getLogger(__name__)


class PCRConfigError(ValueError):
    """A PCR flag has an invalid value or conflicts with another flag."""


@dataclass(frozen=True)
class PCRConfig:
    enabled: bool = False
    chunk_size: int = DEFAULT_CHUNK_SIZE
    lookahead_window: int = DEFAULT_LOOKAHEAD_WINDOW
    dram_gb: float = 0.0
    layerwise: str = DEFAULT_LAYERWISE

    @classmethod
    def from_server_args(cls, args: Any) -> PCRConfig:
        return cls(
            enabled=bool(getattr(args, "enable_pcr", False)),
            chunk_size=getattr(args, "pcr_chunk_size", DEFAULT_CHUNK_SIZE),
            lookahead_window=getattr(args, "pcr_lookahead_window", DEFAULT_LOOKAHEAD_WINDOW),
            dram_gb=getattr(args, "pcr_dram_gb", 0.0),
            layerwise=getattr(args, "pcr_layerwise", DEFAULT_LAYERWISE),
        )

    @property
    def dram_bytes(self) -> int:
        return int(self.dram_gb * (1 << 30))

    def validate(self, page_size: int) -> None:
        """Raise :class:`PCRConfigError` naming the offending flag."""
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
            raise PCRConfigError(
                f"--pcr-chunk-size must be an integer, got {self.chunk_size!r}"
            )
        if self.chunk_size <= 0:
            raise PCRConfigError(
                f"--pcr-chunk-size must be a positive number of tokens, got {self.chunk_size}"
            )
        window = self.lookahead_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise PCRConfigError(
                f"--pcr-lookahead-window must be a non-negative integer, got {self.lookahead_window!r}"
            )
        dram = self.dram_gb
        if isinstance(dram, bool) or not isinstance(dram, (int, float)) or not dram >= 0:
            raise PCRConfigError(f"--pcr-dram-gb must be a number of GB >= 0, got {dram!r}")
        if self.layerwise not in LAYERWISE_CHOICES:
            raise PCRConfigError(
                f"--pcr-layerwise must be one of {', '.join(LAYERWISE_CHOICES)}, got {self.layerwise!r}"
            )
        if page_size > 0 and self.chunk_size % page_size != 0:
            raise PCRConfigError(
                f"--pcr-chunk-size ({self.chunk_size}) must be a multiple of "
                f"--page-size ({page_size}): a chunk is a whole number of KV pages"
            )
