"""What calibration measures on a running document-reuse server (``python -m
pcr_tools.calibrate``): full prefill's answers from unmarked requests on that server itself
(the exact prefix cache gives full prefill's tokens), and one setting's teacher-forced top-1
agreement with them and its gold score as a share of theirs, judged by the target the server
checks the file's verdicts by. The questions, requests and scores are the accuracy
benchmark's (:mod:`pcr_eval.measure`), so a calibrated setting means what the benchmark
measures."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from pcr_eval.forcing import teacher_forced
from pcr_eval.measure import measure_reuse
from pcr_eval.scores import gold_score, gold_scores
from pcr_sglang.reuse.calibration import CalibrationTarget, SettingResult


def measure_setting(
    server: Any,
    prompts: Sequence[Any],
    references: Sequence[dict[str, Any]],
    spec: Any,
    target: CalibrationTarget,
    max_new_tokens: int,
    decode: Callable[[list[int]], str],
) -> SettingResult:
    """``spec`` measured on every prompt against its reference; refused when a request did
    not reuse every document (its figures would be another mix of exact and reused KV)."""
    rows = [measure_reuse(server, p, ref, spec, max_new_tokens, decode) for p, ref in zip(prompts, references)]
    not_reused = [p.rid for p, r in zip(prompts, rows) if not r["all_docs_reused"]]
    if not_reused:  # then the figures are another mix of exact and reused KV: nothing to calibrate on
        raise RuntimeError(
            f"{spec.name}: {len(not_reused)} of {len(rows)} requests did not reuse every document "
            f"({', '.join(not_reused[:3])}...): is the device KV pool too small?"
        )
    top1 = [r["top1"] for r in rows if r.get("top1") is not None]
    kl = [r["kl"] for r in rows if r.get("kl") is not None]
    gold = sum(gold_score(r) for r in rows)
    gold_full = sum(gold_score(r) for r in references)
    top1_mean = statistics.fmean(top1) if top1 else None
    ratio = gold / gold_full if gold_full else None
    meets = target.met_by(top1_mean, ratio)  # the rule the server checks the file's verdicts by
    setting = None if spec.value is None else float(spec.value)
    return SettingResult(
        setting=setting, top1=top1_mean, gold_ratio=ratio, kl=statistics.fmean(kl) if kl else None, meets=meets
    )


def unmarked_reference(
    server: Any, p: Any, max_new_tokens: int, top_k: int, decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    """Full prefill's answer on the reuse server itself (no marks: exact prefix caching)."""
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    body = {"input_ids": p.input_ids, "sampling_params": sampling}
    reply = server.generate(body)
    answer = list(reply["output_ids"])
    forced = teacher_forced(server, body, len(p.input_ids), answer, top_k=top_k) if answer else {"top": []}
    text = decode(answer)
    return {"answer_ids": answer, "answer": text, "top": forced["top"], **gold_scores(p.kind, text, p.question.gold)}
