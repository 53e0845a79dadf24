"""Measuring document reuse through a running server, shared by ``bench.doc_reuse_accuracy``
and ``python -m pcr_tools.calibrate``: the modes and their settings (``concat``,
``lego[:K]``, ``blend[:R[:A]]``, ``reorder``), questions as token prompts, teacher forcing with top-k
log-probabilities, the top-k KL, gold scores, bootstrap intervals, and one question's
measurement under full prefill and under a mode.

Full prefill's reference comes from a ``--disable-radix-cache`` server (the benchmark) or
from unmarked requests on the reuse server itself (calibration: the exact prefix cache
gives full prefill's tokens), as the caller chooses.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from pcr_sglang.reuse.bounds import SELECTORS
from pcr_tools.tune.questions import Question
from pcr_tools.tune.scores import contains_answer, rouge_l, token_f1

BOOTSTRAP_RESAMPLES = 1000
MODES = ("concat", "lego", "blend", "reorder")


@dataclass(frozen=True)
class ModeSpec:
    """One measured configuration: a mode and, for the recompute modes, its K or R
    (None: the server's default, ``--pcr-doc-recompute-tokens`` / ``-ratio``)."""

    mode: str
    value: Optional[float] = None
    anchors: Optional[int] = None  # blend: each re-placed document's first tokens recomputed first
    selector: Optional[str] = None  # blend: one of SELECTORS (None: the server's)

    @property
    def name(self) -> str:
        if self.value is None:
            return self.mode
        name = f"{self.mode}:{int(self.value) if self.mode == 'lego' else self.value:g}"
        if self.anchors is not None:
            name += f":{self.anchors}"
        return f"{name}:{self.selector}" if self.selector else name

    def recomputed_if_all_reused(self, doc_bounds: Sequence[int]) -> int:
        """Tokens this spec recomputes in a prompt whose documents are all reused: every
        document but the first is re-placed (the first sits where its canonical KV was
        computed); the server's rule (``core.doc_reuse.with_recompute``)."""
        from pcr_sglang.flags import DEFAULT_DOC_RECOMPUTE_RATIO, DEFAULT_DOC_RECOMPUTE_TOKENS

        lengths = [end - start for start, end in zip(doc_bounds[2::2], doc_bounds[3::2])]
        if self.mode == "lego":
            k = int(self.value if self.value is not None else DEFAULT_DOC_RECOMPUTE_TOKENS)
            return sum(min(k, n) for n in lengths)
        if self.mode == "blend":
            r = float(self.value if self.value is not None else DEFAULT_DOC_RECOMPUTE_RATIO)
            return min(sum(lengths), int(round(r * sum(lengths))))
        return 0  # concat; reorder (exact: nothing re-placed, nothing recomputed)

    def custom_params(self) -> dict[str, Any]:
        from pcr_sglang.reuse.bounds import (
            ANCHOR_TOKENS_PARAM,
            DOC_MODE_PARAM,
            RECOMPUTE_RATIO_PARAM,
            RECOMPUTE_TOKENS_PARAM,
            SELECTOR_PARAM,
        )

        params: dict[str, Any] = {DOC_MODE_PARAM: self.mode}
        if self.anchors is not None:
            params[ANCHOR_TOKENS_PARAM] = int(self.anchors)
        if self.selector is not None:
            params[SELECTOR_PARAM] = self.selector
        if self.value is not None:
            if self.mode == "lego":
                params[RECOMPUTE_TOKENS_PARAM] = int(self.value)
            else:
                params[RECOMPUTE_RATIO_PARAM] = float(self.value)
        return params


def parse_mode(text: str) -> ModeSpec:
    name, _, value = text.strip().partition(":")
    if name not in MODES:
        raise argparse.ArgumentTypeError(f"unknown mode {name!r}; known: {', '.join(MODES)} "
                                         "(lego:K and blend:R set the recompute)")
    if not value:
        return ModeSpec(name)
    if name in ("concat", "reorder"):
        raise argparse.ArgumentTypeError(f"{name} recomputes nothing: it takes no :value")
    anchors: Optional[int] = None
    selector: Optional[str] = None
    if name == "blend" and ":" in value:
        value, *extras = value.split(":")
        for extra in extras:
            if extra in SELECTORS and selector is None:
                selector = extra
            elif extra.isdigit() and anchors is None:
                anchors = int(extra)
            else:
                raise argparse.ArgumentTypeError(
                    f"blend:{value}:{extra}: expected anchor tokens A (an integer >= 0) or a selector "
                    f"({', '.join(SELECTORS)})")
    try:
        number = int(value) if name == "lego" else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{name}:{value}: expected {'an integer K' if name == 'lego' else 'a ratio R'}") from None
    if (name == "lego" and number < 0) or (name == "blend" and not 0.0 <= number <= 1.0):
        raise argparse.ArgumentTypeError(
            f"{name}:{value}: {'K must be >= 0' if name == 'lego' else 'R must be in [0, 1]'}")
    return ModeSpec(name, number, anchors, selector)


def parse_modes(text: str) -> tuple[ModeSpec, ...]:
    """``--modes``: comma-separated ``concat``, ``lego[:K]``, ``blend[:R[:A][:S]]`` (A: anchor
    tokens, each re-placed document's first A recomputed first; S: the selector of the
    rest, one of ``SELECTORS``)."""
    specs = tuple(dict.fromkeys(parse_mode(n) for n in text.split(",") if n.strip()))
    if not specs:
        raise argparse.ArgumentTypeError(f"expected at least one mode; known: {', '.join(MODES)}")
    return specs


@dataclass
class GoldPrompt:
    """One question as token prompts: as asked, and with its documents shuffled."""

    index: int
    rid: str
    question: Question
    input_ids: list[int]
    doc_bounds: list[int]
    shuffled_ids: list[int]
    gold_ids: list[int]
    shuffled_bounds: list[int] = field(default_factory=list)  # the documents of shuffled_ids

    @property
    def kind(self) -> str:
        return self.question.kind

    @property
    def last_doc_end(self) -> int:
        return self.doc_bounds[-1]

    @property
    def doc_tokens(self) -> int:
        return sum(e - s for s, e in zip(self.doc_bounds[::2], self.doc_bounds[1::2]))


def gold_prompts(questions: Sequence[Question], tokenizer: Any, seed: int) -> list[GoldPrompt]:
    rng = random.Random(f"shuffle:{seed}")
    out = []
    for i, q in enumerate(questions):
        prompt, shuffled = q.prompt(tokenizer), q.shuffled(rng).prompt(tokenizer)
        gold_ids = list(tokenizer.encode(q.gold, add_special_tokens=False))
        out.append(GoldPrompt(i, f"{q.kind}-{seed}-{i}", q, list(prompt.input_ids), list(prompt.doc_bounds),
                              list(shuffled.input_ids), gold_ids, list(shuffled.doc_bounds)))
    return out


def gold_score(scores: dict[str, Optional[float]]) -> float:
    """One number per question from :func:`gold_scores`: lead F1 for ``lead`` questions,
    exact match for the others."""
    value = scores["lead_f1"] if scores.get("lead_f1") is not None else scores.get("em")
    return float(value or 0.0)


def gold_scores(kind: str, answer: str, gold: str) -> dict[str, Optional[float]]:
    """``lead``: token F1 and ROUGE-L against the lead sentence; ``needle`` and ``two_hop``:
    exact match (the answer contains the planted value)."""
    if kind == "lead":
        return {"lead_f1": token_f1(answer, gold), "lead_rouge_l": rouge_l(answer, gold), "em": None}
    return {"lead_f1": None, "lead_rouge_l": None, "em": float(contains_answer(answer, gold))}


# ------------------------------------------------------------------- teacher forcing
def _positions(entries: Sequence[Any], expected: int) -> list[Any]:
    """SGLang's per-position input logprob entries from ``logprob_start_len = len(prompt) - 1``:
    the first (the last prompt token's own) is dropped."""
    entries = list(entries)
    if len(entries) != expected + 1:
        raise ValueError(f"expected {expected + 1} input logprob entries, got {len(entries)}")
    return entries[1:]


def teacher_forced(server: Any, body: dict[str, Any], prompt_len: int, continuation: Sequence[int], *,
                   top_k: int = 0, token_ids: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """``continuation`` teacher-forced after the prompt of ``body``: per token its logprob,
    and per position the ``top_k`` tokens or the logprobs of ``token_ids``."""
    request = {**body, "input_ids": list(body["input_ids"]) + list(continuation), "return_logprob": True,
               "logprob_start_len": prompt_len - 1}
    request["sampling_params"] = {**body["sampling_params"], "max_new_tokens": 0}
    if top_k:
        request["top_logprobs_num"] = top_k
    if token_ids:
        request["token_ids_logprob"] = sorted(set(int(t) for t in token_ids))
    meta = server.generate(request)["meta_info"]
    tokens = _positions(meta["input_token_logprobs"], len(continuation))
    if [int(e[1]) for e in tokens] != list(continuation):
        raise ValueError("input logprobs are not for the teacher-forced tokens")
    out: dict[str, Any] = {"logprobs": [float(e[0]) for e in tokens],
                           "cached_tokens": int(meta.get("cached_tokens", 0))}
    if top_k:
        out["top"] = [{int(e[1]): float(e[0]) for e in row} for row in _positions(meta["input_top_logprobs"],
                                                                                   len(continuation))]
    if token_ids:
        out["by_id"] = [{int(e[1]): float(e[0]) for e in row} for row in _positions(meta["input_token_ids_logprobs"],
                                                                                     len(continuation))]
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


# ------------------------------------------------------------------- statistics
def mean_ci(values: Sequence[float], seed: int = 0) -> dict[str, Optional[float]]:
    """Mean and a 95% percentile-bootstrap interval over the values (questions)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"mean": None, "low": None, "high": None, "n": 0}
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_RESAMPLES))
    return {"mean": statistics.fmean(values), "low": means[int(0.025 * len(means))],
            "high": means[int(0.975 * len(means)) - 1], "n": len(values)}


def ratio_ci(numerator: Sequence[Optional[float]], denominator: Sequence[Optional[float]],
             seed: int = 0) -> dict[str, Optional[float]]:
    """mean(numerator) / mean(denominator) over the questions both have, with a paired
    95% bootstrap interval (the field's "% of full prefill")."""
    pairs = [(a, b) for a, b in zip(numerator, denominator) if a is not None and b is not None]
    if not pairs or not sum(b for _, b in pairs):
        return {"mean": None, "low": None, "high": None, "n": len(pairs)}
    rng = random.Random(seed)
    ratios = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        sample = rng.choices(pairs, k=len(pairs))
        den = sum(b for _, b in sample)
        if den:
            ratios.append(sum(a for a, _ in sample) / den)
    ratios.sort()
    return {"mean": sum(a for a, _ in pairs) / sum(b for _, b in pairs), "low": ratios[int(0.025 * len(ratios))],
            "high": ratios[int(0.975 * len(ratios)) - 1], "n": len(pairs)}


# ------------------------------------------------------------------- measuring
def measure_full(server: Any, p: GoldPrompt, max_new_tokens: int, top_k: int,
                 decode: Callable[[list[int]], str]) -> dict[str, Any]:
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    streamed = server.generate_stream({"input_ids": p.input_ids, "sampling_params": sampling})
    answer = list(streamed.final["output_ids"])
    body = {"input_ids": p.input_ids, "sampling_params": sampling}
    forced = teacher_forced(server, body, len(p.input_ids), answer, top_k=top_k) if answer else None
    gold = teacher_forced(server, body, len(p.input_ids), p.gold_ids)
    shuffled = server.generate({"input_ids": p.shuffled_ids, "sampling_params": sampling})
    text, shuffled_text = decode(answer), decode(list(shuffled["output_ids"]))
    return {"answer_ids": answer, "answer": text, "ttft_s": streamed.ttft_s,
            "top": forced["top"] if forced else [], "nll": nll(forced["logprobs"]) if forced else None,
            "gold_nll": nll(gold["logprobs"]), **gold_scores(p.kind, text, p.question.gold),
            "noise_f1": token_f1(shuffled_text, text), "noise_identical": float(list(shuffled["output_ids"]) == answer)}


def marked_request(p: GoldPrompt, spec: ModeSpec, max_new_tokens: int, extra_key: str,
                   **custom: Any) -> dict[str, Any]:
    """A greedy ``/generate`` body for ``p`` with its documents marked, served as ``spec``
    (``custom``: more ``custom_params``), under the cache namespace ``extra_key``."""
    from pcr_client.prompt import DocPrompt

    sampling = DocPrompt(p.input_ids, p.doc_bounds).sampling_params(temperature=0.0, max_new_tokens=max_new_tokens)
    sampling["custom_params"].update({**spec.custom_params(), **custom})
    return {"input_ids": p.input_ids, "sampling_params": sampling, "extra_key": extra_key}


def all_docs_reused(p: GoldPrompt, spec: ModeSpec, cached_tokens: int, chunk_size: int = 1) -> bool:
    """Whether a marked request reused every document: its cached tokens and the ones
    ``spec`` recomputes reach the last document's end. ``reorder``'s reuse is an exact
    prefix hit, matched in whole chunks (``chunk_size``, ``--pcr-chunk-size``): it reached
    the last whole chunk before the last document's end."""
    if spec.mode == "reorder":
        return cached_tokens >= p.last_doc_end - p.last_doc_end % max(1, chunk_size)
    return cached_tokens + spec.recomputed_if_all_reused(p.doc_bounds) == p.last_doc_end


def warm_request(p: GoldPrompt, spec: ModeSpec, extra_key: str) -> dict[str, Any]:
    """What a benchmark sends before measuring ``p`` in ``spec``: every document's
    canonical KV computed and cached, whatever the server's warm-up policy (a first
    sighting served by plain prefill would be cached exactly, and the measured request
    would reuse that exact prefix instead). ``reorder``: the documents once served in
    another order, the noise floor's (``shuffled_ids``), with no question after them, as
    a retriever returns them for another question; the measured request is then served
    in that order, its leading tokens and documents an exact prefix hit."""
    from pcr_client.prompt import DocPrompt
    from pcr_sglang.reuse.bounds import WARM_NOW_PARAM

    if spec.mode != "reorder":
        return marked_request(p, spec, 1, extra_key, **{WARM_NOW_PARAM: True})
    if not p.shuffled_bounds:
        raise ValueError(f"{p.rid}: reorder is measured after the shuffled order; this prompt has no shuffled bounds")
    ids = p.shuffled_ids[:p.shuffled_bounds[-1]]
    sampling = DocPrompt(ids, p.shuffled_bounds).sampling_params(temperature=0.0, max_new_tokens=1)
    sampling["custom_params"].update(spec.custom_params())
    return {"input_ids": ids, "sampling_params": sampling, "extra_key": extra_key}


def served_order(meta: dict[str, Any]) -> Optional[list[int]]:
    """``reorder``: the client's document indices in the order served (None: not reordered)."""
    from pcr_sglang.reuse.reorder import ORDER_META_KEY

    order = meta.get(ORDER_META_KEY)
    return [int(i) for i in order] if isinstance(order, list) else None


def measure_reuse(server: Any, p: GoldPrompt, reference: dict[str, Any], spec: Any, max_new_tokens: int,
                  decode: Callable[[list[int]], str], chunk_size: int = 1) -> dict[str, Any]:
    """``spec``: a ``bench.doc_reuse_accuracy.ModeSpec`` (mode, K or R, custom params);
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
    row: dict[str, Any] = {"answer_ids": answer, "answer": text, "ttft_s": streamed.ttft_s,
                           "cached_tokens": int(streamed.final["meta_info"].get("cached_tokens", 0)),
                           "identical": float(answer == ref_ids), "f1": token_f1(text, reference["answer"]),
                           "recomputed_tokens": spec.recomputed_if_all_reused(p.doc_bounds),
                           **gold_scores(p.kind, text, p.question.gold)}
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
        row["top1"] = statistics.fmean(float(max(mine, key=mine.get) == max(top, key=top.get))
                                       for top, mine in zip(reference["top"], forced["top"]))
    gold = teacher_forced(server, forced_body, len(p.input_ids), p.gold_ids)
    row["gold_nll"] = nll(gold["logprobs"])
    return row
