"""The attention pattern ``--pcr-doc-reuse concat`` serves, as a differentiable forward of a
Hugging Face causal LM.

A marked prompt is ``S ‖ d_1 ‖ ... ‖ d_n ‖ tail`` (``S``: every token before the first
document). The server gives each document the KV of its *canonical* sequence ``S ‖ d_i``
(the document computed right behind ``S``, never behind another document), with K rotated
by ``δ_i = start_i - |S|`` so that it sits at its true position, and computes every other
token (the tail, and any tokens between documents) in place, attending to all the KV
before it. The first document's ``δ`` is 0: its KV is exactly prefix caching's.

That is not one forward with a mask: a document's hidden states are computed at its
canonical positions while the tail reads its keys at the true ones. So this module does
what the server does, step for step and with autograd through all of it: one batched
forward of the canonical sequences, the keys re-rotated by ``δ`` with the model's own
rotary table, the KV assembled in prompt order into a ``DynamicCache``, and the other
tokens run over it. Training on this forward is training on what is served
(``tests/e2e/test_doc_reuse.py`` checks the logits against a live server's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MarkedPrompt:
    """A prompt's token ids and its documents' ``[start, end)`` offsets (flat, as in
    ``custom_params["pcr_doc_bounds"]``)."""

    input_ids: tuple[int, ...]
    doc_bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        bounds = self.doc_bounds
        if not bounds or len(bounds) % 2:
            raise ValueError("doc_bounds must be a non-empty flat list of [start, end) pairs")
        previous_end = 0
        for start, end in zip(bounds[::2], bounds[1::2]):
            if not previous_end <= start < end <= len(self.input_ids):
                raise ValueError(f"document [{start}, {end}) is empty, out of order or past the prompt")
            previous_end = end
        if bounds[0] == 0:
            raise ValueError("a marked prompt needs tokens before its first document (S)")

    @property
    def leading_len(self) -> int:
        return self.doc_bounds[0]

    def documents(self) -> list[tuple[int, int]]:
        return list(zip(self.doc_bounds[::2], self.doc_bounds[1::2]))


def _decoder(model: Any) -> Any:
    """The decoder stack of a causal LM (through a PEFT wrapper, if any)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def rotate_keys(model: Any, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """``keys`` ([batch, kv_heads, tokens, head_dim], RoPE already applied) moved by
    ``delta`` positions: ``R(p + δ) = R(δ) R(p)``. The angles come from the model's own
    rotary module (its scaling included); its ``attention_scaling`` (YaRN's mscale) is
    divided out, since the keys carry it once already."""
    if delta == 0:
        return keys
    rotary = _decoder(model).rotary_emb
    position = torch.tensor([[delta]], device=keys.device)
    cos, sin = rotary(keys, position)  # [1, 1, head_dim], scaled by attention_scaling
    scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    cos, sin = (cos / scale).to(keys.dtype)[:, None], (sin / scale).to(keys.dtype)[:, None]
    half = keys.shape[-1] // 2
    rotated_half = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    # mutant: tune-forward-without-rotation
    return keys * cos + rotated_half * sin


def _canonical_kv(model: Any, prompt: MarkedPrompt) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, per document: the (K, V) of ``S ‖ d_i`` at the document's rows, K moved
    to the document's true position. One padded batch for all documents (padding on the
    right cannot change a causal prefix)."""
    ids = prompt.input_ids
    s_len = prompt.leading_len
    sequences = [list(ids[:s_len]) + list(ids[start:end]) for start, end in prompt.documents()]
    width = max(len(seq) for seq in sequences)
    device = _device(model)
    batch = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(batch)
    for row, seq in enumerate(sequences):
        batch[row, : len(seq)] = torch.tensor(seq, device=device)
        mask[row, : len(seq)] = 1
    # The decoder alone: the documents' logits are never needed (nothing is predicted from
    # reused KV), and the LM head over every row would cost as much as several layers.
    cache = _decoder(model)(input_ids=batch, attention_mask=mask, use_cache=True).past_key_values
    per_layer = []
    for layer in cache.layers:
        docs = []
        for row, (start, end) in enumerate(prompt.documents()):
            k = layer.keys[row : row + 1, :, s_len : s_len + end - start]
            v = layer.values[row : row + 1, :, s_len : s_len + end - start]
            docs.append((rotate_keys(model, k, start - s_len), v))
        per_layer.append(docs)
    return per_layer


def served_logits(
    model: Any, prompt: MarkedPrompt, continuation: Sequence[int] = (), *, mode: str = "concat"
) -> torch.Tensor:
    """Logits ``[tokens, vocab]`` at every position after the last document (the tail, then
    ``continuation``): row ``j`` predicts token ``last_end + j + 1``. (The server extends
    these tokens; the prediction at the last document's own last token is never served
    from reused KV.)

    ``mode`` ``"concat"`` is the served reuse pattern; ``"full"`` is full prefill of the same
    tokens (the reference, and what unmarked requests get)."""
    ids = list(prompt.input_ids) + list(continuation)
    last_end = prompt.documents()[-1][1]
    if last_end >= len(ids):
        raise ValueError("nothing follows the last document: no position to predict from")
    if mode == "full":
        # Only the rows after the last document go through the LM head (``logits_to_keep``):
        # over a whole prompt the head costs as much as several layers.
        return model(
            input_ids=torch.tensor([ids], device=_device(model)), use_cache=False, logits_to_keep=len(ids) - last_end
        ).logits[0]
    cache = served_cache(model, prompt, mode=mode)
    return _extend(model, cache, ids, last_end, len(ids))


def served_cache(model: Any, prompt: MarkedPrompt, *, mode: str = "concat") -> Any:
    """The KV the server holds for ``prompt`` up to its last document's end, as a
    ``DynamicCache``: ``S`` computed exactly, each document's canonical KV re-placed, tokens
    between documents computed in place."""
    if mode != "concat":
        raise ValueError(f"unknown mode {mode!r} (concat or full)")
    ids = list(prompt.input_ids)
    canonical = _canonical_kv(model, prompt)
    cache = _empty_cache(model)
    _fill(model, cache, ids, 0, prompt.leading_len)  # S: exact, the request's own prefix
    position = prompt.leading_len
    for index, (start, end) in enumerate(prompt.documents()):
        if start > position:
            _fill(model, cache, ids, position, start)  # tokens between documents
        for layer_index, layer in enumerate(canonical):
            k, v = layer[index]
            cache.update(k, v, layer_index)
        position = end
    return cache


def _empty_cache(model: Any) -> Any:
    from transformers import DynamicCache

    config = getattr(model, "config", None)
    return DynamicCache(config=config) if config is not None else DynamicCache()


def _in_place(model: Any, cache: Any, ids: Sequence[int], start: int, end: int) -> dict[str, Any]:
    """The forward's arguments that run ``ids[start:end]`` at their true positions over
    ``cache`` (which grows)."""
    device = _device(model)
    positions = torch.arange(start, end, device=device)[None]
    return {
        "input_ids": torch.tensor([list(ids[start:end])], device=device),
        "position_ids": positions,
        "cache_position": positions[0],
        "past_key_values": cache,
        "use_cache": True,
    }


def _extend(model: Any, cache: Any, ids: Sequence[int], start: int, end: int, *, keep: int = 0) -> torch.Tensor:
    """Run ``ids[start:end]`` at their true positions over ``cache``; their logits (the last
    ``keep`` rows only, when ``keep`` > 0)."""
    return model(**_in_place(model, cache, ids, start, end), logits_to_keep=keep).logits[0]


def _fill(model: Any, cache: Any, ids: Sequence[int], start: int, end: int) -> None:
    """:func:`_extend` for KV alone: the decoder without the LM head, whose logits would go unused."""
    _decoder(model)(**_in_place(model, cache, ids, start, end))


@torch.no_grad()
def served_generate(
    model: Any, prompt: MarkedPrompt, max_new_tokens: int, *, mode: str = "concat", stop_ids: Sequence[int] = ()
) -> list[int]:
    """Greedy decoding (temperature 0) under ``mode``: what the server answers."""
    ids = list(prompt.input_ids)
    last_end = prompt.documents()[-1][1]
    if mode == "full":
        cache = _empty_cache(model)
        logits = _extend(model, cache, ids, 0, len(ids), keep=1)
    else:
        cache = served_cache(model, prompt, mode=mode)
        logits = _extend(model, cache, ids, last_end, len(ids), keep=1)
    answer: list[int] = []
    stops = set(stop_ids)
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        if token in stops:
            break
        answer.append(token)
        ids.append(token)
        logits = _extend(model, cache, ids, len(ids) - 1, len(ids))
    return answer


def _device(model: Any) -> torch.device:
    return getattr(model, "device", None) or torch.device("cpu")
