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
    return DocReuseCalibration(
        FINGERPRINT,
        "SmolLM2",
        CalibrationTarget(0.9, 0.95),
        24,
        {
            "concat": smallest_meeting("concat", [SettingResult(None, 0.6, 0.7, 0.5, False)]),
            "blend": smallest_meeting("blend", blend),
        },
        created="2026-12-04T20:00:00",
        conditions=CalibrationConditions("deviation", 0, "float32"),
    )


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


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json", "is not JSON"),
        (json.dumps({"version": 9}), "version 9"),
        (json.dumps({"version": 2, "modes": {}}), "malformed"),
        (
            json.dumps({"version": 1, "model_fingerprint": "x", "target": {}, "questions": 1, "modes": {}}),
            "version 1, expected 2",
        ),
        (
            json.dumps(
                {
                    "version": 2,
                    "model_fingerprint": "x",
                    "target": {},
                    "questions": 1,
                    "modes": {"mosaic": {"meets": True}},
                }
            ),
            "unknown mode",
        ),
        (json.dumps({"version": 2, "model_fingerprint": "x", "target": {}, "questions": 1, "modes": {}}), "malformed"),
        (
            json.dumps(
                {
                    "version": 2,
                    "model_fingerprint": "x",
                    "target": {},
                    "questions": 1,
                    "modes": {},
                    "conditions": {"selector": "deviation", "anchor_tokens": 0},
                }
            ),
            "must name selector",
        ),
        (
            json.dumps(
                {
                    "version": 2,
                    "model_fingerprint": "x",
                    "target": {},
                    "questions": 1,
                    "modes": {},
                    "conditions": {"selector": "deviation", "anchor_tokens": -1, "kv_dtype": "float32"},
                }
            ),
            "anchor_tokens must be an integer",
        ),
    ],
)
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
        "selector": "deviation",
        "anchor_tokens": 0,
        "kv_dtype": "float32",
    }
    for other, named in (
        (CalibrationConditions("query", 0, "float32"), "selector 'deviation'"),
        (CalibrationConditions("deviation", 8, "float32"), "anchor_tokens 0"),
        (CalibrationConditions("deviation", 0, "bfloat16"), "kv_dtype 'float32'"),
    ):
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


def _edited_file(tmp_path, edit):
    """The committed-shape calibration with ``edit`` applied to its JSON, written to a file."""
    raw = json.loads(_calibration().to_json())
    edit(raw)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda raw: raw["modes"]["concat"].update(meets="true"), "modes.concat.meets must be true or false"),
        (lambda raw: raw["modes"]["blend"].update(value=1.5), r"modes.blend.value must be a number in \[0, 1\]"),
        (
            lambda raw: raw["modes"]["blend"].update(value=float("nan")),
            r"modes.blend.value must be a number in \[0, 1\]",
        ),
        (lambda raw: raw["modes"].update(lego={"meets": True, "value": -4}), "modes.lego.value must be an integer K"),
        (lambda raw: raw["target"].update(top1_min="0.9"), r"target.top1_min must be a number in \[0, 1\]"),
        (lambda raw: raw.update(questions=0), "questions must be a positive integer"),
    ],
)
def test_values_a_hand_edit_could_break_are_refused(tmp_path, edit, message):
    """Review: ``"meets": "false"`` read as True passed the gate; an R of 1.5 started the
    server and then failed every marked request; a string target crashed startup."""
    with pytest.raises(CalibrationError, match=message):
        DocReuseCalibration.load(_edited_file(tmp_path, edit))


@pytest.mark.parametrize(
    "edit, message",
    [
        # A mode that missed says it met (review N11: "meets": true passed the gate).
        (
            lambda raw: raw["modes"]["concat"].update(meets=True),
            r"modes.concat says meets true, value None, but its measured settings give meets false",
        ),
        # A value that was measured but did not meet the target (0.15 missed; 0.5 met).
        (
            lambda raw: raw["modes"]["blend"].update(value=0.15),
            r"modes.blend says meets true, value 0.15, but its measured settings give meets true, value 0.5",
        ),
        # A value that was never measured.
        (lambda raw: raw["modes"]["blend"].update(value=0.01), "value 0.01, but its measured settings give"),
        # A setting's own verdict against its figures and the target.
        (
            lambda raw: raw["modes"]["blend"]["measured"][0].update(meets=True),
            r"modes.blend.measured\[0\] says meets true, but top-1 0.71 and gold ratio 0.8 miss the target",
        ),
        (
            lambda raw: raw["target"].update(top1_min=0.95),
            r"modes.blend.measured\[1\] says meets true, but top-1 0.93 .* miss the target \(top-1 >= 0.95",
        ),
        # A mode that met with nothing measured to show it.
        (
            lambda raw: raw["modes"].update(lego={"mode": "lego", "meets": True, "value": 16, "measured": []}),
            "modes.lego says meets true, value 16.0, but its measured settings give meets false, value None",
        ),
        (lambda raw: raw["modes"]["blend"]["measured"][1].update(top1=None), "says meets true, but top-1 None"),
        (lambda raw: raw["modes"]["blend"]["measured"][1].update(setting=None), r"measured\[1\].setting must be"),
        (lambda raw: raw["modes"]["blend"]["measured"][1].update(top1="0.93"), r"measured\[1\].top1 must be a number"),
        (lambda raw: raw["modes"]["blend"]["measured"][1].pop("kl"), r"measured\[1\] must name setting"),
    ],
)
def test_a_file_whose_verdicts_disagree_with_its_measurements_is_refused(tmp_path, edit, message):
    """Review N11: the server trusted ``meets`` and ``value`` as written; they are recomputed
    from ``measured`` and ``target`` when the file is read."""
    with pytest.raises(CalibrationError, match=message):
        DocReuseCalibration.load(_edited_file(tmp_path, edit))


def test_the_committed_calibrations_agree_with_their_measurements():
    """Every committed file loads (its verdicts are what its figures give)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[3] / "pcr_tools" / "models" / "calibrations"
    files = sorted(folder.glob("*.json"))
    assert files
    for path in files:
        calibration = DocReuseCalibration.load(path)
        for verdict in calibration.modes.values():
            assert verdict == smallest_meeting(verdict.mode, list(verdict.measured))


# ---------------------------------------------------------------- the gate for every request (review N4)
COMMITTED = "pcr_tools/models/calibrations/smollm2-135m-doc-reuse.json"  # blend R=0.15, lego K=16, gradual


def _server(mode: str = "blend", warn: bool = False, path: str = COMMITTED):
    from pathlib import Path

    file = str(Path(__file__).resolve().parents[3] / path) if path == COMMITTED else path
    return reuse_settings.recompute(
        PCRConfig(
            enabled=True, chunk_size=32, doc_reuse=mode, doc_reuse_calibration=file, doc_reuse_calibration_warn=warn
        )
    )


@pytest.mark.parametrize(
    "asked, named",
    [
        ({"pcr_doc_reuse": "concat"}, "pcr_doc_reuse='concat'"),
        ({"pcr_doc_reuse": "lego", "pcr_doc_recompute_tokens": 64}, "pcr_doc_reuse='lego'"),
        ({"pcr_doc_recompute_ratio": 0.0}, "pcr_doc_recompute_ratio=0"),
        ({"pcr_doc_recompute_ratio": 0.14}, "pcr_doc_recompute_ratio=0.14"),
        (
            {"pcr_doc_selector": "deviation", "pcr_doc_recompute_ratio": 0.01},
            "pcr_doc_recompute_ratio=0.01, pcr_doc_selector='deviation'",
        ),
        ({"pcr_doc_anchor_tokens": 4}, "pcr_doc_anchor_tokens=4"),
    ],
)
def test_a_request_outside_the_calibration_is_refused_naming_it(asked, named):
    """Review N4 (its repro): the gate judged only the server's mode; a request could ask
    for concat, R=0 or another selector and be served in it."""
    from pcr_sglang.reuse.bounds import DocBoundsError, request_recompute

    server = _server()
    assert (server.mode, server.ratio, server.selector) == ("blend", 0.15, "gradual")
    with pytest.raises(DocBoundsError) as refused:
        request_recompute(asked, server)
    message = str(refused.value)
    assert message.startswith(named + ": outside this server's calibration smollm2-135m-doc-reuse.json")
    assert message.endswith(
        "allows pcr_doc_reuse 'blend' (or 'off' or 'reorder'), pcr_doc_recompute_ratio >= 0.15, "
        "pcr_doc_selector 'gradual', pcr_doc_anchor_tokens 0"
    )


def test_what_the_calibration_allows_is_served():
    from pcr_sglang.reuse.bounds import Recompute, request_recompute

    server = _server()
    assert request_recompute({}, server) == Recompute("blend", server.tokens, 0.15, 0, "gradual")
    assert request_recompute({"pcr_doc_recompute_ratio": 0.5}, server).ratio == 0.5  # more recompute
    assert request_recompute({"pcr_doc_recompute_tokens": 0}, server).mode == "blend"  # not blend's knob
    assert request_recompute({"pcr_doc_reuse": "off"}, server) is None  # exact
    assert request_recompute({"pcr_doc_reuse": "reorder"}, server) is None  # exact too
    lego = _server("lego")
    assert request_recompute({"pcr_doc_recompute_tokens": 32}, lego).tokens == 32
    assert request_recompute({"pcr_doc_selector": "query"}, lego).mode == "lego"  # not lego's knob
    from pcr_sglang.reuse.bounds import DocBoundsError

    for asked in ({"pcr_doc_recompute_tokens": 8}, {"pcr_doc_reuse": "blend", "pcr_doc_recompute_ratio": 1.0}):
        with pytest.raises(
            DocBoundsError,
            match="allows pcr_doc_reuse 'lego' \\(or 'off' or 'reorder'\\), pcr_doc_recompute_tokens >= 16$",
        ):
            request_recompute(asked, lego)
    # Without a calibration a request still asks for what it likes.
    free = reuse_settings.recompute(PCRConfig(enabled=True, doc_reuse="blend", doc_recompute_ratio=0.15))
    assert free.gate is None and request_recompute({"pcr_doc_recompute_ratio": 0.0}, free).ratio == 0.0


def test_the_tokenizer_answers_a_refused_request_with_a_400_error():
    """What SGLang's HTTP server turns into a 400: ``_validate_one_request`` raising ValueError."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import GenerateReqInput

    from pcr_sglang.reuse.tokenizer import validate_doc_bounds

    file = _server().gate.file
    args = SimpleNamespace(
        enable_pcr=True, pcr_chunk_size=32, pcr_doc_reuse="blend", pcr_doc_reuse_calibration=file, pcr_doc_min_tokens=1
    )
    manager = SimpleNamespace(server_args=args)
    tokens = list(range(1, 40))

    def request(**custom):
        obj = GenerateReqInput(
            input_ids=tokens,
            sampling_params={"max_new_tokens": 1, "custom_params": {"pcr_doc_bounds": [2, 10, 10, 20], **custom}},
        )
        obj.normalize_batch_and_arguments()
        return validate_doc_bounds(None, manager, obj, tokens)

    assert request() is None and request(pcr_doc_recompute_ratio=0.3) is None
    with pytest.raises(ValueError, match="pcr_doc_reuse='concat': outside this server's calibration"):
        request(pcr_doc_reuse="concat")
    args.pcr_doc_reuse_calibration_warn = True
    assert request(pcr_doc_reuse="concat") is None  # served, and counted by the scheduler


def test_with_warn_an_override_is_served_and_counted_once_per_request_by_what_it_overrode():
    from types import SimpleNamespace

    from pcr_sglang.reuse.bounds import request_doc_reuse, request_recompute

    server = _server(warn=True)
    assert request_recompute({"pcr_doc_reuse": "concat"}, server).mode == "concat"  # validation: not counted
    assert server.gate.overrides == dict.fromkeys(server.gate.overrides, 0)

    def req(**custom):
        return SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"pcr_doc_bounds": [2, 10], **custom}))

    assert request_doc_reuse(req(pcr_doc_reuse="concat"), 20, server)[1].mode == "concat"
    assert request_doc_reuse(req(pcr_doc_recompute_ratio=0.0, pcr_doc_selector="query"), 20, server)[1].ratio == 0
    assert request_doc_reuse(req(), 20, server)[1].ratio == 0.15  # inside: not counted
    assert server.gate.overrides == {
        "mode": 1,
        "recompute_tokens": 0,
        "recompute_ratio": 1,
        "selector": 1,
        "anchor_tokens": 0,
    }
