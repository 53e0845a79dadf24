"""Documents on SGLang's OpenAI-compatible API: ``/v1/chat/completions`` and
``/v1/completions`` take a top-level ``documents`` field (hooks registered in ``plugin.py``).

SGLang's request models ignore fields they do not declare, so the field is read from the
JSON body (Starlette keeps it parsed) by an AROUND hook on ``handle_request``:

* chat: ``_convert_to_internal_request`` then runs with the documents in this thread's
  state; SGLang processes the messages as it always does (tools, stop strings, reasoning,
  ``n``, logprobs), and where it renders and tokenizes the chat template
  (``_render_and_encode_chat_template``) the documents are rendered into it instead
  (:func:`pcr_sglang.reuse.documents.render_chat`); the bounds go into the request's
  ``custom_params``. Chat encodings other than a Jinja template (built-in conversation
  templates, custom encoders, multimodal models, tokenizers whose text does not
  round-trip) are refused with HTTP 400;
* completions: the documents go into ``custom_params["pcr_documents"]`` of its one text
  prompt, which the tokenizer manager renders (``reuse.doc_requests``).

A request without ``documents`` goes through SGLang's code untouched.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pcr_sglang.reuse.bounds import DOC_BOUNDS_PARAM
from pcr_sglang.reuse.documents import (
    DOCUMENTS_FIELD,
    DOCUMENTS_PARAM,
    Document,
    DocumentsError,
    MarkedPrompt,
    parse_documents,
    render_chat,
)

logger = logging.getLogger(__name__)

# Chat requests whose documents were read, by id(request), between handle_request and
# the conversion it runs in a worker thread.
_PENDING: dict[int, tuple[Document, ...]] = {}


@dataclass
class _ChatJob:
    documents: tuple[Document, ...]
    serving: Any
    marked: Optional[MarkedPrompt] = None


_LOCAL = threading.local()  # .job: the chat request this thread is converting


async def _body_documents(raw_request: Any) -> Any:
    if raw_request is None:
        return None
    try:
        body = await raw_request.json()
    except Exception:  # no JSON body to read: nothing of ours in it
        return None
    return body.get(DOCUMENTS_FIELD) if isinstance(body, dict) else None


async def handle_request(
    original: Callable[..., Any], serving: Any, request: Any, raw_request: Any = None, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``handle_request`` of SGLang's chat and completions serving classes."""
    raw = await _body_documents(raw_request)
    if raw is None:
        return await original(serving, request, raw_request, *args, **kwargs)
    from pcr_sglang.reuse.doc_requests import marking_rules

    try:
        documents = parse_documents(raw, marking_rules(serving.tokenizer_manager).limits)
        if _is_chat(serving):
            _check_chat_supported(serving, request)
        else:
            _attach_to_completion(request, raw)
    except DocumentsError as e:
        return serving.create_error_response(str(e), param=DOCUMENTS_FIELD)
    if not _is_chat(serving):
        return await original(serving, request, raw_request, *args, **kwargs)
    _PENDING[id(request)] = documents
    try:
        return await original(serving, request, raw_request, *args, **kwargs)
    finally:
        _PENDING.pop(id(request), None)


def _is_chat(serving: Any) -> bool:
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    return isinstance(serving, OpenAIServingChat)


def _check_chat_supported(serving: Any, request: Any) -> None:
    """Documents are rendered into a Jinja chat template's text: refuse other encodings."""
    if getattr(request, "input_ids", None) is not None:
        raise DocumentsError(
            f"{DOCUMENTS_FIELD} cannot go with input_ids (mark token prompts with custom_params.{DOC_BOUNDS_PARAM})"
        )
    manager = serving.tokenizer_manager
    reason = None
    if getattr(manager.model_config, "is_multimodal", False):
        reason = "a multimodal model"
    elif getattr(serving, "chat_encoding_spec", None) is not None:
        reason = f"the chat encoding {serving.chat_encoding_spec!r}"
    elif getattr(serving.template_manager, "chat_template_name", None) is not None:
        reason = f"the built-in chat template {serving.template_manager.chat_template_name!r} (use a Jinja one)"
    elif getattr(serving, "_prompt_text_round_trip_is_lossy", False):
        reason = "a tokenizer whose rendered text does not tokenize back to the template's tokens"
    elif not getattr(manager.tokenizer, "chat_template", None):
        reason = "a model without a chat template (start the server with --chat-template FILE.jinja)"
    if reason is not None:
        raise DocumentsError(f"{DOCUMENTS_FIELD} are not supported on this server: {reason}")


def _attach_to_completion(request: Any, raw: Any) -> None:
    if not isinstance(request.prompt, str):
        raise DocumentsError(f"{DOCUMENTS_FIELD} go with one text prompt, not a batch or token ids")
    custom = request.custom_params or {}
    if DOC_BOUNDS_PARAM in custom:
        raise DocumentsError(
            f"{DOCUMENTS_FIELD} and custom_params.{DOC_BOUNDS_PARAM} both mark documents: send one of them"
        )
    request.custom_params = {**custom, DOCUMENTS_PARAM: raw}


def convert_chat_request(original: Callable[..., Any], serving: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``OpenAIServingChat._convert_to_internal_request`` (runs in a worker thread)."""
    documents = _PENDING.get(id(request))
    if documents is None:
        return original(serving, request, *args, **kwargs)
    job = _ChatJob(documents, serving)
    _LOCAL.job = job
    try:
        adapted, processed = original(serving, request, *args, **kwargs)
    finally:
        _LOCAL.job = None
    if job.marked is None:  # SGLang took a path that does not render the template's text
        raise DocumentsError(f"{DOCUMENTS_FIELD} are not supported with this request's chat encoding")
    if adapted.input_ids != job.marked.input_ids:  # an assistant prefix was appended: after the documents
        if adapted.input_ids is None or adapted.input_ids[: len(job.marked.input_ids)] != job.marked.input_ids:
            raise DocumentsError(f"{DOCUMENTS_FIELD}: the prompt SGLang built is not the one rendered with them")
    sampling = dict(adapted.sampling_params or {})
    custom = sampling.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        raise DocumentsError("custom_params must be an object of named parameters")
    if custom and DOC_BOUNDS_PARAM in custom:
        raise DocumentsError(
            f"{DOCUMENTS_FIELD} and custom_params.{DOC_BOUNDS_PARAM} both mark documents: send one of them"
        )
    # mutant: chat-documents-bounds-dropped
    sampling["custom_params"] = {**(custom or {}), DOC_BOUNDS_PARAM: list(job.marked.doc_bounds)}
    adapted.sampling_params = sampling
    return adapted, processed


def render_chat_template(original: Callable[..., Any], serving: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``OpenAIServingChat._render_and_encode_chat_template``: with documents, the
    template's text with them marked; returns SGLang's ``(prompt_ids, decoded_prompt)``."""
    job: Optional[_ChatJob] = getattr(_LOCAL, "job", None)
    if job is None or job.serving is not serving:
        return original(serving, messages, *args, **kwargs)
    from pcr_sglang.reuse.doc_requests import marking_rules

    template_kwargs = dict(kwargs.get("template_kwargs") or {})
    if DOCUMENTS_FIELD in template_kwargs:
        raise DocumentsError(f"{DOCUMENTS_FIELD} given twice: as the request's field and in chat_template_kwargs")
    job.marked = render_chat(
        serving.tokenizer_manager.tokenizer,
        list(messages),
        job.documents,
        marking_rules(serving.tokenizer_manager),
        tools=kwargs.get("tools"),
        add_generation_prompt=kwargs.get("add_generation_prompt", True),
        **template_kwargs,
    )
    return list(job.marked.input_ids), None
