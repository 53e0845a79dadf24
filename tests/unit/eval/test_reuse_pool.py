"""Pooling runs of the questions workload (pcr_eval/pool.py) on results written by hand."""

from __future__ import annotations

import json

import pytest

from pcr_eval import pool as reuse_pool
from pcr_eval.gold import GoldPrompt
from pcr_eval.questions_report import FULL, summarize_full, summarize_mode
from pcr_eval.scores import gold_scores
from pcr_tools.tune.questions import KINDS, Question

PER_SEED = 3


def prompts_for(seed: int, count: int) -> list[GoldPrompt]:
    out = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        q = Question(kind, ("d0", "d1", "d2"), f"q{seed}-{i}?", "gold", (1,), ("a", "b", "c"))
        out.append(
            GoldPrompt(i, f"{kind}-{seed}-{i}", q, list(range(40)), [5, 15, 15, 25, 25, 35], list(range(40)), [7])
        )
    return out


def full_row(seed: int, i: int) -> dict:
    kind = KINDS[i % len(KINDS)]
    return {
        "answer_ids": [1],
        "answer": "x",
        "ttft_s": 0.2,
        "nll": 1.0 + i,
        "gold_nll": 2.0,
        **gold_scores(kind, "gold answer" if (seed + i) % 2 else "no", "gold"),
        "noise_f1": 0.5,
        "noise_identical": 0.0,
    }


def mode_row(seed: int, i: int) -> dict:
    return {
        **full_row(seed, i),
        "ttft_s": 0.1,
        "identical": float(i % 2),
        "f1": 0.5 + 0.1 * i,
        "recomputed_tokens": 2 + seed,
        "all_docs_reused": True,
        "nll": 1.5 + i,
        "kl": 0.1 * (seed + 1),
        "top1": 0.9,
    }


def write_run(path, model: str, seeds: list[int], modes: dict) -> None:
    rows = []
    for seed in seeds:
        for p in prompts_for(seed, PER_SEED):
            rows.append(
                {"rid": p.rid, "kind": p.kind, "models": {model: {m: make(seed, p.index) for m, make in modes.items()}}}
            )
    path.write_text(json.dumps({"meta": {"seeds": seeds, "questions": PER_SEED * len(seeds)}, "rows": rows}))


def base_row(seed: int, i: int) -> dict:
    """The base model's full prefill: other gold scores than the tuned model's own."""
    kind = KINDS[i % len(KINDS)]
    return {
        **full_row(seed, i),
        "nll": 3.0 + i,
        "gold_nll": 1.0 + seed,
        **gold_scores(kind, "gold answer" if i % 2 == 0 else "no", "gold"),
    }


def test_pooled_runs_equal_one_run_over_all_their_questions(tmp_path):
    a, b, base = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "base.json"
    write_run(a, "tuned", [0], {FULL: full_row, "blend": mode_row})
    write_run(b, "M", [1, 2], {FULL: full_row, "blend": mode_row})  # another run's model and seeds
    write_run(base, "base", [0, 1, 2], {FULL: base_row})
    # The sources named in another order than their seeds, the base in one run for all three.
    summaries, counts, left_out = reuse_pool.pool(
        [reuse_pool.Source(base, "base")],
        [
            reuse_pool.Series.parse(f"tuned/gradual={b}:M:blend,{a}:tuned:blend"),
            reuse_pool.Series.parse(f"tuned/{FULL}={b}:M:{FULL},{a}:tuned:{FULL}"),
        ],
        prompts_for,
    )
    assert counts == {"tuned/gradual": 9, f"tuned/{FULL}": 9} and not any(left_out.values())
    prompts = [p for seed in (0, 1, 2) for p in prompts_for(seed, PER_SEED)]
    full = [full_row(seed, i) for seed in (0, 1, 2) for i in range(PER_SEED)]
    base_full = [base_row(seed, i) for seed in (0, 1, 2) for i in range(PER_SEED)]
    mine = [mode_row(seed, i) for seed in (0, 1, 2) for i in range(PER_SEED)]
    assert summaries["tuned"]["gradual"] == summarize_mode(mine, prompts, base_full, full, 0)
    assert summaries["tuned"][FULL] == summarize_full(full, prompts, base_full, 0)
    # Base and own full prefill are told apart: the gold ratio is against the base, the NLL ratio the own.
    assert summaries["tuned"]["gradual"] != summarize_mode(mine, prompts, full, full, 0)
    assert summaries["tuned"]["gradual"] != summarize_mode(mine, prompts, base_full, base_full, 0)
    assert summaries["tuned"]["gradual"]["kl"]["mean"] == pytest.approx((0.1 * 3 + 0.2 * 3 + 0.3 * 3) / 9)


def test_a_question_in_two_runs_is_an_error_and_one_without_a_base_is_left_out(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    write_run(a, "base", [0], {FULL: full_row})
    write_run(b, "tuned", [0], {FULL: full_row, "blend": mode_row})
    write_run(c, "tuned", [0, 1], {FULL: full_row, "blend": mode_row})
    with pytest.raises(ValueError, match=f"in two runs .{b} and {c}."):
        reuse_pool.pool(
            [reuse_pool.Source(a, "base")],
            [reuse_pool.Series.parse(f"tuned/blend={b}:tuned:blend,{c}:tuned:blend")],
            prompts_for,
        )
    only_c = [reuse_pool.Series.parse(f"tuned/blend={c}:tuned:blend")]
    summaries, counts, left_out = reuse_pool.pool([reuse_pool.Source(a, "base")], only_c, prompts_for)
    assert counts == {"tuned/blend": PER_SEED} and left_out == {"tuned/blend": PER_SEED}  # seed 1: no base
    with pytest.raises(ValueError, match="labelled tuned/blend"):
        reuse_pool.pool(
            [reuse_pool.Source(a, "base")], [reuse_pool.Series.parse(f"tuned/blend={c}:tuned:blend")] * 2, prompts_for
        )
    with pytest.raises(ValueError, match="mixes full prefill"):
        reuse_pool.pool(
            [reuse_pool.Source(a, "base")],
            [reuse_pool.Series.parse(f"tuned/x={b}:tuned:blend,{c}:tuned:{FULL}")],
            prompts_for,
        )
    assert reuse_pool.targets(summaries, "blend")[0].startswith("targets: need series")
    with pytest.raises(ValueError, match="no mode 'lego'"):
        reuse_pool.pool([reuse_pool.Source(a, "base")], [reuse_pool.Series.parse(f"t/l={c}:tuned:lego")], prompts_for)


def test_specs_parse_modes_with_colons_and_refuse_malformed_ones(tmp_path):
    s = reuse_pool.Series.parse("tuned/gradual=r.json:tuned:blend:0.15:gradual")
    assert s.sources[0].mode == "blend:0.15:gradual" and s.model_label == "tuned"
    for bad in ("tuned=r.json:tuned:blend", "tuned/x=r.json:tuned", "tuned/x="):
        with pytest.raises(ValueError):
            reuse_pool.Series.parse(bad)
    with pytest.raises(ValueError):
        reuse_pool.Source.parse("r.json", with_mode=False)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a questions-workload result"):
        reuse_pool.pool([reuse_pool.Source(tmp_path / "bad.json", "base")], [], prompts_for)
