"""No secret in any answer: what PCR's ``/server_info`` route takes out of SGLang's.

The answer is built by SGLang's own ``build_server_info`` from real ``ServerArgs``; the
HTTP side (every route a client reaches without the key) is in ``tests/e2e/test_http_server``.
"""

from __future__ import annotations

import json

import pytest

from pcr_sglang.sglang_adapter.redaction import REDACTED, redact, redact_argv, redact_command_line, secret_values

ADMIN = "admin-SECRET-4242"
API = "api-SECRET-1717"
SSL = "ssl-pass-SECRET-99"


def test_flags_and_their_values_are_redacted_in_both_spellings():
    argv = [
        "--model-path",
        "m",
        "--admin-api-key",
        ADMIN,
        f"--api-key={API}",
        "--ssl-keyfile-password",
        SSL,
        "--port",
        "30000",
    ]
    assert redact_argv(argv) == [
        "--model-path",
        "m",
        "--admin-api-key",
        REDACTED,
        f"--api-key={REDACTED}",
        "--ssl-keyfile-password",
        REDACTED,
        "--port",
        "30000",
    ]
    line = f"python -m sglang.launch_server  --admin-api-key {ADMIN} --api-key={API}\t--port 1"
    assert redact_command_line(line) == (
        f"python -m sglang.launch_server  --admin-api-key {REDACTED} --api-key={REDACTED}\t--port 1"
    )


def test_a_secret_flag_last_on_the_line_redacts_nothing_else():
    assert redact_argv(["--port", "1", "--api-key"]) == ["--port", "1", "--api-key"]


def test_sglangs_real_server_info_keeps_no_key_anywhere():
    """SGLang's ``build_server_info`` on real ``ServerArgs`` with keys, nested as the HTTP
    route nests it (fields, ``launch_command``, every scheduler's ``internal_states``)."""
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import build_server_info

    argv = [
        "--model-path",
        "unused-model",
        "--admin-api-key",
        ADMIN,
        "--api-key",
        API,
        "--ssl-keyfile-password",
        SSL,
        "--skip-server-warmup",
    ]
    server_args = prepare_server_args(argv)
    info = build_server_info(server_args, {})
    as_text = json.dumps(info, default=str)
    assert ADMIN in as_text and API in as_text  # what SGLang returns in clear
    answer = {**info, "internal_states": [dict(info, note=f"copied key {ADMIN}")]}
    cleaned = redact(answer, secret_values(server_args))
    cleaned_text = json.dumps(cleaned, default=str)
    for secret in (ADMIN, API, SSL):
        assert secret not in cleaned_text
    assert cleaned["admin_api_key"] == REDACTED and cleaned["api_key"] == REDACTED
    assert cleaned["internal_states"][0]["note"] == f"copied key {REDACTED}"
    assert "--admin-api-key <redacted>" in cleaned["launch_command"]
    assert cleaned["model_path"] == "unused-model"  # the rest is SGLang's answer as it was
    by_name_only = json.dumps(redact(info), default=str)  # the fields and flags, whatever the values
    for secret in (ADMIN, API, SSL):
        assert secret not in by_name_only


@pytest.mark.parametrize("value", [None, ""])
def test_an_unset_key_stays_as_sglang_reports_it(value):
    assert redact({"api_key": value}) == {"api_key": None if value is None else REDACTED}


def test_short_values_are_redacted_by_name_but_not_searched_for():
    class Args:
        api_key = "ab"
        admin_api_key = ADMIN

    assert secret_values(Args()) == [ADMIN]
    assert redact({"api_key": "ab", "text": "abc"}, secret_values(Args())) == {"api_key": REDACTED, "text": "abc"}


def test_a_key_with_spaces_leaves_no_word_in_the_launch_command():
    """SGLang joins argv with spaces (review R3: the flag's rule took the first word, and the
    whole value was no longer there to find)."""

    class Args:
        api_key = "open sesame 42"
        admin_api_key = None

    answer = redact(
        {"launch_command": "python -m sglang.launch_server --api-key open sesame 42 --port 1"}, secret_values(Args())
    )
    assert "sesame" not in answer["launch_command"] and answer["launch_command"].endswith("--port 1")
