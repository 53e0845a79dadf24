"""``GET /server_info?pcr_check_invariants=1``: PCR's full bookkeeping check, on request.

``/server_info`` reports PCR's counters on every call, which costs O(1) beyond a pass over
the host-slot table. Verifying the tree and slot table against each other walks every
chunk (O(tree)) in the scheduler thread, so it runs only when a caller asks for it with
the query parameter: tests and debugging, never a scraper.

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
import sys
from contextvars import ContextVar
from typing import Any, Callable

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


def add_server_info_route(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``TokenizerControlMixin.init_communicators``: in the HTTP server's process,
    put PCR's ``/server_info`` route before SGLang's (once). Other processes that build a
    tokenizer manager without the HTTP app (``sglang.Engine``) are left alone."""
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    app = getattr(http_server, "app", None)
    if app is None or any(getattr(r, "name", None) == _ROUTE_NAME for r in app.router.routes):
        return result
    from fastapi import Request

    sglang_server_info = http_server.server_info

    async def pcr_server_info(request: Request) -> Any:
        token = _check_requested.set(_truthy(request.query_params.get(QUERY_PARAMETER)))
        try:
            return await sglang_server_info()
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
