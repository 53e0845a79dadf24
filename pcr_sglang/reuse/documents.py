"""Documents marked by structure: a client sends its documents as text, and the server
renders them into the prompt, tokenizes each one alone and computes their bounds.

This is what lets a RAG application reach document reuse without a tokenizer of its own
(``docs/document-reuse.md``, "Entry points"): the chat completions API's ``documents``
field, ``/generate`` and ``/v1/completions`` with ``text`` plus documents, and
``sglang.Engine.generate(..., documents=...)`` all end here, in the tokenizer process, and
produce what a client of the marked-token-id path sends (``input_ids`` and
``pcr_doc_bounds``), so the rest of the server sees no difference.

A document must be the same tokens wherever it appears, so it is tokenized alone, with the
text around it tokenized apart (as :func:`pcr_client.prompt.build_doc_prompt` does on the
client side). Where a document goes:

* chat, with a template that takes ``documents=`` (Hugging Face's RAG templates): the
  template renders them; each document's span is its rendered title and text (with what
  the template puts between the two), found through sentinels, and what the template
  writes around a document (a running index, say) is unmarked;
* chat, other templates: at the start of the last user message, each one rendered with
  ``--pcr-doc-format`` (default ``"Document: {doc}\\n\\n"``), so ``S`` is the
  template's text up to that message's content;
* a text prompt: where ``text`` holds ``{{documents}}``, else right before ``text``
  (behind the tokens the tokenizer puts first, a BOS).

The limits are those of marked token prompts (``--pcr-doc-max-documents``,
``--pcr-doc-min-tokens``, the context length), checked here so that the HTTP 400 names the
``documents`` field rather than offsets the client never sent.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pcr_sglang.reuse.bounds import DocLimits
from pcr_wire import DEFAULT_DOC_FORMAT

logger = logging.getLogger(__name__)

DOCUMENTS_FIELD = "documents"
# The channel documents travel on inside the server (and the one /generate and Engine
# clients may use directly): sampling_params.custom_params["pcr_documents"].
DOCUMENTS_PARAM = "pcr_documents"
DOC_FORMAT_FLAG = "--pcr-doc-format"
DOCUMENTS_PLACEHOLDER = "{{documents}}"
DOCUMENT_KEYS = ("title", "text")
_SENTINEL = "\x00PCR-DOCUMENTS\x00"


class DocumentsError(ValueError):
    """Documents a request sent cannot be served (SGLang answers a ValueError with HTTP 400)."""


@dataclass(frozen=True)
class Document:
    text: str
    title: Optional[str] = None

    @property
    def body(self) -> str:
        """What ``{doc}`` of the document format stands for: the title on a line of its own, then the text."""
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclass(frozen=True)
class MarkedPrompt:
    """A prompt with its documents marked: what the marked-token-id path sends."""

    input_ids: list[int]
    doc_bounds: list[int]  # flat [s0, e0, s1, e1, ...]


@dataclass(frozen=True)
class MarkingRules:
    """How a server renders and checks documents: its format, its limits, its context."""

    doc_format: str = DEFAULT_DOC_FORMAT
    limits: Optional[DocLimits] = None
    context_len: Optional[int] = None


def parse_documents(raw: Any, limits: Optional[DocLimits] = None, field: str = DOCUMENTS_FIELD) -> tuple[Document, ...]:
    """A request's documents: a non-empty list of non-empty strings or ``{"title", "text"}``
    objects, at most ``limits.max_documents`` of them (counted before anything is
    tokenized). Raises :class:`DocumentsError` naming the field and the item."""
    if not isinstance(raw, (list, tuple)):
        raise DocumentsError(
            f'{field} must be a list of strings or of {{"title", "text"}} objects, got {type(raw).__name__}'
        )
    if not raw:
        raise DocumentsError(f"{field} is empty: send at least one document, or leave the field out")
    if limits is not None and len(raw) > limits.max_documents:
        raise DocumentsError(
            f"{field} holds {len(raw)} documents; this server takes at most "
            f"{limits.max_documents} per request (--pcr-doc-max-documents)"
        )
    documents = []
    for i, item in enumerate(raw):
        where = f"{field}[{i}]"
        text: Any  # a string, checked below
        if isinstance(item, str):
            text, title = item, None
        elif isinstance(item, dict):
            unknown = sorted(set(map(str, item)) - set(DOCUMENT_KEYS))
            if unknown:
                raise DocumentsError(
                    f"{where} has unknown keys {unknown}: a document object takes "
                    f"{' and '.join(map(repr, DOCUMENT_KEYS))}"
                )
            text, title = item.get("text"), item.get("title")
            if title is not None and not isinstance(title, str):
                raise DocumentsError(f"{where}.title must be a string, got {type(title).__name__}")
            where += ".text"
        else:
            raise DocumentsError(f'{where} must be a string or a {{"title", "text"}} object, got {type(item).__name__}')
        if not isinstance(text, str):
            raise DocumentsError(f"{where} must be a string, got {type(text).__name__}")
        if not text.strip():
            raise DocumentsError(f"{where} is empty")
        documents.append(Document(text, title or None))
    return tuple(documents)


def check_doc_format(doc_format: str) -> None:
    """``doc_format`` must hold ``{doc}`` and no other field (``{{`` and ``}}`` for braces)."""
    import string

    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(doc_format) if name is not None]
    except ValueError as e:
        raise DocumentsError(f"{DOC_FORMAT_FLAG} {doc_format!r} is not a format string: {e}") from None
    if "doc" not in fields or set(fields) != {"doc"}:
        raise DocumentsError(f"{DOC_FORMAT_FLAG} must hold {{doc}} and no other field, got {doc_format!r}")


def doc_format_from_flag(value: Optional[str]) -> str:
    """The flag's value with ``\\n`` and ``\\t`` written out on a command line made real."""
    if not value:
        return DEFAULT_DOC_FORMAT
    return value.replace("\\n", "\n").replace("\\t", "\t")


def _encode_many(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text tokenized alone, no special tokens added: one batched call where the
    tokenizer takes one (a fast tokenizer encodes the batch in Rust, in parallel)."""
    texts = list(texts)
    if not texts:
        return []
    try:
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    except Exception:  # a tokenizer without the batch call: one at a time
        encoded = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return [list(ids) for ids in encoded]


def _assemble(pieces: Sequence[tuple[list[int], bool]], rules: MarkingRules, field: str) -> MarkedPrompt:
    """Concatenate token pieces, marking those flagged as documents; apply the limits."""
    ids: list[int] = []
    bounds: list[int] = []
    doc = 0
    for tokens, is_doc in pieces:
        if is_doc:
            if not tokens:
                raise DocumentsError(f"{field}[{doc}] renders to no tokens")
            if not ids:
                raise DocumentsError(
                    f"{field}: nothing precedes the first document (the model adds no BOS); "
                    f"put {DOCUMENTS_PLACEHOLDER} in the text after a leading part"
                )
            limits = rules.limits
            # mutant: documents-as-text-min-tokens-unchecked
            if limits is not None and len(tokens) < limits.min_tokens:
                raise DocumentsError(
                    f"{field}[{doc}] is {len(tokens)} tokens as rendered; this server takes "
                    f"documents of at least {limits.min_tokens} (--pcr-doc-min-tokens)"
                )
            # mutant: documents-as-text-bounds-off-by-one
            bounds += [len(ids), len(ids) + len(tokens)]
            doc += 1
        ids += tokens
    if rules.context_len is not None and len(ids) >= rules.context_len:
        raise DocumentsError(
            f"{field}: the prompt with its {doc} documents is {len(ids)} tokens, over the "
            f"model's context length ({rules.context_len} tokens)"
        )
    return MarkedPrompt(ids, bounds)


def mark_text(
    tokenizer: Any, text: str, documents: Sequence[Document], rules: MarkingRules, field: str = DOCUMENTS_FIELD
) -> MarkedPrompt:
    """A text prompt with ``documents`` where it holds ``{{documents}}`` (else before it).
    The part before is tokenized as SGLang tokenizes a text prompt (with the tokenizer's
    leading special tokens), the rest without."""
    if not isinstance(text, str):
        raise DocumentsError(f"{field} go with one text prompt, got {type(text).__name__}")
    count = text.count(DOCUMENTS_PLACEHOLDER)
    if count > 1:
        raise DocumentsError(f"the text holds {DOCUMENTS_PLACEHOLDER} {count} times; {field} go in one place")
    head, tail = text.split(DOCUMENTS_PLACEHOLDER) if count else ("", text)
    leading = list(tokenizer.encode(head))  # add_special_tokens as SGLang's text prompts: a BOS if the model has one
    formatted = [rules.doc_format.format(doc=d.body) for d in documents]
    encoded = _encode_many(tokenizer, formatted + ([tail] if tail else []))
    pieces = [(leading, False)] + [(ids, True) for ids in encoded[: len(documents)]]
    if tail:
        pieces.append((encoded[-1], False))
    return _assemble(pieces, rules, field)


def template_takes_documents(chat_template: Any) -> bool:
    """Whether a chat template renders ``documents=`` itself (Hugging Face's RAG templates:
    a template reading a ``documents`` variable, or a set of named templates with a ``rag``
    one). The word in the template's text (a system prompt saying "answer from the
    documents") is not the variable: the template is parsed, as Jinja reads it, and a
    template Jinja cannot read alone (a tag of an extension, a filter it lacks) is searched
    for the name inside its ``{{ }}`` and ``{% %}`` blocks."""
    if isinstance(chat_template, dict):
        return "rag" in chat_template
    return isinstance(chat_template, str) and _reads_documents(chat_template)


@functools.lru_cache(maxsize=16)
def _reads_documents(chat_template: str) -> bool:
    """:func:`template_takes_documents` of one template string, parsed once: a server has
    one or a few templates, and parsing one costs milliseconds a request would pay."""
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
        return "documents" in meta.find_undeclared_variables(parsed)
    except jinja2.TemplateError:
        return any(
            re.search(r"\bdocuments\b", block)
            for block in re.findall(r"\{[{%](.*?)[%}]\}", chat_template, flags=re.DOTALL)
        )


def _with_sentinel(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the sentinel at the start of the last user message's content."""
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
    if last is None:
        raise DocumentsError(f"{DOCUMENTS_FIELD} go before the last user message; the request has none")
    message = dict(messages[last])
    content = message.get("content")
    if content is None or isinstance(content, str):
        message["content"] = _SENTINEL + (content or "")
    elif isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        first_text = next((i for i, p in enumerate(parts) if isinstance(p, dict) and p.get("type") == "text"), None)
        if first_text is None:
            parts.insert(0, {"type": "text", "text": _SENTINEL})
        else:
            parts[first_text]["text"] = _SENTINEL + (parts[first_text].get("text") or "")
        message["content"] = parts
    else:
        raise DocumentsError(f"{DOCUMENTS_FIELD}: the last user message's content is not text")
    return [*messages[:last], message, *messages[last + 1 :]]


def _doc_sentinels(i: int) -> tuple[str, str]:
    return f"\x00PCR-TITLE-{i}\x00", f"\x00PCR-TEXT-{i}\x00"


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    documents: Sequence[Document],
    rules: MarkingRules,
    **template_kwargs: Any,
) -> MarkedPrompt:
    """The chat prompt of ``messages`` with ``documents`` marked (``template_kwargs``: the
    tools, ``add_generation_prompt`` and template variables SGLang renders with)."""
    render_kwargs = dict(template_kwargs, tokenize=False, return_dict=False)
    if template_takes_documents(getattr(tokenizer, "chat_template", None)):
        return _render_with_template_documents(tokenizer, messages, documents, rules, render_kwargs)
    rendered = tokenizer.apply_chat_template(_with_sentinel(messages), **render_kwargs)
    if rendered.count(_SENTINEL) != 1:
        raise DocumentsError(f"{DOCUMENTS_FIELD}: the chat template does not keep the last user message verbatim")
    head, tail = rendered.split(_SENTINEL)
    encoded = _encode_many(tokenizer, [head] + [rules.doc_format.format(doc=d.body) for d in documents] + [tail])
    pieces = [(encoded[0], False)] + [(ids, True) for ids in encoded[1:-1]] + [(encoded[-1], False)]
    return _assemble(pieces, rules, DOCUMENTS_FIELD)


def _render_with_template_documents(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    documents: Sequence[Document],
    rules: MarkingRules,
    render_kwargs: dict[str, Any],
) -> MarkedPrompt:
    """The template renders the documents; each one's span (its title and text, and what
    the template writes between them) is found through sentinels in their place."""
    stand_ins = []
    for i, doc in enumerate(documents):
        title, text = _doc_sentinels(i)
        stand_ins.append({"title": title, "text": text} if doc.title else {"text": text})
    rendered = tokenizer.apply_chat_template(messages, documents=stand_ins, **render_kwargs)
    pieces_text: list[tuple[str, bool]] = []
    cursor = 0
    for i, doc in enumerate(documents):
        title_mark, text_mark = _doc_sentinels(i)
        marks = [m for m in ((title_mark,) if doc.title else ()) + (text_mark,)]
        if any(rendered.count(m) != 1 for m in marks):
            raise DocumentsError(
                f"{DOCUMENTS_FIELD}: the chat template does not render each document's title "
                "and text once; set a template without documents= to use "
                f"{DOC_FORMAT_FLAG}"
            )
        # mutant: documents-as-text-template-index-marked
        start, end = rendered.index(marks[0]), rendered.index(text_mark) + len(text_mark)
        if start < cursor or end < start:
            raise DocumentsError(f"{DOCUMENTS_FIELD}: the chat template does not render the documents in order")
        span = rendered[start:end].replace(text_mark, doc.text)
        if doc.title:
            span = span.replace(title_mark, doc.title)
        pieces_text += [(rendered[cursor:start], False), (span, True)]
        cursor = end
    pieces_text.append((rendered[cursor:], False))
    encoded = _encode_many(tokenizer, [text for text, _ in pieces_text])
    pieces = [(ids, is_doc) for ids, (text, is_doc) in zip(encoded, pieces_text) if ids or is_doc]
    return _assemble(pieces, rules, DOCUMENTS_FIELD)
