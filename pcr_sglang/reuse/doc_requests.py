"""Documents as text on ``/generate``, ``/v1/completions`` and ``sglang.Engine``: the
tokenizer manager's side (hooks registered in ``plugin.py``).

Inside the server documents travel in ``sampling_params.custom_params["pcr_documents"]``
(the one field that reaches the tokenizer manager from every entry point, batches
included); a client of ``/generate`` or the Engine may also put them there itself.

* ``TokenizerManager.generate_request`` (AROUND): ``/generate``'s top-level ``documents``
  (SGLang's ``GenerateReqInput`` has no such field, so it is read from the request's JSON
  body, which Starlette keeps parsed) is moved into that field;
* ``Engine.generate`` / ``async_generate`` (AROUND): their ``documents=`` keyword too;
* ``TokenizerManager._tokenize_one_request`` (AROUND): a text prompt with documents is
  rendered and tokenized here (:func:`pcr_sglang.reuse.documents.mark_text`) and goes on
  as ``input_ids`` with ``pcr_doc_bounds``, so validation, warm-ups and the scheduler see a
  marked token prompt;
* ``TokenizerManager._validate_one_request`` (AFTER): documents still unrendered there (a
  token prompt, or a batch SGLang tokenized in one call) are refused, never dropped.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from pcr_sglang.flags import flag_value
from pcr_sglang.reuse.bounds import DOC_BOUNDS_PARAM
from pcr_sglang.reuse.documents import (
    DOCUMENTS_FIELD,
    DOCUMENTS_PARAM,
    DocumentsError,
    MarkingRules,
    doc_format_from_flag,
    mark_text,
    parse_documents,
)

logger = logging.getLogger(__name__)

GENERATE_PATH = "/generate"


def marking_rules(manager: Any) -> MarkingRules:
    """The server's document format, limits and context length (a tokenizer manager's)."""
    from pcr_sglang.reuse.tokenizer import server_limits

    args = getattr(manager, "server_args", None)
    return MarkingRules(
        doc_format_from_flag(flag_value(args, "pcr_doc_format")),
        server_limits(args),
        getattr(manager, "context_len", None),
    )


def _custom(sampling_params: Any) -> Optional[dict[str, Any]]:
    custom = sampling_params.get("custom_params") if isinstance(sampling_params, dict) else None
    return custom if isinstance(custom, dict) else None


def with_documents(sampling_params: Any, documents: Any) -> dict[str, Any]:
    """A copy of one request's ``sampling_params`` carrying ``documents`` (checked for shape first)."""
    parse_documents(documents)
    if sampling_params is None:
        sampling_params = {}
    if not isinstance(sampling_params, dict):
        raise DocumentsError(
            f"{DOCUMENTS_FIELD} go with one prompt and its sampling_params object; a batch "
            f"gives each prompt's sampling_params.custom_params.{DOCUMENTS_PARAM}"
        )
    custom = sampling_params.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        raise DocumentsError(
            f"sampling_params.custom_params must be an object of named parameters, got {type(custom).__name__}"
        )
    return {**sampling_params, "custom_params": {**(custom or {}), DOCUMENTS_PARAM: documents}}


async def _body_documents(request: Any) -> Any:
    """``documents`` of a ``/generate`` JSON body (None when absent or not that route)."""
    try:
        if request.url.path.rstrip("/") != GENERATE_PATH:
            return None
        body = await request.json()
    except Exception:  # not an HTTP request, or a body SGLang parsed some other way
        return None
    return body.get(DOCUMENTS_FIELD) if isinstance(body, dict) else None


async def generate_request(
    original: Callable[..., Any], manager: Any, obj: Any, request: Any = None, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``TokenizerManager.generate_request`` (an async generator)."""
    documents = await _body_documents(request) if request is not None else None
    if documents is not None:
        if not isinstance(obj.text, str) or obj.input_ids is not None:
            raise DocumentsError(f"{DOCUMENTS_FIELD} go with one text prompt ('text'), not a batch or input_ids")
        obj.sampling_params = with_documents(obj.sampling_params, documents)
    async for out in original(manager, obj, request, *args, **kwargs):
        yield out


def engine_generate(original: Callable[..., Any], engine: Any, *args: Any, documents: Any = None, **kwargs: Any) -> Any:
    """AROUND ``Engine.generate`` and ``Engine.async_generate``: ``documents=``."""
    if documents is not None:
        if len(args) > 2:  # (prompt, sampling_params, ...): name the rest, as the documents' path reads them
            raise TypeError(f"with {DOCUMENTS_FIELD}=, pass the arguments after sampling_params by name")
        if len(args) == 2:
            kwargs["sampling_params"] = args[1]
            args = args[:1]
        kwargs["sampling_params"] = with_documents(kwargs.get("sampling_params"), documents)
    return original(engine, *args, **kwargs)


async def tokenize_with_documents(
    original: Callable[..., Any], manager: Any, obj: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``TokenizerManager._tokenize_one_request``."""
    custom = _custom(getattr(obj, "sampling_params", None))
    if custom is None or DOCUMENTS_PARAM not in custom or getattr(obj, "input_ids", None) is not None:
        return await original(manager, obj, *args, **kwargs)
    if getattr(obj, "text", None) is None:
        raise DocumentsError(f"{DOCUMENTS_FIELD} go with a text prompt")
    if DOC_BOUNDS_PARAM in custom:
        raise DocumentsError(f"{DOCUMENTS_FIELD} and {DOC_BOUNDS_PARAM} both mark documents: send one of them")
    rules = marking_rules(manager)
    documents = parse_documents(custom[DOCUMENTS_PARAM], rules.limits)
    marked = mark_text(manager.tokenizer, obj.text, documents, rules)
    rest = {k: v for k, v in custom.items() if k != DOCUMENTS_PARAM}
    obj.sampling_params = {**obj.sampling_params, "custom_params": {**rest, DOC_BOUNDS_PARAM: marked.doc_bounds}}
    obj.input_ids, obj.text = marked.input_ids, None
    return await original(manager, obj, *args, **kwargs)


def refuse_unrendered(result: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager._validate_one_request``."""
    custom = _custom(getattr(obj, "sampling_params", None))
    if custom is not None and DOCUMENTS_PARAM in custom:
        raise DocumentsError(
            f"{DOCUMENTS_FIELD} go with one text prompt: not with input_ids (mark token prompts "
            f"with {DOC_BOUNDS_PARAM}), nor in a batch tokenized at once "
            "(--enable-tokenizer-batch-encode)"
        )
    return None


def check_format_flag(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ServerArgs.resolve_once``: a bad ``--pcr-doc-format`` fails at startup."""
    from pcr_sglang.reuse.documents import check_doc_format

    value = flag_value(server_args, "pcr_doc_format")
    if value is not None:
        try:
            check_doc_format(doc_format_from_flag(value))
        except DocumentsError as e:
            raise ValueError(str(e)) from None
    return None
