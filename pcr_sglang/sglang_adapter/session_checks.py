"""A request's session fields checked at the door, so no client can take the scheduler down.

SGLang 0.5.23 builds ``SessionParams(**obj.session_params)`` in the tokenizer manager
without checking the values' types, and the scheduler looks the session id up in a dict.
A ``/generate`` request whose ``session_params.id`` is a JSON object therefore reaches the
scheduler, whose lookup raises ``TypeError: unhashable type: 'dict'`` and kills it: every
request in flight fails and the server stops serving. No privilege is needed and the
server need not have sessions on. This hook (AFTER ``_validate_one_request``) refuses such
a request with HTTP 400 instead, naming the field; a well-formed one goes on unchanged.
"""

from __future__ import annotations

import logging
import typing
from typing import Any

logger = logging.getLogger(__name__)


def _expected(annotation: Any) -> tuple[type, ...]:
    """The non-None types an ``Optional[X]`` field of SGLang's struct takes."""
    args = typing.get_args(annotation) or (annotation,)
    return tuple(a for a in args if isinstance(a, type) and a is not type(None))


def _session_fields() -> dict[str, tuple[type, ...]]:
    import msgspec
    from sglang.srt.managers.io_struct import SessionParams

    hints = typing.get_type_hints(SessionParams)
    return {f.name: _expected(hints[f.name]) for f in msgspec.structs.fields(SessionParams)}


def _type_ok(value: Any, expected: tuple[type, ...]) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) and bool not in expected:
        return False  # a bool is an int to isinstance, never an id or an offset here
    return isinstance(value, expected)


def session_params_error(session_params: Any, session_id: Any = None) -> str | None:
    """Why these session fields cannot be served (None if they can)."""
    if session_id is not None and not isinstance(session_id, str):
        return f"session_id must be a string, got {type(session_id).__name__}"
    if session_params is None:
        return None
    if not isinstance(session_params, dict):
        return f"session_params must be an object, got {type(session_params).__name__}"
    fields = _session_fields()
    unknown = sorted(set(session_params) - set(fields))
    if unknown:
        return f"session_params has unknown fields {unknown}; it takes {sorted(fields)}"
    for name, value in session_params.items():
        if not _type_ok(value, fields[name]):
            wanted = " or ".join(t.__name__ for t in fields[name])
            return f"session_params.{name} must be {wanted} or null, got {type(value).__name__}"
    return None


def validate_session_fields(result: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager._validate_one_request``: a ``ValueError`` is SGLang's 400."""
    problem = session_params_error(getattr(obj, "session_params", None), getattr(obj, "session_id", None))
    # mutant: session-id-of-any-type-reaches-the-scheduler
    if problem is not None:
        raise ValueError(problem)
    return None
