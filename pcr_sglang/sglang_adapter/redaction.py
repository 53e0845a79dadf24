"""No secret in any answer: the server's keys taken out of what ``/server_info`` returns.

SGLang 0.5.23's ``/server_info`` (and its deprecated ``/get_server_info``) needs no
credentials, yet returns the server arguments three times over: as fields, inside every
scheduler's ``internal_states`` entry, and as the ``launch_command`` text. Only the
watermark keys are redacted there, so ``--admin-api-key`` and ``--api-key`` were readable
by any client, and with them every admin route (``/flush_cache``, the weight updates,
PCR's invariant check). PCR serves that route (``invariant_route``), so it cleans the
answer before it leaves:

* a field named after a secret, at any depth, is replaced by ``<redacted>``;
* in a command line, the value after a secret flag (``--api-key X`` or ``--api-key=X``);
* anywhere else, any string holding one of the server's actual secret values has it
  replaced, so a copy under a name this list does not know is caught too.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Optional

logger = logging.getLogger(__name__)

REDACTED = "<redacted>"
# ServerArgs fields that hold a credential or a key (SGLang 0.5.23). The watermark ones
# SGLang already redacts; they stay here so a future route that forgets is still covered.
SECRET_FIELDS = frozenset(
    {
        "api_key",
        "admin_api_key",
        "ssl_keyfile_password",
        "watermark_key",
        "watermark_key_b",
        "watermark_config",
    }
)
SECRET_FLAGS = frozenset("--" + name.replace("_", "-") for name in SECRET_FIELDS)
COMMAND_FIELDS = frozenset({"launch_command"})
# A value shorter than this is not searched for inside other strings (a one-letter key
# would blank out every string holding that letter); it is still redacted by name.
MIN_SCRUBBED_LEN = 4


def secret_values(*configs: Any) -> list[str]:
    """The secret values found on ``configs`` (SGLang's ``ServerArgs``, its serving
    config), longest first, so a key that contains another is replaced whole."""
    values = set()
    for config in configs:
        for name in SECRET_FIELDS:
            value = getattr(config, name, None)
            if isinstance(value, str) and len(value) >= MIN_SCRUBBED_LEN:
                values.add(value)
    return sorted(values, key=len, reverse=True)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """``argv`` with the value of every secret flag replaced (``--flag value`` and
    ``--flag=value``)."""
    out: list[str] = []
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append(REDACTED)
            redact_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS and eq:
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(arg)
            redact_next = arg in SECRET_FLAGS
    return out


def redact_command_line(command: str) -> str:
    """A command line as one string (SGLang's ``launch_command``), redacted as
    :func:`redact_argv` does; whitespace is kept as it was."""
    parts = re.split(r"(\s+)", command)
    words = [i for i, part in enumerate(parts) if part and not part.isspace()]
    for i, word in zip(words, redact_argv(parts[i] for i in words)):
        parts[i] = word
    return "".join(parts)


def _scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def redact(value: Any, secrets: Optional[Iterable[str]] = None) -> Any:
    """A copy of ``value`` (JSON-like: dicts, lists, tuples, strings, scalars) with every
    secret taken out; ``secrets`` are the actual values to search for (``secret_values``)."""
    found = tuple(secrets or ())
    return _redact(value, found)


def _redact(value: Any, secrets: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            # mutant: server-info-answers-with-the-admin-key
            if isinstance(key, str) and key in SECRET_FIELDS and item is not None:
                out[key] = REDACTED
            elif isinstance(key, str) and key in COMMAND_FIELDS and isinstance(item, str):
                # Values first: SGLang joins argv with spaces, so a key holding a space is
                # several words there, of which the flag's rule would take only the first.
                out[key] = redact_command_line(_scrub(item, secrets))
            elif isinstance(key, str) and key in COMMAND_FIELDS and isinstance(item, (list, tuple)):
                out[key] = redact_argv(_scrub(str(arg), secrets) for arg in item)
            else:
                out[key] = _redact(item, secrets)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_redact(item, secrets) for item in value)
    if isinstance(value, str):
        return _scrub(value, secrets)
    return value
