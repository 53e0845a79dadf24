"""The per-model accuracy gate: the calibration file, what PCRConfig takes from it, and the
server's verdict at startup (pcr_sglang.reuse.calibration, config, doc_reuse_setup)."""

from __future__ import annotations

import json
import logging

import pytest

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.reuse import settings as reuse_settings
from pcr_sglang.reuse.calibration import (
    CalibrationConditions,
    CalibrationError,
    CalibrationTarget,
    DocReuseCalibration,
    SettingResult,
    smallest_meeting,
)
from pcr_sglang.reuse.setup import calibration_status

FINGERPRINT = "f" * 32


def _calibration(blend_meets: bool = True) -> DocReuseCalibration:
    blend = [SettingResult(0.15, 0.71, 0.80, 0.3, False), SettingResult(0.5, 0.93, 0.97, 0.05, blend_meets)]
    return DocReuseCalibration(FINGERPRINT, "SmolLM2", CalibrationTarget(0.9, 0.95), 24, {
        "concat": smallest_meeting("concat", [SettingResult(None, 0.6, 0.7, 0.5, False)]),
        "blend": smallest_meeting("blend", blend)}, created="2026-12-04T20:00:00",
        conditions=CalibrationConditions("deviation", 0, "float32"))


def _write(tmp_path, calibration: DocReuseCalibration):
    path = tmp_path / "calibration.json"
    path.write_text(calibration.to_json())
    return str(path)


def test_the_file_round_trips_and_keeps_the_smallest_setting_that_met_the_target(tmp_path):
    calibration = _calibration()
    loaded = DocReuseCalibration.load(_write(tmp_path, calibration))
    assert loaded == calibration
    assert loaded.modes["blend"].meets and loaded.modes["blend"].value == 0.5
    assert not loaded.modes["concat"].meets and loaded.modes["concat"].value is None


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    (json.dumps({"version": 9}), "version 9"),
    (json.dumps({"version": 2, "modes": {}}), "malformed"),
    (json.dumps({"version": 1, "model_fingerprint": "x", "target": {}, "questions": 1, "modes": {}}),
     "version 1, expected 2"),
    (json.dumps({"version": 2, "model_fingerprint": "x", "target": {}, "questions": 1,
                 "modes": {"mosaic": {"meets": True}}}), "unknown mode"),
    (json.dumps({"version": 2, "model_fingerprint": "x", "target": {}, "questions": 1, "modes": {}}), "malformed"),
    (json.dumps({"version": 2, "model_fingerprint": "x", "target": {}, "questions": 1, "modes": {},
                 "conditions": {"selector": "deviation", "anchor_tokens": 0}}), "must name selector"),
    (json.dumps({"version": 2, "model_fingerprint": "x", "target": {}, "questions": 1, "modes": {},
                 "conditions": {"selector": "deviation", "anchor_tokens": -1, "kv_dtype": "float32"}}),
     "anchor_tokens must be an integer"),
])
def test_bad_files_are_refused_naming_the_problem(tmp_path, content, message):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(CalibrationError, match=message):
        DocReuseCalibration.load(path)
    with pytest.raises(CalibrationError, match="cannot read"):
        DocReuseCalibration.load(tmp_path / "missing.json")


def test_the_server_takes_the_calibrated_r_and_refuses_what_it_cannot_use(tmp_path):
    path = _write(tmp_path, _calibration())
    config = PCRConfig(enabled=True, doc_reuse="blend", doc_recompute_ratio=0.15, doc_reuse_calibration=path)
    config.validate(page_size=1)
    assert reuse_settings.recompute(config).ratio == 0.5
    with pytest.raises(PCRConfigError, match="has no measurement of --pcr-doc-reuse lego"):
        reuse_settings.validate(PCRConfig(enabled=True, doc_reuse="lego", doc_reuse_calibration=path))
    with pytest.raises(PCRConfigError, match="needs --pcr-doc-reuse"):
        PCRConfig(enabled=True, doc_reuse_calibration=path).validate(page_size=1)
    with pytest.raises(PCRConfigError, match="--pcr-doc-reuse-calibration: cannot read"):
        missing = str(tmp_path / "nope")
        reuse_settings.validate(PCRConfig(enabled=True, doc_reuse="blend", doc_reuse_calibration=missing))


def test_a_calibration_measured_under_other_conditions_is_refused(tmp_path):
    """The verdict holds for the selector, anchors and KV dtype it was measured under only."""
    path = _write(tmp_path, _calibration())
    blend = PCRConfig(enabled=True, doc_reuse="blend", doc_reuse_calibration=path)
    same = CalibrationConditions("deviation", 0, "float32")
    assert calibration_status(blend, FINGERPRINT, same)["conditions"] == {
        "selector": "deviation", "anchor_tokens": 0, "kv_dtype": "float32"}
    for other, named in ((CalibrationConditions("query", 0, "float32"), "selector 'deviation'"),
                         (CalibrationConditions("deviation", 8, "float32"), "anchor_tokens 0"),
                         (CalibrationConditions("deviation", 0, "bfloat16"), "kv_dtype 'float32'")):
        with pytest.raises(PCRConfigError, match=f"other conditions: {named}"):
            calibration_status(blend, FINGERPRINT, other)


def test_startup_verdicts(tmp_path, caplog):
    path = _write(tmp_path, _calibration())
    blend = PCRConfig(enabled=True, doc_reuse="blend", doc_reuse_calibration=path)
    status = calibration_status(blend, FINGERPRINT)
    assert status["meets_target"] and status["value"] == 0.5 and status["target"]["top1_min"] == 0.9
    with pytest.raises(PCRConfigError, match="measured on other weights"):
        calibration_status(blend, "0" * 32)
    concat = PCRConfig(enabled=True, doc_reuse="concat", doc_reuse_calibration=path)
    with pytest.raises(PCRConfigError, match="missed its accuracy target.*--pcr-doc-reuse-calibration-warn"):
        calibration_status(concat, FINGERPRINT)
    warned = PCRConfig(enabled=True, doc_reuse="concat", doc_reuse_calibration=path, doc_reuse_calibration_warn=True)
    with caplog.at_level(logging.WARNING, logger="pcr_sglang.reuse.setup"):
        assert calibration_status(warned, FINGERPRINT)["meets_target"] is False
        assert "MISSED its accuracy target" in caplog.text
        caplog.clear()
        unmeasured = calibration_status(PCRConfig(enabled=True, doc_reuse="blend"), FINGERPRINT)
    assert unmeasured == {"file": None, "measured": False}
    assert "accuracy on this model is unmeasured" in caplog.text


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["modes"]["concat"].update(meets="true"), "modes.concat.meets must be true or false"),
    (lambda raw: raw["modes"]["blend"].update(value=1.5), r"modes.blend.value must be a number in \[0, 1\]"),
    (lambda raw: raw["modes"]["blend"].update(value=float("nan")), r"modes.blend.value must be a number in \[0, 1\]"),
    (lambda raw: raw["modes"].update(lego={"meets": True, "value": -4}), "modes.lego.value must be an integer K"),
    (lambda raw: raw["target"].update(top1_min="0.9"), r"target.top1_min must be a number in \[0, 1\]"),
    (lambda raw: raw.update(questions=0), "questions must be a positive integer"),
])
def test_values_a_hand_edit_could_break_are_refused(tmp_path, edit, message):
    """Review: ``"meets": "false"`` read as True passed the gate; an R of 1.5 started the
    server and then failed every marked request; a string target crashed startup."""
    raw = json.loads(_calibration().to_json())
    edit(raw)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(CalibrationError, match=message):
        DocReuseCalibration.load(path)
