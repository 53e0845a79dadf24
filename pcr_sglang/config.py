"""PCRConfig: the PCR flags, parsed and validated in one place.

SGLang-agnostic: built from any object carrying the ``PcrFlags`` namespace's fields (the
resolved ``ServerArgs`` in a server, a plain namespace in tests and benchmarks).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Optional

from pcr_sglang.core.hints import HintLimits
from pcr_sglang.flags import (
    AUTO_LAYERWISE,
    DEFAULT_BLEND_PROBE_MB,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DOC_MAX_DOCUMENTS,
    DEFAULT_DOC_MIN_TOKENS,
    DEFAULT_DOC_RECOMPUTE_RATIO,
    DEFAULT_DOC_RECOMPUTE_TOKENS,
    DEFAULT_DOC_REUSE,
    DEFAULT_DOC_SELECTOR,
    DEFAULT_DOC_WARMUP,
    DEFAULT_DOC_WARMUP_AFTER,
    DEFAULT_HINT_BUDGET_MB,
    DEFAULT_HINT_MAX_TTL_S,
    DEFAULT_HINT_RATE,
    DEFAULT_HINT_TO_DEVICE,
    DEFAULT_LAYERWISE,
    DEFAULT_LOOKAHEAD_WINDOW,
    DEFAULT_PREFETCH_BUDGET_MB,
    DEFAULT_PREFETCH_WINDOW,
    DEFAULT_REMOTE,
    DEFAULT_SSD_DURABILITY,
    DEFAULT_SSD_KEEP_NAMESPACES,
    DEFAULT_SSD_READ_THREADS,
    DEFAULT_SSD_WRITE,
    DOC_REUSE_CHOICES,
    DOC_SELECTOR_CHOICES,
    DOC_WARMUP_CHOICES,
    HINT_TO_DEVICE_CHOICES,
    LAYERWISE_CHOICES,
    MAX_SSD_READ_THREADS,
    REMOTE_CHOICES,
    SSD_DURABILITY_CHOICES,
    SSD_WRITE_CHOICES,
)
from pcr_sglang.tiers.remote_store import RemoteConfig, RemoteConfigError, load_fleet_key

logger = logging.getLogger(__name__)


def resolve_layerwise(layerwise: str, args: Any) -> str:
    """``--pcr-layerwise auto``: ``both``, or ``offload`` when SGLang's prefill CUDA graph
    is on (``--cuda-graph-backend-prefill``, ``breakable`` by default on CUDA): loads
    waited for layer by layer under a prefill graph are refused until a GPU run shows the
    waits at replay, and a default that every GPU refuses would be no default. Other
    values are the user's, kept as given (and refused there when they cannot run)."""
    if layerwise != AUTO_LAYERWISE:
        return layerwise
    graphs = getattr(_resolved(args), "cuda_graph_config", None)
    backend = str(getattr(getattr(graphs, "prefill", None), "backend", "disabled") or "disabled").lower()
    return DEFAULT_LAYERWISE if backend in ("disabled", "none") else "offload"


def _resolved(args: Any) -> Any:
    """SGLang's resolved view of its server arguments: its decisions (the prefill graph's
    backend among them) live in overrides and are not written back to the record, which
    keeps the flags as given. ``args`` itself where it is not SGLang's record (tests)."""
    try:
        from sglang.srt.arg_groups.overrides import resolving_view

        return resolving_view(args)
    except Exception:  # not a ServerArgs, or no SGLang: the fields as given
        return args


class PCRConfigError(ValueError):
    """A PCR flag has an invalid value or conflicts with another flag."""


@dataclass(frozen=True)
class PCRConfig:
    enabled: bool = False
    chunk_size: int = DEFAULT_CHUNK_SIZE
    lookahead_window: int = DEFAULT_LOOKAHEAD_WINDOW
    dram_gb: float = 0.0
    layerwise: str = DEFAULT_LAYERWISE
    ssd_path: Optional[str] = None
    ssd_gb: float = 0.0
    ssd_reserve_gb: float = 1.0
    ssd_write: str = DEFAULT_SSD_WRITE
    ssd_durability: str = DEFAULT_SSD_DURABILITY
    ssd_read_threads: int = DEFAULT_SSD_READ_THREADS
    ssd_keep_namespaces: int = DEFAULT_SSD_KEEP_NAMESPACES
    prefetch_window: int = DEFAULT_PREFETCH_WINDOW
    prefetch_budget_mb: int = DEFAULT_PREFETCH_BUDGET_MB
    doc_reuse: str = DEFAULT_DOC_REUSE
    doc_recompute_tokens: int = DEFAULT_DOC_RECOMPUTE_TOKENS
    doc_recompute_ratio: float = DEFAULT_DOC_RECOMPUTE_RATIO
    doc_anchor_tokens: int = 0
    blend_probe_mb: int = DEFAULT_BLEND_PROBE_MB
    doc_selector: str = DEFAULT_DOC_SELECTOR
    doc_reuse_calibration: Optional[str] = None  # a pcr_tools.calibrate file
    doc_reuse_calibration_warn: bool = False
    doc_warmup: str = DEFAULT_DOC_WARMUP
    doc_warmup_after: int = DEFAULT_DOC_WARMUP_AFTER
    doc_max_documents: int = DEFAULT_DOC_MAX_DOCUMENTS
    doc_min_tokens: int = DEFAULT_DOC_MIN_TOKENS
    hint_budget_mb: int = DEFAULT_HINT_BUDGET_MB
    hint_max_ttl_s: float = DEFAULT_HINT_MAX_TTL_S
    hint_rate: float = DEFAULT_HINT_RATE
    hint_to_device: str = DEFAULT_HINT_TO_DEVICE
    remote: str = DEFAULT_REMOTE
    remote_config: Optional[str] = None  # as given (JSON or @path); parsed by remote_settings()

    @classmethod
    def from_server_args(cls, args: Any) -> PCRConfig:
        return cls(
            enabled=bool(getattr(args, "enable_pcr", False)),
            chunk_size=getattr(args, "pcr_chunk_size", DEFAULT_CHUNK_SIZE),
            lookahead_window=getattr(args, "pcr_lookahead_window", DEFAULT_LOOKAHEAD_WINDOW),
            dram_gb=getattr(args, "pcr_dram_gb", 0.0),
            layerwise=resolve_layerwise(getattr(args, "pcr_layerwise", AUTO_LAYERWISE), args),
            ssd_path=getattr(args, "pcr_ssd_path", None) or None,
            ssd_gb=getattr(args, "pcr_ssd_gb", 0.0),
            ssd_reserve_gb=getattr(args, "pcr_ssd_reserve_gb", 1.0),
            ssd_write=getattr(args, "pcr_ssd_write", DEFAULT_SSD_WRITE),
            ssd_durability=getattr(args, "pcr_ssd_durability", DEFAULT_SSD_DURABILITY),
            ssd_read_threads=getattr(args, "pcr_ssd_read_threads", DEFAULT_SSD_READ_THREADS),
            ssd_keep_namespaces=getattr(args, "pcr_ssd_keep_namespaces", DEFAULT_SSD_KEEP_NAMESPACES),
            prefetch_window=getattr(args, "pcr_prefetch_window", DEFAULT_PREFETCH_WINDOW),
            prefetch_budget_mb=getattr(args, "pcr_prefetch_budget_mb", DEFAULT_PREFETCH_BUDGET_MB),
            doc_reuse=getattr(args, "pcr_doc_reuse", DEFAULT_DOC_REUSE),
            doc_recompute_tokens=getattr(args, "pcr_doc_recompute_tokens", DEFAULT_DOC_RECOMPUTE_TOKENS),
            doc_recompute_ratio=getattr(args, "pcr_doc_recompute_ratio", DEFAULT_DOC_RECOMPUTE_RATIO),
            doc_anchor_tokens=getattr(args, "pcr_doc_anchor_tokens", 0),
            blend_probe_mb=getattr(args, "pcr_blend_probe_mb", DEFAULT_BLEND_PROBE_MB),
            doc_selector=getattr(args, "pcr_doc_selector", DEFAULT_DOC_SELECTOR),
            doc_reuse_calibration=getattr(args, "pcr_doc_reuse_calibration", None) or None,
            doc_reuse_calibration_warn=bool(getattr(args, "pcr_doc_reuse_calibration_warn", False)),
            doc_warmup=getattr(args, "pcr_doc_warmup", DEFAULT_DOC_WARMUP),
            doc_warmup_after=getattr(args, "pcr_doc_warmup_after", DEFAULT_DOC_WARMUP_AFTER),
            doc_max_documents=getattr(args, "pcr_doc_max_documents", DEFAULT_DOC_MAX_DOCUMENTS),
            doc_min_tokens=getattr(args, "pcr_doc_min_tokens", DEFAULT_DOC_MIN_TOKENS),
            hint_budget_mb=getattr(args, "pcr_hint_budget_mb", DEFAULT_HINT_BUDGET_MB),
            hint_max_ttl_s=getattr(args, "pcr_hint_max_ttl_s", DEFAULT_HINT_MAX_TTL_S),
            hint_rate=getattr(args, "pcr_hint_rate", DEFAULT_HINT_RATE),
            hint_to_device=getattr(args, "pcr_hint_to_device", DEFAULT_HINT_TO_DEVICE),
            remote=getattr(args, "pcr_remote", DEFAULT_REMOTE),
            remote_config=getattr(args, "pcr_remote_config", None) or None,
        )

    def hint_limits(self) -> HintLimits:
        return HintLimits(max_ttl_s=float(self.hint_max_ttl_s), rate_per_s=float(self.hint_rate),
                          burst=max(1, int(2 * self.hint_rate)))

    def remote_settings(self) -> Optional[RemoteConfig]:
        """``--pcr-remote-config`` parsed, with its key file checked (None: no remote tier).
        Raises :class:`PCRConfigError`."""
        if self.remote == "off":
            return None
        try:
            config = RemoteConfig.parse(self.remote_config or "")
            load_fleet_key(config.key_file)
        except RemoteConfigError as e:
            raise PCRConfigError(str(e)) from None
        if importlib.util.find_spec("mooncake") is None:
            raise PCRConfigError("--pcr-remote mooncake needs the Mooncake client: pip install "
                                 "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA)")
        return config

    @property
    def dram_bytes(self) -> int:
        return int(self.dram_gb * (1 << 30))

    @property
    def ssd_bytes(self) -> int:
        return int(self.ssd_gb * (1 << 30)) if self.ssd_path else 0

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
        ssd = self.ssd_gb
        if isinstance(ssd, bool) or not isinstance(ssd, (int, float)) or not ssd >= 0:
            raise PCRConfigError(f"--pcr-ssd-gb must be a number of GB >= 0, got {ssd!r}")
        reserve = self.ssd_reserve_gb
        if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not reserve >= 0:
            raise PCRConfigError(f"--pcr-ssd-reserve-gb must be a number of GB >= 0, got {reserve!r}")
        if ssd > 0 and not self.ssd_path:
            raise PCRConfigError("--pcr-ssd-gb needs --pcr-ssd-path (the directory of the SSD tier)")
        if self.ssd_path and ssd == 0:
            raise PCRConfigError("--pcr-ssd-path needs --pcr-ssd-gb > 0 (the size of the SSD tier)")
        if self.ssd_path and not dram > 0:
            raise PCRConfigError("--pcr-ssd-path needs --pcr-dram-gb > 0: SSD chunks are read through host memory")
        for flag, value in (("--pcr-prefetch-window", self.prefetch_window),
                            ("--pcr-prefetch-budget-mb", self.prefetch_budget_mb),
                            ("--pcr-hint-budget-mb", self.hint_budget_mb)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PCRConfigError(f"{flag} must be a non-negative integer, got {value!r}")
        if self.hint_to_device not in HINT_TO_DEVICE_CHOICES:
            raise PCRConfigError(
                f"--pcr-hint-to-device must be one of {', '.join(HINT_TO_DEVICE_CHOICES)}, got {self.hint_to_device!r}"
            )
        if self.ssd_write not in SSD_WRITE_CHOICES:
            raise PCRConfigError(
                f"--pcr-ssd-write must be one of {', '.join(SSD_WRITE_CHOICES)}, got {self.ssd_write!r}"
            )
        if self.ssd_durability not in SSD_DURABILITY_CHOICES:
            raise PCRConfigError(
                f"--pcr-ssd-durability must be one of {', '.join(SSD_DURABILITY_CHOICES)}, "
                f"got {self.ssd_durability!r}"
            )
        threads = self.ssd_read_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_SSD_READ_THREADS:
            raise PCRConfigError(
                f"--pcr-ssd-read-threads must be an integer from 1 to {MAX_SSD_READ_THREADS}, got {threads!r}"
            )
        keep = self.ssd_keep_namespaces
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise PCRConfigError(f"--pcr-ssd-keep-namespaces must be an integer >= 0, got {keep!r}")
        if self.doc_reuse not in DOC_REUSE_CHOICES:
            raise PCRConfigError(
                f"--pcr-doc-reuse must be one of {', '.join(DOC_REUSE_CHOICES)}, got {self.doc_reuse!r}"
            )
        tokens = self.doc_recompute_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise PCRConfigError(f"--pcr-doc-recompute-tokens must be an integer >= 0, got {tokens!r}")
        anchors = self.doc_anchor_tokens
        if isinstance(anchors, bool) or not isinstance(anchors, int) or anchors < 0:
            raise PCRConfigError(f"--pcr-doc-anchor-tokens must be an integer >= 0, got {anchors!r}")
        if self.doc_selector not in DOC_SELECTOR_CHOICES:
            raise PCRConfigError(f"--pcr-doc-selector must be one of {', '.join(DOC_SELECTOR_CHOICES)}, "
                                 f"got {self.doc_selector!r}")
        if self.doc_reuse_calibration and self.doc_reuse == "off":
            raise PCRConfigError("--pcr-doc-reuse-calibration needs --pcr-doc-reuse")
        ratio = self.doc_recompute_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise PCRConfigError(f"--pcr-doc-recompute-ratio must be a number in [0, 1], got {ratio!r}")
        for flag, value in (("--pcr-hint-max-ttl-s", self.hint_max_ttl_s), ("--pcr-hint-rate", self.hint_rate)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise PCRConfigError(f"{flag} must be a positive number, got {value!r}")
        if self.doc_warmup not in DOC_WARMUP_CHOICES:
            raise PCRConfigError(
                f"--pcr-doc-warmup must be one of {', '.join(DOC_WARMUP_CHOICES)}, got {self.doc_warmup!r}"
            )
        after = self.doc_warmup_after
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise PCRConfigError(f"--pcr-doc-warmup-after must be an integer >= 1, got {after!r}")
        for flag, value in (("--pcr-doc-max-documents", self.doc_max_documents),
                            ("--pcr-doc-min-tokens", self.doc_min_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PCRConfigError(f"{flag} must be an integer >= 1, got {value!r}")
        if self.remote not in REMOTE_CHOICES:
            raise PCRConfigError(f"--pcr-remote must be one of {', '.join(REMOTE_CHOICES)}, got {self.remote!r}")
        if self.remote != "off":
            if not self.ssd_path:
                raise PCRConfigError(f"--pcr-remote {self.remote} needs the SSD tier (--pcr-ssd-path, --pcr-ssd-gb): "
                                     "remote chunks are read by its I/O process and tracked at its level")
            if not self.remote_config:
                raise PCRConfigError(f"--pcr-remote {self.remote} needs --pcr-remote-config (JSON or @path)")
            self.remote_settings()
        elif self.remote_config:
            raise PCRConfigError("--pcr-remote-config needs --pcr-remote mooncake")
        if self.doc_reuse not in ("off", "reorder") and page_size > 1:  # reuse.bounds.EXACT_MODES: nothing re-placed
            raise PCRConfigError(
                f"--pcr-doc-reuse {self.doc_reuse} needs --page-size 1: a re-placed document's "
                "slots are appended to the row token by token"
            )
        if page_size > 0 and self.chunk_size % page_size != 0:
            raise PCRConfigError(
                f"--pcr-chunk-size ({self.chunk_size}) must be a multiple of "
                f"--page-size ({page_size}): a chunk is a whole number of KV pages"
            )
