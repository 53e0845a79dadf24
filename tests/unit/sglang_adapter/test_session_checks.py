"""Session fields of the wrong type get a 400 at the door (SGLang's scheduler died on them).

The check runs on SGLang's real ``GenerateReqInput``, normalized as the tokenizer manager
normalizes it, and against SGLang's real ``SessionParams`` fields.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from sglang.srt.managers.io_struct import GenerateReqInput, SessionParams  # noqa: E402

from pcr_sglang.sglang_adapter.session_checks import session_params_error, validate_session_fields  # noqa: E402


def request(**fields) -> GenerateReqInput:
    obj = GenerateReqInput(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1}, **fields)
    obj.normalize_batch_and_arguments()
    return obj


@pytest.mark.parametrize(
    "params, message",
    [
        ({"id": {"error": "no session"}}, "session_params.id must be str or null, got dict"),
        ({"id": "s", "rid": 7}, "session_params.rid must be str or null, got int"),
        ({"id": "s", "offset": "3"}, "session_params.offset must be int or null, got str"),
        ({"id": "s", "offset": True}, "session_params.offset must be int or null, got bool"),
        ({"id": "s", "replace": "yes"}, "session_params.replace must be bool or null, got str"),
        ({"id": "s", "idx": 1}, "session_params has unknown fields ['idx']"),
    ],
)
def test_session_fields_of_the_wrong_type_are_refused_naming_the_field(params, message):
    """Red before: SGLang's ``SessionParams(**params)`` took a dict id, and the scheduler's
    ``session_id in self.sessions`` raised ``TypeError: unhashable type: 'dict'``."""
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_session_fields(None, None, request(session_params=params), [1, 2, 3])


def test_well_formed_session_fields_and_requests_without_any_go_on():
    for params in (
        None,
        {"id": "s"},
        {"id": "s", "rid": "r", "offset": 2, "replace": False, "drop_previous_output": None},
    ):
        assert validate_session_fields(None, None, request(session_params=params), [1, 2, 3]) is None
        if params:
            SessionParams(**params)  # what SGLang builds from them
    assert session_params_error(None, session_id=5) == "session_id must be a string, got int"
    assert session_params_error(None, session_id="radix-native") is None
