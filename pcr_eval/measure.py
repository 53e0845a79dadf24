"""One question measured through a running server, under full prefill and under a
document-reuse mode: the answers, their gold scores, teacher-forced fidelity to full
prefill (NLL, top-k KL, top-1) and TTFT. Shared by the accuracy benchmark and calibration.

Full prefill's reference comes from a ``--disable-radix-cache`` server (the benchmark) or
from unmarked requests on the reuse server itself (calibration: the exact prefix cache
gives full prefill's tokens), as the caller chooses.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

from pcr_eval.forcing import nll, teacher_forced, topk_kl
from pcr_eval.gold import GoldPrompt
from pcr_eval.requests import all_docs_reused, marked_request, served_order, warm_request
from pcr_eval.scores import gold_scores, token_f1


def measure_full(
    server: Any, p: GoldPrompt, max_new_tokens: int, top_k: int, decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    streamed = server.generate_stream({"input_ids": p.input_ids, "sampling_params": sampling})
    answer = list(streamed.final["output_ids"])
    body = {"input_ids": p.input_ids, "sampling_params": sampling}
    forced = teacher_forced(server, body, len(p.input_ids), answer, top_k=top_k) if answer else None
    gold = teacher_forced(server, body, len(p.input_ids), p.gold_ids)
    shuffled = server.generate({"input_ids": p.shuffled_ids, "sampling_params": sampling})
    text, shuffled_text = decode(answer), decode(list(shuffled["output_ids"]))
    return {
        "answer_ids": answer,
        "answer": text,
        "ttft_s": streamed.ttft_s,
        "top": forced["top"] if forced else [],
        "nll": nll(forced["logprobs"]) if forced else None,
        "gold_nll": nll(gold["logprobs"]),
        **gold_scores(p.kind, text, p.question.gold),
        "noise_f1": token_f1(shuffled_text, text),
        "noise_identical": float(list(shuffled["output_ids"]) == answer),
    }


def measure_reuse(
    server: Any,
    p: GoldPrompt,
    reference: dict[str, Any],
    spec: Any,
    max_new_tokens: int,
    decode: Callable[[list[int]], str],
    chunk_size: int = 1,
) -> dict[str, Any]:
    """``spec``: a :class:`pcr_eval.modes.ModeSpec` (mode, K or R, custom params);
    ``chunk_size``: the server's ``--pcr-chunk-size`` (``reorder``'s exact hits are whole chunks)."""
    from pcr_sglang.reuse.bounds import QUESTION_END_PARAM

    def body(tokens: int, **custom: Any) -> dict[str, Any]:
        return marked_request(p, spec, tokens, f"pcr-accuracy:{spec.name}", **custom)

    server.generate(warm_request(p, spec, f"pcr-accuracy:{spec.name}"))
    # Teacher-forced requests carry the answer after the prompt: the question selectors'
    # question ends where the prompt does, as when the answer is generated.
    forced_body = body(0, **{QUESTION_END_PARAM: len(p.input_ids)})
    streamed = server.generate_stream(body(max_new_tokens))
    answer = list(streamed.final["output_ids"])
    text = decode(answer)
    ref_ids = reference["answer_ids"]
    row: dict[str, Any] = {
        "answer_ids": answer,
        "answer": text,
        "ttft_s": streamed.ttft_s,
        "cached_tokens": int(streamed.final["meta_info"].get("cached_tokens", 0)),
        "identical": float(answer == ref_ids),
        "f1": token_f1(text, reference["answer"]),
        "recomputed_tokens": spec.recomputed_if_all_reused(p.doc_bounds),
        **gold_scores(p.kind, text, p.question.gold),
    }
    row["all_docs_reused"] = all_docs_reused(p, spec, row["cached_tokens"], chunk_size)
    order = served_order(streamed.final["meta_info"])
    if order is not None:
        row["served_order"] = order
        row["reordered"] = float(order != sorted(order))
    if ref_ids:
        ids = {t for top in reference["top"] for t in top} | set(ref_ids)
        forced = teacher_forced(server, forced_body, len(p.input_ids), ref_ids, top_k=1, token_ids=ids)
        row["nll"] = nll(forced["logprobs"])
        row["kl"] = statistics.fmean(topk_kl(top, by_id) for top, by_id in zip(reference["top"], forced["by_id"]))
        # The mode's own argmax (its top-1 over the whole vocabulary) against full prefill's.
        row["top1"] = statistics.fmean(
            float(max(mine, key=mine.get) == max(top, key=top.get))
            for top, mine in zip(reference["top"], forced["top"])
        )
    gold = teacher_forced(server, forced_body, len(p.input_ids), p.gold_ids)
    row["gold_nll"] = nll(gold["logprobs"])
    return row
