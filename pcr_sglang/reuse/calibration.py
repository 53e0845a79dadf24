"""A per-model accuracy gate for document reuse: what ``python -m pcr_tools.calibrate``
measured on one model, and what the server does with it (``--pcr-doc-reuse-calibration``).

Document reuse changes answers, by an amount that depends on the model (a fine-tuned one
loses little, a small general one a lot). The calibration file records, for the weights it
was measured on (their fingerprint), each mode's fidelity and gold-answer ratio against
full prefill on a question sample, the target it was held to, the conditions it was served
under (blend's selector and anchor tokens, the KV dtype), and the smallest K (``lego``) or
R (``blend``) that met it. A server started with the file uses that K or R and refuses
a mode that missed the target (or, with ``--pcr-doc-reuse-calibration-warn``, serves it and
says so in its startup log and ``/server_info``). The file is plain JSON, written once per
model, reviewed like any config.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from pcr_sglang.reuse.bounds import DEFAULT_SELECTOR

CALIBRATION_VERSION = 2  # 2: the serving conditions are recorded
CALIBRATED_MODES = ("concat", "lego", "blend")


class CalibrationError(ValueError):
    """A calibration file that cannot be used (missing, malformed, another version)."""


@dataclass(frozen=True)
class CalibrationTarget:
    """What a mode must reach against full prefill: teacher-forced top-1 agreement along
    full prefill's answers, and the gold-answer score as a share of full prefill's."""

    top1_min: float = 0.90
    gold_ratio_min: float = 0.95

    def met_by(self, top1: Optional[float], gold_ratio: Optional[float]) -> bool:
        """Whether a setting's figures meet the target (no gold ratio: full prefill scored
        nothing, so the gold part holds). The one rule the calibration and the file's reader
        share: a file's ``meets`` is checked against it."""
        return top1 is not None and top1 >= self.top1_min and (gold_ratio is None or gold_ratio >= self.gold_ratio_min)


@dataclass(frozen=True)
class CalibrationConditions:
    """What else than K or R changes a reused answer, as the calibrated server ran it. A
    server started under other conditions refuses the file: its verdict would not hold."""

    selector: str = DEFAULT_SELECTOR  # blend's ranking (--pcr-doc-selector)
    anchor_tokens: int = 0  # blend's first tokens of each document (--pcr-doc-anchor-tokens)
    kv_dtype: str = "float32"  # the KV pool's dtype: re-placement rotates K in it

    def differences(self, other: "CalibrationConditions") -> list[str]:
        """``name: file's vs other's`` for each condition that differs."""
        return [
            f"{name} {getattr(self, name)!r} (this server: {getattr(other, name)!r})"
            for name in ("selector", "anchor_tokens", "kv_dtype")
            if getattr(self, name) != getattr(other, name)
        ]

    @classmethod
    def from_dict(cls, raw: Any) -> "CalibrationConditions":
        if not isinstance(raw, dict) or set(raw) != {"selector", "anchor_tokens", "kv_dtype"}:
            raise CalibrationError(f"conditions must name selector, anchor_tokens and kv_dtype, got {raw!r}")
        selector, anchors, dtype = raw["selector"], raw["anchor_tokens"], raw["kv_dtype"]
        if not isinstance(selector, str) or not selector:
            raise CalibrationError(f"conditions.selector must be a name, got {selector!r}")
        if isinstance(anchors, bool) or not isinstance(anchors, int) or anchors < 0:
            raise CalibrationError(f"conditions.anchor_tokens must be an integer >= 0, got {anchors!r}")
        if not isinstance(dtype, str) or not dtype:
            raise CalibrationError(f"conditions.kv_dtype must be a dtype name, got {dtype!r}")
        return cls(selector, anchors, dtype)


@dataclass(frozen=True)
class SettingResult:
    setting: Optional[float]  # K for lego, R for blend, None for concat
    top1: Optional[float]
    gold_ratio: Optional[float]
    kl: Optional[float]
    meets: bool


@dataclass(frozen=True)
class ModeCalibration:
    """One mode's verdict: ``value`` is the smallest K or R measured that met the target
    (None for concat, or when none did); ``meets`` whether the mode can meet it at all."""

    mode: str
    meets: bool
    value: Optional[float]
    measured: tuple[SettingResult, ...] = ()


@dataclass(frozen=True)
class DocReuseCalibration:
    model_fingerprint: str
    model: str
    target: CalibrationTarget
    questions: int
    modes: dict[str, ModeCalibration] = field(default_factory=dict)
    conditions: CalibrationConditions = field(default_factory=CalibrationConditions)
    created: str = ""
    version: int = CALIBRATION_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, raw: Any) -> "DocReuseCalibration":
        """The file's content, checked: each ``meets`` and ``value`` is recomputed from the
        ``measured`` figures and the ``target``, and a file that disagrees is refused (a
        hand edit or a bad merge must not open the gate)."""
        try:
            if raw.get("version") != CALIBRATION_VERSION:
                raise CalibrationError(f"version {raw.get('version')!r}, expected {CALIBRATION_VERSION}")
            target = CalibrationTarget(**{k: _share(v, f"target.{k}") for k, v in dict(raw["target"]).items()})
            modes = {}
            for name, entry in dict(raw["modes"]).items():
                if name not in CALIBRATED_MODES:
                    raise CalibrationError(f"unknown mode {name!r}")
                written = ModeCalibration(
                    name,
                    _flag(entry["meets"], f"modes.{name}.meets"),
                    _setting(name, entry.get("value")),
                    _measured(name, entry.get("measured", ()), target),
                )
                # mutant: calibration-file-verdicts-trusted-as-written
                modes[name] = _consistent(written, target)
            questions = raw["questions"]
            if isinstance(questions, bool) or not isinstance(questions, int) or questions < 1:
                raise CalibrationError(f"questions must be a positive integer, got {questions!r}")
            fingerprint = raw["model_fingerprint"]
            if not isinstance(fingerprint, str) or not fingerprint:
                raise CalibrationError(f"model_fingerprint must be a non-empty string, got {fingerprint!r}")
            conditions = CalibrationConditions.from_dict(raw["conditions"])
            return cls(
                model_fingerprint=fingerprint,
                model=str(raw.get("model", "")),
                target=target,
                questions=questions,
                modes=modes,
                conditions=conditions,
                created=str(raw.get("created", "")),
            )
        except CalibrationError:
            raise
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"malformed: {type(e).__name__}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "DocReuseCalibration":
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise CalibrationError(f"cannot read {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path} is not JSON: {e}") from None
        try:
            return cls.from_dict(raw)
        except CalibrationError as e:
            raise CalibrationError(f"{path}: {e}") from None


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):  # "false" is truthy: a hand-edited file must not pass the gate by it
        raise CalibrationError(f"{where} must be true or false, got {value!r}")
    return value


def _share(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise CalibrationError(f"{where} must be a number in [0, 1], got {value!r}")
    return float(value)


def _setting(mode: str, value: Any, where: str = "") -> Optional[float]:
    """A mode's calibrated K (lego: an integer >= 0) or R (blend: in [0, 1]); concat has none."""
    where = where or f"modes.{mode}.value"
    if value is None:
        return None
    if mode == "concat":
        raise CalibrationError(f"{where} must be null (concat recomputes nothing), got {value!r}")
    if mode == "lego":
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 <= value < float("inf")
            or float(value) != int(value)
        ):
            raise CalibrationError(f"{where} must be an integer K >= 0, got {value!r}")
        return float(value)
    return _share(value, where)


def _figure(value: Any, where: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value) >= 0.0:
        raise CalibrationError(f"{where} must be a number >= 0 or null, got {value!r}")
    return float(value)


def _measured(mode: str, raw: Any, target: CalibrationTarget) -> tuple[SettingResult, ...]:
    """A mode's measured settings, each ``meets`` checked against its figures and the target."""
    if not isinstance(raw, (list, tuple)):
        raise CalibrationError(f"modes.{mode}.measured must be a list, got {type(raw).__name__}")
    results = []
    for i, entry in enumerate(raw):
        where = f"modes.{mode}.measured[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"setting", "top1", "gold_ratio", "kl", "meets"}:
            raise CalibrationError(f"{where} must name setting, top1, gold_ratio, kl and meets, got {entry!r}")
        result = SettingResult(
            _setting(mode, entry["setting"], f"{where}.setting"),
            _figure(entry["top1"], f"{where}.top1"),
            _figure(entry["gold_ratio"], f"{where}.gold_ratio"),
            _figure(entry["kl"], f"{where}.kl"),
            _flag(entry["meets"], f"{where}.meets"),
        )
        if mode != "concat" and result.setting is None:
            raise CalibrationError(f"{where}.setting must be the K or R measured, got null")
        if result.meets != target.met_by(result.top1, result.gold_ratio):
            raise CalibrationError(
                f"{where} says meets {str(result.meets).lower()}, but top-1 {result.top1} and gold ratio "
                f"{result.gold_ratio} {'meet' if not result.meets else 'miss'} the target (top-1 >= "
                f"{target.top1_min}, gold ratio >= {target.gold_ratio_min})"
            )
        results.append(result)
    return tuple(results)


def _consistent(written: ModeCalibration, target: CalibrationTarget) -> ModeCalibration:
    """``written`` if its ``meets`` and ``value`` are what its measured settings give."""
    derived = smallest_meeting(written.mode, list(written.measured))
    if (written.meets, written.value) != (derived.meets, derived.value):

        def said(verdict: ModeCalibration) -> str:
            return f"meets {str(verdict.meets).lower()}, value {verdict.value}"

        raise CalibrationError(
            f"modes.{written.mode} says {said(written)}, but its measured settings give "
            f"{said(derived)} (the smallest setting measured that met the target)"
        )
    return written


def smallest_meeting(mode: str, results: list[SettingResult]) -> ModeCalibration:
    """The verdict from a mode's measured settings: the smallest setting that met the target."""
    met = sorted((r for r in results if r.meets), key=lambda r: (r.setting is not None, r.setting or 0.0))
    value = met[0].setting if met else None
    return ModeCalibration(mode, bool(met), value, tuple(results))
