"""Document reuse's settings, built from :class:`~pcr_sglang.config.PCRConfig`.

``config.py`` parses and validates the flags and imports no feature; each feature builds
its own settings from it. These are document reuse's: the server's mode with its K and R
(a calibration's value where one is given), what one request may mark, when a marked
document is warmed, and the calibration's verdict for the server's mode.
"""

from __future__ import annotations

import functools
from typing import Optional

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.reuse.bounds import EXACT_MODES, DocLimits, Recompute
from pcr_sglang.reuse.calibration import CalibrationError, DocReuseCalibration, ModeCalibration
from pcr_sglang.reuse.gate import CalibrationGate
from pcr_sglang.reuse.warmup import WarmupPolicy


def recompute(config: PCRConfig) -> Recompute:
    """The server's document-reuse mode with its K and R (requests may override them);
    with a calibration, the K or R it found for the mode, and the gate that holds requests
    to it (each call builds a new gate: the scheduler keeps the one its DocReuse holds)."""
    tokens, ratio = config.doc_recompute_tokens, float(config.doc_recompute_ratio)
    verdict = calibration_verdict(config)
    if verdict is not None and verdict.value is not None:
        if config.doc_reuse == "lego":
            tokens = int(verdict.value)
        elif config.doc_reuse == "blend":
            ratio = float(verdict.value)
    found = calibration(config) if verdict is not None else None
    gate = None
    if found is not None and verdict is not None and config.doc_reuse_calibration:
        gate = CalibrationGate(
            config.doc_reuse_calibration,
            found.model_fingerprint,
            config.doc_reuse,
            int(tokens),
            ratio,
            found.conditions.selector,
            found.conditions.anchor_tokens,
            warn=config.doc_reuse_calibration_warn,
            meets=verdict.meets,
        )
    return Recompute(config.doc_reuse, tokens, ratio, config.doc_anchor_tokens, config.doc_selector, gate=gate)


def calibration(config: PCRConfig) -> Optional[DocReuseCalibration]:
    """The ``--pcr-doc-reuse-calibration`` file, read once per process (None without it)."""
    if not config.doc_reuse_calibration:
        return None
    try:
        return _load_calibration(config.doc_reuse_calibration)
    except CalibrationError as e:
        raise PCRConfigError(f"--pcr-doc-reuse-calibration: {e}") from None


def calibration_verdict(config: PCRConfig) -> Optional[ModeCalibration]:
    """The calibration's verdict for the server's mode (None without a calibration)."""
    found = calibration(config)
    if found is None or config.doc_reuse in EXACT_MODES:
        return None  # nothing approximated: nothing for a calibration to vouch for
    verdict = found.modes.get(config.doc_reuse)
    if verdict is None:
        raise PCRConfigError(
            f"--pcr-doc-reuse-calibration {config.doc_reuse_calibration} has no measurement of "
            f"--pcr-doc-reuse {config.doc_reuse} (it has {', '.join(found.modes) or 'none'})"
        )
    return verdict


def limits(config: PCRConfig) -> DocLimits:
    """What one request may mark (``--pcr-doc-max-documents``, ``--pcr-doc-min-tokens``)."""
    return DocLimits(config.doc_max_documents, config.doc_min_tokens)


def warmup_policy(config: PCRConfig) -> WarmupPolicy:
    """When a marked document's canonical KV is computed (:mod:`pcr_sglang.reuse.warmup`)."""
    return WarmupPolicy(config.doc_warmup, config.doc_warmup_after)


def validate(config: PCRConfig) -> None:
    """What :meth:`PCRConfig.validate` cannot check without the feature: a calibration file
    that cannot be read, or lacks the server's mode, fails at flag resolution."""
    calibration_verdict(config)


@functools.lru_cache(maxsize=4)
def _load_calibration(path: str) -> DocReuseCalibration:
    return DocReuseCalibration.load(path)
