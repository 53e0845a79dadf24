"""Document reuse from SGLang's frontend DSL: mark documents in the program's text.

SGLang's DSL sends a program's text, and the server tokenizes it as one string; document
reuse needs each document tokenized alone and its token offsets sent along. So a program
wraps each document in :func:`doc`, and :class:`DocReuseEndpoint` (a ``RuntimeEndpoint``)
turns the text into ``input_ids``, the leading text, each marked document and the rest
tokenized one by one, with ``custom_params["pcr_doc_bounds"]``::

    import sglang as sgl
    from pcr_client.frontend import DocReuseEndpoint, doc

    @sgl.function
    def rag(s, documents, question):
        s += "Answer from the documents.\\n\\n" + "".join(doc(d) for d in documents)
        s += "Question: " + question + "\\nAnswer:" + sgl.gen("answer", max_tokens=64)

    sgl.set_default_backend(DocReuseEndpoint("http://127.0.0.1:30000"))

The markers are two private-use characters; a generation call without them is sent as
text, exactly as ``RuntimeEndpoint`` would, and calls the endpoint does not convert
(``select``, prefix caching) see the text with the markers removed.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import requests
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.interpreter import StreamExecutor
from sglang.lang.ir import SglSamplingParams

from pcr_wire import DOC_BOUNDS_PARAM

logger = logging.getLogger(__name__)

DOC_OPEN, DOC_CLOSE = "\ue000", "\ue001"
_PASSED_THROUGH = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def doc(text: str) -> str:
    """``text`` marked as one document of the prompt."""
    if DOC_OPEN in text or DOC_CLOSE in text:
        raise ValueError("a document may not contain the document markers")
    return DOC_OPEN + text + DOC_CLOSE


def strip_markers(text: str) -> str:
    return text.replace(DOC_OPEN, "").replace(DOC_CLOSE, "")


def marked_input(tokenizer: Any, text: str) -> Optional[tuple[list[int], list[int]]]:
    """``(input_ids, bounds)`` for a text with marked documents, or None if it has none.
    The text before the first document is tokenized as the server would tokenize a prompt
    (special tokens added: BOS); documents and the text between and after, alone."""
    if DOC_OPEN not in text:
        return None
    head, rest = text.split(DOC_OPEN, 1)
    ids = list(tokenizer(head).input_ids)
    bounds: list[int] = []
    pieces = (DOC_OPEN + rest).split(DOC_OPEN)[1:]
    for piece in pieces:
        if piece.count(DOC_CLOSE) != 1:
            raise ValueError("document markers are unbalanced (use pcr_client.frontend.doc)")
        body, after = piece.split(DOC_CLOSE)
        body_ids = tokenizer.encode(body, add_special_tokens=False)
        if body_ids:
            bounds += [len(ids), len(ids) + len(body_ids)]
            ids += body_ids
        ids += tokenizer.encode(after, add_special_tokens=False)
    return ids, bounds


class DocReuseEndpoint(RuntimeEndpoint):
    """A ``RuntimeEndpoint`` that sends marked documents as token ids with their bounds."""

    def __init__(self, base_url: str, *args: Any, tokenizer: Any = None, **kwargs: Any):
        super().__init__(base_url, *args, **kwargs)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                self.model_info["tokenizer_path"] or self.model_info["model_path"]
            )
        self.tokenizer = tokenizer

    def _payload(self, s: StreamExecutor, sampling_params: SglSamplingParams) -> Optional[dict]:
        marked = marked_input(self.tokenizer, s.text_)
        if marked is None:
            return None
        self._handle_dtype_to_regex(sampling_params)
        ids, bounds = marked
        # Unset DSL parameters are None; SGLang's /generate contract refuses some of them
        # beside input_ids, so only the set ones are sent.
        params = {k: v for k, v in sampling_params.to_srt_kwargs().items() if v is not None}
        if bounds:
            params["custom_params"] = {DOC_BOUNDS_PARAM: bounds}
        data: dict[str, Any] = {"input_ids": ids, "sampling_params": params}
        for item in _PASSED_THROUGH:
            value = getattr(sampling_params, item, None)
            if value is not None:
                data[item] = value
        self._add_images(s, data)
        return data

    def generate(self, s: StreamExecutor, sampling_params: SglSamplingParams):
        data = self._payload(s, sampling_params)
        if data is None:
            return super().generate(s, sampling_params)
        res = requests.post(
            self.base_url + "/generate",
            json=data,
            headers=self._headers(),
            verify=self.verify if self.verify is not None else True,
            timeout=None,
        )
        self._check(res)
        obj = res.json()
        return obj["text"], obj["meta_info"]

    def generate_stream(self, s: StreamExecutor, sampling_params: SglSamplingParams):
        data = self._payload(s, sampling_params)
        if data is None:
            yield from super().generate_stream(s, sampling_params)
            return
        data["stream"] = True
        res = requests.post(
            self.base_url + "/generate",
            json=data,
            headers=self._headers(),
            stream=True,
            verify=self.verify if self.verify is not None else True,
            timeout=None,
        )
        self._check(res)
        pos = 0
        for line in res.iter_lines(decode_unicode=False):
            line = line.decode("utf-8")
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:].strip("\n"))
            text = chunk["text"][pos:]
            pos += len(text)
            yield text, chunk["meta_info"]

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @staticmethod
    def _check(res: requests.Response) -> None:
        if res.status_code != 200:
            raise RuntimeError(res.text)

    @contextmanager
    def _plain(self, s: StreamExecutor) -> Iterator[None]:
        text = s.text_
        s.text_ = strip_markers(text)
        try:
            yield
        finally:
            s.text_ = text

    def select(self, s: StreamExecutor, *args: Any, **kwargs: Any):
        with self._plain(s):
            return super().select(s, *args, **kwargs)

    def cache_prefix(self, prefix_str: str):
        return super().cache_prefix(strip_markers(prefix_str))
