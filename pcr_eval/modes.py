"""The measured configurations of document reuse, as the benchmarks and calibration name
them (``concat``, ``lego[:K]``, ``blend[:R[:A][:S]]``, ``reorder``): what each asks the server
for in ``custom_params`` and how many tokens it recomputes, one definition for every
measurement so a benchmark and a calibration of "blend:0.15" send the same request."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pcr_sglang.reuse.bounds import SELECTORS

MODES = ("concat", "lego", "blend", "reorder")


@dataclass(frozen=True)
class ModeSpec:
    """One measured configuration: a mode and, for the recompute modes, its K or R
    (None: the server's default, ``--pcr-doc-recompute-tokens`` / ``-ratio``)."""

    mode: str
    value: Optional[float] = None
    anchors: Optional[int] = None  # blend: each re-placed document's first tokens recomputed first
    selector: Optional[str] = None  # blend: one of SELECTORS (None: the server's)

    @property
    def name(self) -> str:
        if self.value is None:
            return self.mode
        name = f"{self.mode}:{int(self.value) if self.mode == 'lego' else self.value:g}"
        if self.anchors is not None:
            name += f":{self.anchors}"
        return f"{name}:{self.selector}" if self.selector else name

    def recomputed_if_all_reused(self, doc_bounds: Sequence[int]) -> int:
        """Tokens this spec recomputes in a prompt whose documents are all reused: every
        document but the first is re-placed (the first sits where its canonical KV was
        computed); the server's rule (``core.doc_reuse.with_recompute``)."""
        from pcr_sglang.flags import DEFAULT_DOC_RECOMPUTE_RATIO, DEFAULT_DOC_RECOMPUTE_TOKENS

        lengths = [end - start for start, end in zip(doc_bounds[2::2], doc_bounds[3::2])]
        if self.mode == "lego":
            k = int(self.value if self.value is not None else DEFAULT_DOC_RECOMPUTE_TOKENS)
            return sum(min(k, n) for n in lengths)
        if self.mode == "blend":
            r = float(self.value if self.value is not None else DEFAULT_DOC_RECOMPUTE_RATIO)
            return min(sum(lengths), int(round(r * sum(lengths))))
        return 0  # concat; reorder (exact: nothing re-placed, nothing recomputed)

    def custom_params(self) -> dict[str, Any]:
        from pcr_sglang.reuse.bounds import (
            ANCHOR_TOKENS_PARAM,
            DOC_MODE_PARAM,
            RECOMPUTE_RATIO_PARAM,
            RECOMPUTE_TOKENS_PARAM,
            SELECTOR_PARAM,
        )

        params: dict[str, Any] = {DOC_MODE_PARAM: self.mode}
        if self.anchors is not None:
            params[ANCHOR_TOKENS_PARAM] = int(self.anchors)
        if self.selector is not None:
            params[SELECTOR_PARAM] = self.selector
        if self.value is not None:
            if self.mode == "lego":
                params[RECOMPUTE_TOKENS_PARAM] = int(self.value)
            else:
                params[RECOMPUTE_RATIO_PARAM] = float(self.value)
        return params


def parse_mode(text: str) -> ModeSpec:
    name, _, value = text.strip().partition(":")
    if name not in MODES:
        raise argparse.ArgumentTypeError(
            f"unknown mode {name!r}; known: {', '.join(MODES)} (lego:K and blend:R set the recompute)"
        )
    if not value:
        return ModeSpec(name)
    if name in ("concat", "reorder"):
        raise argparse.ArgumentTypeError(f"{name} recomputes nothing: it takes no :value")
    anchors: Optional[int] = None
    selector: Optional[str] = None
    if name == "blend" and ":" in value:
        value, *extras = value.split(":")
        for extra in extras:
            if extra in SELECTORS and selector is None:
                selector = extra
            elif extra.isdigit() and anchors is None:
                anchors = int(extra)
            else:
                raise argparse.ArgumentTypeError(
                    f"blend:{value}:{extra}: expected anchor tokens A (an integer >= 0) or a selector "
                    f"({', '.join(SELECTORS)})"
                )
    try:
        number = int(value) if name == "lego" else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{name}:{value}: expected {'an integer K' if name == 'lego' else 'a ratio R'}"
        ) from None
    if (name == "lego" and number < 0) or (name == "blend" and not 0.0 <= number <= 1.0):
        raise argparse.ArgumentTypeError(
            f"{name}:{value}: {'K must be >= 0' if name == 'lego' else 'R must be in [0, 1]'}"
        )
    return ModeSpec(name, number, anchors, selector)


def parse_modes(text: str) -> tuple[ModeSpec, ...]:
    """``--modes``: comma-separated ``concat``, ``lego[:K]``, ``blend[:R[:A][:S]]`` (A: anchor
    tokens, each re-placed document's first A recomputed first; S: the selector of the
    rest, one of ``SELECTORS``)."""
    specs = tuple(dict.fromkeys(parse_mode(n) for n in text.split(",") if n.strip()))
    if not specs:
        raise argparse.ArgumentTypeError(f"expected at least one mode; known: {', '.join(MODES)}")
    return specs
