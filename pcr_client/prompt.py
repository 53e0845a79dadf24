"""Build a RAG prompt that marks its documents, for ``--pcr-doc-reuse``.

A document's KV can be reused in any order only if it is the same tokens everywhere, so
each document is tokenized alone (BPE merges across a seam would make it different
tokens), and the prompt is sent as ``input_ids`` with the documents' token offsets in
``sampling_params.custom_params["pcr_doc_bounds"]``::

    prompt = build_doc_prompt(tokenizer, system, documents, question)
    requests.post(url + "/generate", json={
        "input_ids": prompt.input_ids,
        "sampling_params": {"max_new_tokens": 64, "temperature": 0,
                            "custom_params": prompt.custom_params()}})

With a chat template, the documents and the question form the user turn: the template is
rendered once around a sentinel, and the text before the documents (BOS, system turn,
user header) is the leading part ``S`` every document's KV is computed behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pcr_wire import DEFAULT_DOC_FORMAT, DOC_BOUNDS_PARAM, DOC_MODE_PARAM

_SENTINEL = "\x00PCR-DOCUMENTS\x00"
DEFAULT_QUESTION_FORMAT = "Question: {question}"


@dataclass(frozen=True)
class DocPrompt:
    input_ids: list[int]
    doc_bounds: list[int]  # flat [s0, e0, s1, e1, ...]

    def custom_params(self, mode: Optional[str] = None) -> dict[str, Any]:
        params: dict[str, Any] = {DOC_BOUNDS_PARAM: list(self.doc_bounds)}
        if mode is not None:
            params[DOC_MODE_PARAM] = mode
        return params

    def sampling_params(self, mode: Optional[str] = None, **sampling: Any) -> dict[str, Any]:
        """``sampling`` with the document marks added (for ``/generate`` and SGLang's DSL)."""
        custom = dict(sampling.pop("custom_params", None) or {})
        custom.update(self.custom_params(mode))
        return {**sampling, "custom_params": custom}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def build_doc_prompt(
    tokenizer: Any,
    system: str,
    documents: Sequence[str],
    question: str,
    *,
    use_chat_template: Optional[bool] = None,
    doc_format: str = DEFAULT_DOC_FORMAT,
    question_format: str = DEFAULT_QUESTION_FORMAT,
) -> DocPrompt:
    """``(input_ids, bounds)`` for ``system``, ``documents`` (in the order given) and
    ``question``. ``use_chat_template`` defaults to whether the tokenizer has one."""
    if not documents:
        raise ValueError("build_doc_prompt needs at least one document")
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    tail_text = question_format.format(question=question)
    if use_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": _SENTINEL + tail_text}
        ]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if rendered.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not keep the user message verbatim")
        head, tail = rendered.split(_SENTINEL)
        leading = _encode(tokenizer, head)
    else:
        bos = getattr(tokenizer, "bos_token_id", None)
        leading = ([bos] if bos is not None else []) + _encode(tokenizer, f"{system}\n\n" if system else "")
        tail = tail_text + "\nAnswer:"
    if not leading:
        raise ValueError("the prompt has no tokens before its first document (no BOS, no system prompt)")
    ids = list(leading)
    bounds: list[int] = []
    for doc in documents:
        doc_ids = _encode(tokenizer, doc_format.format(doc=doc))
        if not doc_ids:
            raise ValueError("a document tokenizes to nothing")
        bounds += [len(ids), len(ids) + len(doc_ids)]
        ids += doc_ids
    ids += _encode(tokenizer, tail)
    return DocPrompt(ids, bounds)
