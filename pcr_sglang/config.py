"""PCRConfig: the PCR flags, parsed and validated in one place.

SGLang-agnostic: built from any object carrying the ``PcrFlags`` namespace's fields (the
resolved ``ServerArgs`` in a server, a plain namespace in tests and benchmarks).
"""

from __future__ import annotations

import importlib.util
import logging
import typing
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any, Optional, Union

from sglang.srt.arg_groups.arg_utils import Arg

from pcr_sglang.core.hints import HintLimits
from pcr_sglang.flags import AUTO_LAYERWISE, DEFAULT_LAYERWISE, LAYERWISE_CHOICES, PcrFlags, Range, flag_value
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
    # mutant: layerwise-auto-reads-the-unresolved-record
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
class FlagRule:
    """What one flag field's declaration allows: its type, its ``Arg`` choices, its
    :class:`~pcr_sglang.flags.Range`. ``problem`` words what is wrong with a value."""

    name: str  # the field of PcrFlags: pcr_chunk_size
    kind: type  # int, float, str or bool (Optional[...] unwrapped)
    optional: bool
    choices: Optional[tuple[Any, ...]] = None
    range: Optional[Range] = None

    @property
    def cli(self) -> str:
        return "--" + self.name.replace("_", "-")

    def problem(self, value: Any) -> Optional[str]:
        """Why ``value`` is refused, naming the flag (None: it is allowed)."""
        if self.choices is not None and value not in self.choices:
            return f"{self.cli} must be one of {', '.join(map(str, self.choices))}, got {value!r}"
        if self.range is None:
            return None
        r = self.range
        number = self.kind is float
        allowed = (int, float) if number else int
        fits = not isinstance(value, bool) and isinstance(value, allowed)
        fits = fits and (r.ge is None or value >= r.ge) and (r.gt is None or value > r.gt)
        if fits and (r.le is None or value <= r.le):
            return None
        noun = ("number" if number else "integer") + (f" of {r.unit}" if r.unit else "")
        article = "a" if number else "an"
        if r.le is not None:
            span = f"in [{r.ge:g}, {r.le:g}]" if number else f"from {r.ge:g} to {r.le:g}"
            wanted = f"{article} {noun} {span}"
        elif r.gt == 0:
            wanted = f"a positive {noun}"
        else:
            wanted = f"{article} {noun} >= {r.ge:g}" if r.ge is not None else f"{article} {noun} > {r.gt:g}"
        return f"{self.cli} must be {wanted}, got {value!r}"

    def normalized(self, value: Any) -> Any:
        """A server argument as the config holds it: a bool flag as a bool, an empty
        optional string as None."""
        if self.kind is bool:
            return bool(value)
        if self.optional and self.kind is str:
            return value or None
        return value


@cache
def _declarations() -> dict[str, Any]:
    return typing.get_type_hints(PcrFlags, include_extras=True)


def flag_rule(name: str) -> FlagRule:
    """The rule the declaration of flag field ``name`` gives."""
    declared, *extras = typing.get_args(_declarations()[name])
    inner = [t for t in typing.get_args(declared) if t is not type(None)]
    optional = typing.get_origin(declared) is Union
    arg = next((e for e in extras if isinstance(e, Arg)), None)
    return FlagRule(
        name,
        inner[0] if optional else declared,
        optional,
        tuple(arg.choices) if arg is not None and arg.choices else None,
        next((e for e in extras if isinstance(e, Range)), None),
    )


def flag(name: str, **resolved: Any) -> Any:
    """A :class:`PCRConfig` field taken from flag field ``name``: its declared default and
    rule. ``resolved`` (``default``, ``choices``) where the config holds the flag resolved
    rather than as given (``--pcr-layerwise auto``)."""
    rule = flag_rule(name)
    choices = resolved.get("choices")
    if choices is not None:
        rule = FlagRule(rule.name, rule.kind, rule.optional, tuple(choices), rule.range)
    return field(default=resolved.get("default", flag_value(None, name)), metadata={"flag": rule})


@dataclass(frozen=True)
class PCRConfig:
    """The PCR flags, each field taken from its declaration in ``PcrFlags`` (its default and
    what it allows): build one with :meth:`from_server_args`, check it with :meth:`validate`.
    ``--pcr-doc-format`` and ``--pcr-debug-checks`` are read where they are used (the
    tokenizer process, the ``/server_info`` route)."""

    enabled: bool = flag("enable_pcr")
    chunk_size: int = flag("pcr_chunk_size")
    lookahead_window: int = flag("pcr_lookahead_window")
    dram_gb: float = flag("pcr_dram_gb")
    # Resolved: ``auto`` is both, or offload under a prefill CUDA graph (resolve_layerwise).
    layerwise: str = flag("pcr_layerwise", default=DEFAULT_LAYERWISE, choices=LAYERWISE_CHOICES)
    ssd_path: Optional[str] = flag("pcr_ssd_path")
    ssd_gb: float = flag("pcr_ssd_gb")
    ssd_reserve_gb: float = flag("pcr_ssd_reserve_gb")
    ssd_write: str = flag("pcr_ssd_write")
    ssd_durability: str = flag("pcr_ssd_durability")
    ssd_read_threads: int = flag("pcr_ssd_read_threads")
    ssd_keep_namespaces: int = flag("pcr_ssd_keep_namespaces")
    prefetch_window: int = flag("pcr_prefetch_window")
    prefetch_budget_mb: int = flag("pcr_prefetch_budget_mb")
    doc_reuse: str = flag("pcr_doc_reuse")
    doc_recompute_tokens: int = flag("pcr_doc_recompute_tokens")
    doc_recompute_ratio: float = flag("pcr_doc_recompute_ratio")
    doc_anchor_tokens: int = flag("pcr_doc_anchor_tokens")
    blend_probe_mb: int = flag("pcr_blend_probe_mb")  # checked by reuse.setup, in the recompute modes
    position_mask_mb: int = flag("pcr_position_mask_mb")
    doc_selector: str = flag("pcr_doc_selector")
    doc_reuse_calibration: Optional[str] = flag("pcr_doc_reuse_calibration")  # a pcr_tools.calibrate file
    doc_reuse_calibration_warn: bool = flag("pcr_doc_reuse_calibration_warn")
    doc_warmup: str = flag("pcr_doc_warmup")
    doc_warmup_after: int = flag("pcr_doc_warmup_after")
    doc_max_documents: int = flag("pcr_doc_max_documents")
    doc_min_tokens: int = flag("pcr_doc_min_tokens")
    hint_budget_mb: int = flag("pcr_hint_budget_mb")
    hint_max_ttl_s: float = flag("pcr_hint_max_ttl_s")
    hint_rate: float = flag("pcr_hint_rate")
    hint_to_device: str = flag("pcr_hint_to_device")
    remote: str = flag("pcr_remote")
    remote_config: Optional[str] = flag("pcr_remote_config")  # as given (JSON or @path); parsed by remote_settings()

    @classmethod
    def from_server_args(cls, args: Any) -> PCRConfig:
        """The flags of ``args`` (SGLang's ``ServerArgs``, a namespace, or None), each
        missing one at its declared default; ``--pcr-layerwise auto`` resolved."""
        values = {}
        for f in fields(cls):
            rule: FlagRule = f.metadata["flag"]
            values[f.name] = rule.normalized(flag_value(args, rule.name))
        values["layerwise"] = resolve_layerwise(values["layerwise"], args)
        return cls(**values)

    def hint_limits(self) -> HintLimits:
        return HintLimits(
            max_ttl_s=float(self.hint_max_ttl_s),
            rate_per_s=float(self.hint_rate),
            burst=max(1, int(2 * self.hint_rate)),
        )

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
            raise PCRConfigError(
                "--pcr-remote mooncake needs the Mooncake client: pip install "
                "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA)"
            )
        return config

    @property
    def dram_bytes(self) -> int:
        return int(self.dram_gb * (1 << 30))

    @property
    def ssd_bytes(self) -> int:
        return int(self.ssd_gb * (1 << 30)) if self.ssd_path else 0

    def validate(self, page_size: int) -> None:
        """Raise :class:`PCRConfigError` naming the offending flag: first any value its
        declaration does not allow (field order), then the flags that need each other."""
        for f in fields(self):
            problem = f.metadata["flag"].problem(getattr(self, f.name))
            if problem is not None:
                raise PCRConfigError(problem)
        for needs in (_ssd_needs, _calibration_needs, _remote_needs, _page_needs):
            problem = needs(self, page_size)
            if problem is not None:
                raise PCRConfigError(problem)


def _ssd_needs(c: PCRConfig, page_size: int) -> Optional[str]:
    if c.ssd_gb > 0 and not c.ssd_path:
        return "--pcr-ssd-gb needs --pcr-ssd-path (the directory of the SSD tier)"
    if c.ssd_path and c.ssd_gb == 0:
        return "--pcr-ssd-path needs --pcr-ssd-gb > 0 (the size of the SSD tier)"
    if c.ssd_path and not c.dram_gb > 0:
        return "--pcr-ssd-path needs --pcr-dram-gb > 0: SSD chunks are read through host memory"
    return None


def _calibration_needs(c: PCRConfig, page_size: int) -> Optional[str]:
    if c.doc_reuse_calibration and c.doc_reuse == "off":
        return "--pcr-doc-reuse-calibration needs --pcr-doc-reuse"
    return None


def _remote_needs(c: PCRConfig, page_size: int) -> Optional[str]:
    if c.remote == "off":
        return "--pcr-remote-config needs --pcr-remote mooncake" if c.remote_config else None
    if not c.ssd_path:
        return (
            f"--pcr-remote {c.remote} needs the SSD tier (--pcr-ssd-path, --pcr-ssd-gb): "
            "remote chunks are read by its I/O process and tracked at its level"
        )
    if not c.remote_config:
        return f"--pcr-remote {c.remote} needs --pcr-remote-config (JSON or @path)"
    c.remote_settings()  # raises what is wrong with the configuration or its key file
    return None


def _page_needs(c: PCRConfig, page_size: int) -> Optional[str]:
    if c.doc_reuse not in ("off", "reorder") and page_size > 1:  # reuse.bounds.EXACT_MODES: nothing re-placed
        return (
            f"--pcr-doc-reuse {c.doc_reuse} needs --page-size 1: a re-placed document's "
            "slots are appended to the row token by token"
        )
    if page_size > 0 and c.chunk_size % page_size != 0:
        return (
            f"--pcr-chunk-size ({c.chunk_size}) must be a multiple of "
            f"--page-size ({page_size}): a chunk is a whole number of KV pages"
        )
    return None
