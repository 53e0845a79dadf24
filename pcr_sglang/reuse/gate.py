"""The calibration gate for every request: with ``--pcr-doc-reuse-calibration``, what a
marked request may ask for in its ``custom_params``.

The calibration file vouches for one mode (the server's), at its K or R, under blend's
selector and anchor tokens, on the weights it was measured on. A request may ask for less
recompute (``pcr_doc_recompute_ratio: 0`` is concat under another name), another mode,
another selector or other anchors, none of which the file measured. So the gate compares
each request with what was calibrated: the same mode, at least the calibrated K (``lego``)
or R (``blend``), and for ``blend`` the same selector and anchor tokens. The exact modes
(``bounds.EXACT_MODES``: ``off``, ``reorder``) are always allowed. A request outside it is
refused (HTTP 400 at the tokenizer; a request that reaches the scheduler anyway is served
without document reuse), or, with
``--pcr-doc-reuse-calibration-warn``, served and counted by what it overrode
(``sglang:pcr_doc_reuse_calibration_overrides_total``, ``/server_info``).

After a weight update in place the gate is checked again (:func:`pcr_sglang.reuse.setup.recheck_calibration`):
on weights other than the file's, document reuse stops until they are back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from pcr_sglang.reuse.bounds import (
    ANCHOR_TOKENS_PARAM,
    DOC_MODE_PARAM,
    EXACT_MODES,
    RECOMPUTE_RATIO_PARAM,
    RECOMPUTE_TOKENS_PARAM,
    SELECTOR_PARAM,
    DocBoundsError,
)

if TYPE_CHECKING:
    from pcr_sglang.reuse.bounds import Recompute

# What a request can override, the ``what`` label of the overrides metric.
OVERRIDES = ("mode", "recompute_tokens", "recompute_ratio", "selector", "anchor_tokens")


@dataclass(eq=False)
class CalibrationGate:
    """What the calibration allows on this server, and (mutable, in the scheduler's copy)
    whether it still applies and what ``warn`` let through."""

    file: str  # --pcr-doc-reuse-calibration
    fingerprint: str  # the weights it was measured on
    mode: str  # the server's mode, the one it vouches for
    tokens: int  # lego: the least K allowed
    ratio: float  # blend: the least R allowed
    selector: str
    anchor_tokens: int
    warn: bool = False  # --pcr-doc-reuse-calibration-warn: serve and count instead of refusing
    meets: Optional[bool] = None  # the file's verdict on the mode (for /server_info)
    # Why document reuse is stopped (the weights changed to ones it was not measured on).
    stopped: Optional[str] = None
    overrides: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OVERRIDES, 0))

    def differences(self, asked: "Recompute") -> list[tuple[str, str]]:
        """``(what, the request's setting)`` for each way ``asked`` leaves the calibration."""
        if asked.mode != self.mode:
            return [("mode", f"{DOC_MODE_PARAM}={asked.mode!r}")]
        out = []
        if asked.mode == "lego" and asked.tokens < self.tokens:
            out.append(("recompute_tokens", f"{RECOMPUTE_TOKENS_PARAM}={asked.tokens}"))
        if asked.mode == "blend":
            if asked.ratio < self.ratio:
                out.append(("recompute_ratio", f"{RECOMPUTE_RATIO_PARAM}={asked.ratio:g}"))
            if asked.selector != self.selector:
                out.append(("selector", f"{SELECTOR_PARAM}={asked.selector!r}"))
            if asked.anchor_tokens != self.anchor_tokens:
                out.append(("anchor_tokens", f"{ANCHOR_TOKENS_PARAM}={asked.anchor_tokens}"))
        return out

    def allows(self) -> str:
        """What a request may ask for, in its parameters' names."""
        parts = [f"{DOC_MODE_PARAM} {self.mode!r} (or {' or '.join(map(repr, EXACT_MODES))})"]
        if self.mode == "lego":
            parts.append(f"{RECOMPUTE_TOKENS_PARAM} >= {self.tokens}")
        if self.mode == "blend":
            parts += [
                f"{RECOMPUTE_RATIO_PARAM} >= {self.ratio:g}",
                f"{SELECTOR_PARAM} {self.selector!r}",
                f"{ANCHOR_TOKENS_PARAM} {self.anchor_tokens}",
            ]
        return ", ".join(parts)

    def check(self, asked: "Recompute", record: bool = False) -> None:
        """Raise :class:`DocBoundsError` for a request outside the calibration (naming the
        file and what it allows), unless ``warn``; then, with ``record`` (the scheduler,
        once per request), count what it overrode."""
        differences = self.differences(asked)
        if not differences:
            return
        if not self.warn:
            raise DocBoundsError(
                f"{', '.join(setting for _, setting in differences)}: outside this server's "
                f"calibration {Path(self.file).name} (--pcr-doc-reuse-calibration), which "
                f"allows {self.allows()}"
            )
        if record:
            for what, _ in differences:
                self.overrides[what] += 1
