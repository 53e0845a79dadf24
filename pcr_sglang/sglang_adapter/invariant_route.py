"""``GET /server_info?pcr_check_invariants=1``: PCR's full bookkeeping check, on request.

``/server_info`` reports PCR's counters on every call, which costs O(1) beyond a pass over
the host-slot table. Verifying the tree and slot table against each other walks every
chunk (O(tree)) in the scheduler thread, so it runs only when a caller asks for it with
the query parameter, and only a caller allowed to: any caller on a server started with
``--pcr-debug-checks`` (tests and debugging), otherwise one holding SGLang's
``--admin-api-key`` as a Bearer token. Anyone else gets HTTP 403: ``/server_info`` itself
has no authentication, and a loop of such asks would slow every request's steps. For the
same reason PCR's route (and SGLang's deprecated ``/get_server_info``, which calls the same
function) answers with the server's keys redacted (``redaction``): SGLang returns them in
clear.

SGLang's ``/server_info`` takes no parameters and its request to the schedulers
(``GetInternalStateReq``) carries none, so the ask travels in the request's ``rid``:

* in the HTTP process, a route for ``/server_info`` placed before SGLang's reads the
  parameter into a context variable and then runs SGLang's own handler;
* the tokenizer manager's ``get_internal_state`` (AROUND) sends ``rid=CHECK_INVARIANTS_RID``
  when that variable is set;
* the scheduler's hook (``plugin._add_pcr_internal_state``) checks only for that rid.
"""

from __future__ import annotations

import logging
import secrets
import sys
from contextvars import ContextVar
from typing import Any, Callable, Optional

from pcr_sglang.flags import flag_value
from pcr_sglang.sglang_adapter.redaction import redact, secret_values

logger = logging.getLogger(__name__)

CHECK_INVARIANTS_RID = "pcr:check-invariants"
QUERY_PARAMETER = "pcr_check_invariants"
_ROUTE_NAME = "pcr_server_info"
_check_requested: ContextVar[bool] = ContextVar("pcr_check_invariants", default=False)


def check_requested(recv_req: Any) -> bool:
    """Whether a scheduler's ``GetInternalStateReq`` asks for the invariant check."""
    return getattr(recv_req, "rid", None) == CHECK_INVARIANTS_RID


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")


def may_check(debug_checks: bool, admin_api_key: Optional[str], authorization: Optional[str]) -> bool:
    """Whether a caller may ask for the O(tree) check: with ``--pcr-debug-checks`` anyone,
    otherwise only a holder of the admin API key (compared in constant time)."""
    if debug_checks:
        return True
    if not admin_api_key or not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), admin_api_key)


def _server_args(http_server: Any) -> Any:
    tokenizer_manager = getattr(getattr(http_server, "_global_state", None), "tokenizer_manager", None)
    return getattr(tokenizer_manager, "server_args", None)


def _serving_config() -> Any:
    """SGLang's published serving config (where the API keys live), or None when this
    process has none."""
    try:
        from sglang.srt.runtime_context import get_serving

        return get_serving()
    except Exception:  # no serving config published in this process
        return None


def _may_check(http_server: Any, authorization: Optional[str]) -> bool:
    server_args = _server_args(http_server)
    admin_api_key = getattr(server_args, "admin_api_key", None)
    if admin_api_key is None:
        admin_api_key = getattr(_serving_config(), "admin_api_key", None)
    return may_check(bool(flag_value(server_args, "pcr_debug_checks")), admin_api_key, authorization)


def add_server_info_route(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``TokenizerControlMixin.init_communicators``: in the HTTP server's process,
    put PCR's ``/server_info`` route before SGLang's (once). Other processes that build a
    tokenizer manager without the HTTP app (``sglang.Engine``) are left alone."""
    http_server: Any = sys.modules.get("sglang.srt.entrypoints.http_server")  # SGLang ships no types
    app = getattr(http_server, "app", None)
    if app is None or any(getattr(r, "name", None) == _ROUTE_NAME for r in app.router.routes):
        return result
    from fastapi import Request

    sglang_server_info = http_server.server_info

    async def redacted_server_info() -> Any:
        """SGLang's answer with the server's secrets taken out (``redaction``)."""
        answer = await sglang_server_info()
        # mutant: server-info-route-passes-sglangs-answer-through
        return redact(answer, secret_values(_server_args(http_server), _serving_config()))

    redacted_server_info.__doc__ = sglang_server_info.__doc__
    # SGLang's deprecated ``/get_server_info`` calls ``server_info`` by its module name.
    http_server.server_info = redacted_server_info

    async def pcr_server_info(request: Request) -> Any:
        asked = _truthy(request.query_params.get(QUERY_PARAMETER))
        if asked and not _may_check(http_server, request.headers.get("authorization")):
            from fastapi.responses import JSONResponse

            return JSONResponse(
                status_code=403,
                content={
                    "error": (
                        f"{QUERY_PARAMETER} walks the whole cache in the scheduler thread: start the server with "
                        f"--pcr-debug-checks, or send SGLang's --admin-api-key as 'Authorization: Bearer <key>'"
                    )
                },
            )
        token = _check_requested.set(asked)
        try:
            return await redacted_server_info()
        finally:
            _check_requested.reset(token)

    # This module's annotations are strings (``from __future__ import annotations``) and
    # ``Request`` is not a module global, so FastAPI gets the class itself.
    pcr_server_info.__annotations__ = {"request": Request}
    pcr_server_info.__doc__ = sglang_server_info.__doc__
    app.router.add_api_route("/server_info", pcr_server_info, methods=["GET"], name=_ROUTE_NAME)
    app.router.routes.insert(0, app.router.routes.pop())  # matched before SGLang's own route
    return result


def get_internal_state(original: Callable[..., Any], tokenizer_manager: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``TokenizerControlMixin.get_internal_state``: SGLang's request, marked when
    the caller asked for the check (SGLang's method builds its request itself)."""
    if not _check_requested.get():
        return original(tokenizer_manager, *args, **kwargs)

    async def marked() -> list[dict[Any, Any]]:
        from sglang.srt.managers.io_struct import GetInternalStateReq

        tokenizer_manager.auto_create_handle_loop()
        responses = await tokenizer_manager.get_internal_state_communicator(
            GetInternalStateReq(rid=CHECK_INVARIANTS_RID)
        )
        return [r.internal_state for r in responses]

    return marked()
