"""Teacher forcing through a running server: a continuation sent after the prompt with
``return_logprob``, its per-token log-probabilities read back (and per position the top-k
tokens or chosen ids), and what the measurements make of them (NLL, a top-k KL).

Why ``logprob_start_len = len(prompt) - 1``: SGLang's ``input_token_logprobs`` has one entry
per token from ``logprob_start_len`` on, each the log-probability of that token given the
ones before; the first entry is None (the position before it is not computed). Starting one
token before the continuation, the None falls on the last prompt token and every
continuation token gets its log-probability.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence


def answer_nll(input_token_logprobs: Sequence[Sequence[Any]], answer_ids: Sequence[int]) -> float:
    """Mean negative log-likelihood per token of ``answer_ids``, from the
    ``meta_info.input_token_logprobs`` of a request of ``prompt + answer_ids`` sent with
    ``logprob_start_len = len(prompt) - 1``: one entry ``[logprob, token_id, text]`` for
    the last prompt token (logprob None) and one per answer token."""
    if not answer_ids:
        raise ValueError("an empty answer has no NLL")
    entries = list(input_token_logprobs)
    if len(entries) != len(answer_ids) + 1:
        raise ValueError(
            f"expected {len(answer_ids) + 1} input logprobs (the last prompt token and "
            f"{len(answer_ids)} answer tokens), got {len(entries)}"
        )
    tail = entries[1:]
    ids = [int(e[1]) for e in tail]
    if ids != list(answer_ids):
        raise ValueError(f"input logprobs are for tokens {ids[:8]}..., not the answer {list(answer_ids)[:8]}...")
    values = [e[0] for e in tail]
    if any(v is None for v in values):
        raise ValueError("an answer token has no logprob")
    return -sum(float(v) for v in values) / len(values)


def _positions(entries: Sequence[Any], expected: int) -> list[Any]:
    """SGLang's per-position input logprob entries from ``logprob_start_len = len(prompt) - 1``:
    the first (the last prompt token's own) is dropped."""
    entries = list(entries)
    if len(entries) != expected + 1:
        raise ValueError(f"expected {expected + 1} input logprob entries, got {len(entries)}")
    return entries[1:]


def teacher_forced(
    server: Any,
    body: dict[str, Any],
    prompt_len: int,
    continuation: Sequence[int],
    *,
    top_k: int = 0,
    token_ids: Optional[Sequence[int]] = None,
) -> dict[str, Any]:
    """``continuation`` teacher-forced after the prompt of ``body``: per token its logprob,
    and per position the ``top_k`` tokens or the logprobs of ``token_ids``."""
    request = {
        **body,
        "input_ids": list(body["input_ids"]) + list(continuation),
        "return_logprob": True,
        "logprob_start_len": prompt_len - 1,
    }
    request["sampling_params"] = {**body["sampling_params"], "max_new_tokens": 0}
    if top_k:
        request["top_logprobs_num"] = top_k
    if token_ids:
        request["token_ids_logprob"] = sorted(set(int(t) for t in token_ids))
    meta = server.generate(request)["meta_info"]
    tokens = _positions(meta["input_token_logprobs"], len(continuation))
    if [int(e[1]) for e in tokens] != list(continuation):
        raise ValueError("input logprobs are not for the teacher-forced tokens")
    out: dict[str, Any] = {
        "logprobs": [float(e[0]) for e in tokens],
        "cached_tokens": int(meta.get("cached_tokens", 0)),
    }
    if top_k:
        out["top"] = [
            {int(e[1]): float(e[0]) for e in row} for row in _positions(meta["input_top_logprobs"], len(continuation))
        ]
    if token_ids:
        out["by_id"] = [
            {int(e[1]): float(e[0]) for e in row}
            for row in _positions(meta["input_token_ids_logprobs"], len(continuation))
        ]
    return out


def topk_kl(reference_top: dict[int, float], mode_by_id: dict[int, float]) -> float:
    """KL(reference || mode) over the reference's top-k tokens and one bucket for the rest
    of the mass: by the data-processing inequality, a lower bound of the full KL."""
    kl, p_rest, q_rest = 0.0, 1.0, 1.0
    for token, lp in reference_top.items():
        lq = mode_by_id.get(token, -math.inf)
        p, q = math.exp(lp), math.exp(lq)
        p_rest, q_rest = p_rest - p, q_rest - q
        kl += p * (lp - lq) if q > 0 else (math.inf if p > 0 else 0.0)
    p_rest, q_rest = max(p_rest, 0.0), max(q_rest, 1e-12)
    if p_rest > 1e-9:
        kl += p_rest * math.log(p_rest / q_rest)
    return kl


def nll(logprobs: Sequence[float]) -> float:
    return -sum(logprobs) / len(logprobs) if logprobs else float("nan")
