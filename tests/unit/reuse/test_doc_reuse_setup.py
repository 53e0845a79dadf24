"""The startup gate of --pcr-doc-reuse (``layer0_self_test``) on a layer 0 built from SGLang's
real rotary embedding: it passes with the model's own RoPE spec and refuses a wrong one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sglang.srt.layers.rotary_embedding import get_rope

from pcr_sglang.reuse.model_rope import rope_spec_of
from pcr_sglang.reuse.setup import doc_pad_token_id, layer0_self_test

HEAD_DIM, HEADS, KV_HEADS, HIDDEN, VOCAB = 32, 4, 2, 64, 500


class _Attention(torch.nn.Module):
    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.q_size, self.kv_size, self.head_dim = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HEAD_DIM
        self.qkv_proj = torch.nn.Linear(HIDDEN, self.q_size + 2 * self.kv_size, bias=False)
        self.rotary_emb = rotary


class _Layer(torch.nn.Module):
    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.input_layernorm = torch.nn.LayerNorm(HIDDEN)
        self.self_attn = _Attention(rotary)


class _Inner(torch.nn.Module):
    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([_Layer(rotary)])


class _Model(torch.nn.Module):
    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.model = _Inner(rotary)


def _model(**rope) -> _Model:
    torch.manual_seed(0)
    rotary = get_rope(
        HEAD_DIM, rotary_dim=HEAD_DIM, max_position=4096, base=10000, is_neox_style=True, dtype=torch.float32, **rope
    )
    return _Model(rotary)


@pytest.mark.parametrize("rope", [{}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}])
def test_the_models_own_rope_passes(rope):
    model = _model(**rope)
    spec = rope_spec_of(model.model.layers[0].self_attn.rotary_emb)
    assert layer0_self_test(model, spec, torch.float32) is None


def test_a_wrong_rotation_is_refused():
    model = _model()
    spec = rope_spec_of(model.model.layers[0].self_attn.rotary_emb)
    wrong_base = dataclasses.replace(spec, inv_freq=tuple(f * 1.01 for f in spec.inv_freq))
    assert "differs from the model's own RoPE" in layer0_self_test(model, wrong_base, torch.float32)
    wrong_pairing = dataclasses.replace(spec, is_neox_style=False)
    assert "differs from the model's own RoPE" in layer0_self_test(model, wrong_pairing, torch.float32)


def test_a_model_without_the_layout_is_refused():
    assert "no model.layers" in layer0_self_test(torch.nn.Linear(2, 2), None, torch.float32)


def test_pad_token_prefers_pad_then_eos_then_bos():
    config = type("C", (), {})()
    assert doc_pad_token_id(config) == 0
    config.bos_token_id = 5
    assert doc_pad_token_id(config) == 5
    config.eos_token_id = [7, 8]
    assert doc_pad_token_id(config) == 7
    config.pad_token_id = 2
    assert doc_pad_token_id(config) == 2


# ---------------------------------------------------------------------------- recompute modes
def test_recompute_needs_a_masking_backend_one_rank_and_a_probe_able_model():
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from pcr_sglang.reuse.setup import recompute_support

    class FlashInferAttnBackend:  # stands for any backend without the position-causal mask
        pass

    def worker(backend):
        return SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))

    native = object.__new__(TorchNativeAttnBackend)
    assert "needs --attention-backend torch_native or triton" in recompute_support(
        worker(FlashInferAttnBackend()), None, 1
    )
    assert "--tp-size > 1" in recompute_support(worker(native), None, 2)
    assert "no model.embed_tokens" in recompute_support(worker(native), SimpleNamespace(), 1)
    # What concat needs to compute an uncached document in place: the mask, one rank; no probe.
    from pcr_sglang.reuse.setup import permuted_row_support

    assert permuted_row_support(worker(native), 1) is None
    assert "needs --attention-backend torch_native or triton" in permuted_row_support(
        worker(FlashInferAttnBackend()), 1
    )
    assert "--tp-size > 1" in permuted_row_support(worker(native), 2)


@pytest.mark.parametrize(
    "backend, tp_size, flags_problem, fills",
    [
        ("torch_native", 1, None, True),
        ("flashinfer", 1, None, False),
        ("torch_native", 2, None, False),
        ("torch_native", 1, "is not supported with --enable-pdmux", False),
    ],
    ids=["torch-native", "flashinfer", "tp2", "pdmux"],
)
def test_a_concat_server_fills_gaps_only_where_its_attention_takes_permuted_rows(
    backend, tp_size, flags_problem, fills, caplog, monkeypatch
):
    """``attach_doc_reuse`` for ``concat``: a document with no cached KV between reused
    ones is computed in place only where the attention takes a position-causal mask on
    one rank and the flags allow a permuted row; elsewhere reuse stops at it, logged."""
    import logging
    from types import SimpleNamespace

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from pcr_sglang.config import PCRConfig
    from pcr_sglang.reuse.setup import attach_doc_reuse

    class FlashInferAttnBackend:
        pass

    attn = object.__new__(TorchNativeAttnBackend) if backend == "torch_native" else FlashInferAttnBackend()
    kv = SimpleNamespace(k_buffer=[torch.zeros(8, KV_HEADS, HEAD_DIM)], v_buffer=[torch.zeros(8, KV_HEADS, HEAD_DIM)])
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=_model(), attn_backend=attn))
    scheduler = SimpleNamespace(
        keyer=SimpleNamespace(request_root=lambda tenant: b"root"),
        executor=SimpleNamespace(free_private=lambda slots: None),
        engine=None,
    )
    from pcr_sglang.reuse import setup

    warmed = []  # the masked-extend warm-up is asked with the verdict on gaps
    monkeypatch.setattr(setup, "warm_up_position_mask", lambda w, m, *, fill_gaps: warmed.append(fill_gaps))
    with caplog.at_level(logging.INFO, logger="pcr_sglang.reuse.setup"):
        docs = attach_doc_reuse(
            PCRConfig(enabled=True, doc_reuse="concat"),
            None,
            scheduler,
            SimpleNamespace(get_kvcache=lambda: kv),
            worker,
            SimpleNamespace(),
            tp_size=tp_size,
            row_flags_problem=flags_problem,
        )
    assert docs.fill_gaps is fills and warmed == [fills]
    assert ("reuse stops at its first document that is not cached" in caplog.text) is not fills


def test_blend_selection_asks_the_probe_about_re_placed_tokens_and_refreshes_only_theirs():
    """``DocCopier._blend_selection`` with a stand-in probe: it is asked to choose among the
    re-placed tokens (delta != 0) only, with the plan's count, anchors, selector, gaps and,
    for the question selectors, the tokens after the documents (up to the request's
    question end); the exact KV it returns lands in those tokens' slots only (exact slots
    may be checkpointed into the tree and must keep the forward's own KV)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from pcr_sglang.reuse.blend_select import ExactKv, Selection
    from pcr_sglang.reuse.doc_copy import DocCopier
    from pcr_sglang.reuse.plan import CopySegment, ReusePlan
    from pcr_sglang.transfer.rope_shift import RopeSpec

    # Positions 4..7 exact (delta 0), 8..13 re-placed; slots 20..29 hold them.
    plan = ReusePlan(
        (CopySegment(0, 4, 8, 4), CopySegment(1, 8, 14, 4)), 4, 14, 8, recompute_count=2, selector="deviation"
    )
    slots = torch.arange(20, 30)
    layers = [(torch.zeros(40, 1, 2), torch.zeros(40, 1, 2)) for _ in range(3)]
    calls = []

    def select(ids, positions, prefix_slots, reused_slots, candidates, count, anchored, selector, question, gaps):
        calls.append(
            dict(
                ids=ids.tolist(),
                positions=positions.tolist(),
                prefix=prefix_slots.tolist(),
                slots=reused_slots.tolist(),
                candidates=candidates.tolist(),
                count=count,
                anchored=anchored.tolist(),
                selector=selector,
                question=None if question is None else question.tolist(),
                gaps=gaps.tolist(),
            )
        )
        n = len(candidates)
        exact = [
            ExactKv(1, candidates, torch.full((n, 1, 2), 1.0), torch.full((n, 1, 2), 2.0)),
            ExactKv(2, candidates[:2], torch.full((2, 1, 2), 3.0), torch.full((2, 1, 2), 4.0)),
        ]
        return Selection(torch.tensor([5, 8]), exact)

    node = SimpleNamespace(path_from_root=lambda: [SimpleNamespace(device_value=torch.tensor([0, 1, 2, 3]))])
    this = DocCopier(
        layers,
        RopeSpec(2, 2, True, (1.0,)),
        allocator=None,
        probe=SimpleNamespace(select=select, layers_read=lambda selector: 3),
    )
    req = SimpleNamespace(origin_input_ids=list(range(100, 120)))
    assert this._blend_selection(req, plan, node, slots) == (9, 12)
    assert calls[-1] == dict(
        ids=list(range(104, 114)),
        positions=list(range(4, 14)),
        prefix=[0, 1, 2, 3],
        slots=list(range(20, 30)),
        candidates=[4, 5, 6, 7, 8, 9],
        count=2,
        anchored=[False] * 6,
        selector="deviation",
        question=None,
        gaps=[],
    )
    k1, v1 = layers[1]
    assert k1[24:30].eq(1.0).all() and v1[24:30].eq(2.0).all()
    assert k1[20:24].eq(0).all() and v1[20:24].eq(0).all()  # the exact tokens' slots untouched
    k2, v2 = layers[2]
    assert k2[24:26].eq(3.0).all() and v2[24:26].eq(4.0).all() and k2[26:].eq(0).all() and k2[:24].eq(0).all()
    assert layers[0][0].eq(0).all()
    this._blend_selection(req, replace(plan, anchors=(8, 9)), node, slots)
    assert calls[-1]["anchored"] == [True, True, False, False, False, False]
    # The question selectors get the tokens after the documents; a teacher-forced request
    # marks where its question ends, and the answer after it is not read.
    for selector in ("query", "prophet"):
        this._blend_selection(req, replace(plan, selector=selector), node, slots)
        assert calls[-1]["selector"] == selector and calls[-1]["question"] == list(range(114, 120))
    this._blend_selection(req, replace(plan, selector="prophet", question_end=17), node, slots)
    assert calls[-1]["question"] == [114, 115, 116]
    this._blend_selection(req, replace(plan, selector="gradual"), node, slots)
    assert calls[-1]["question"] is None
    gapped = ReusePlan(
        (CopySegment(0, 4, 8, 4), CopySegment(1, 10, 14, 4)),
        4,
        14,
        8,
        recompute_count=2,
        gaps=((8, 10),),
        selector="deviation",
    )
    this._blend_selection(req, gapped, node, slots)
    assert calls[-1]["gaps"] == [4, 5] and calls[-1]["candidates"] == [6, 7, 8, 9]


def _stand_in_model(layers: int, hidden: int = 16, heads: int = 4, kv_heads: int = 2, dim: int = 4):
    """A stand-in for a decoder's modules (the probe's fidelity to SGLang's layers is
    checked end to end against transformers in tests/e2e/test_doc_reuse.py)."""
    from types import SimpleNamespace

    def linear(n_in, n_out):
        layer = torch.nn.Linear(n_in, n_out, bias=False)
        return lambda x: (layer(x), None)

    def rope(positions, q, k):  # any position-dependent map stands for RoPE here
        return q * positions[:, None].cos(), k * positions[:, None].sin()

    def layer():
        attn = SimpleNamespace(
            qkv_proj=linear(hidden, (heads + 2 * kv_heads) * dim),
            o_proj=linear(heads * dim, hidden),
            rotary_emb=rope,
            q_size=heads * dim,
            kv_size=kv_heads * dim,
            head_dim=dim,
            scaling=0.5,
        )
        return SimpleNamespace(
            self_attn=attn,
            input_layernorm=torch.nn.LayerNorm(hidden),
            post_attention_layernorm=torch.nn.LayerNorm(hidden),
            mlp=torch.nn.Linear(hidden, hidden),
        )

    torch.manual_seed(0)
    model = SimpleNamespace(
        model=SimpleNamespace(embed_tokens=torch.nn.Embedding(50, hidden), layers=[layer() for _ in range(layers)])
    )
    pools = [(torch.randn(40, kv_heads, dim), torch.randn(40, kv_heads, dim)) for _ in range(layers)]
    return model, pools


# Six probed tokens at positions 5..10 (the prefix in slots 20..24, theirs in 30..35), the
# question after them; tokens 1..5 re-placed.
PROBE_ARGS = (torch.tensor([3, 9, 4, 7, 1, 8]), torch.arange(5, 11), torch.arange(20, 25), torch.arange(30, 36))
CANDIDATES = torch.arange(1, 6)
QUESTION = torch.tensor([11, 12, 13])


def test_the_probe_gives_the_same_kv_and_scores_in_any_query_blocks(monkeypatch):
    """The probe bounds its attention scores by running queries in blocks: one query per
    block and all at once give the same layer-1 KV and deviations, the same layer-2 KV
    (gradual) and the same question attention over four layers (prophet)."""
    from pcr_sglang.reuse import blend_select, decoder_pass

    model, pools = _stand_in_model(5)
    probe = blend_select.BlendProbe(model, pools)

    def run():
        first = probe.layer1(*PROBE_ARGS)
        second, _ = probe.layer2_deviation(first, CANDIDATES, PROBE_ARGS[1], PROBE_ARGS[2], PROBE_ARGS[3])
        attention = probe.question_attention(first, QUESTION, PROBE_ARGS[1], PROBE_ARGS[2], PROBE_ARGS[3], 4)
        return first.k1, first.v1, first.deviation, second.k, second.v, attention

    whole = run()
    monkeypatch.setattr(decoder_pass, "SCORE_ELEMENTS", 1)  # the attention's query blocks
    for a, b in zip(whole, run()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_selector_picks_its_count_anchors_first():
    """Each selector returns the budget's count of candidates, the anchored
    ones among them whatever their score; ``deviation`` is the top of layer 1's deviation
    and refreshes layer 1; ``gradual`` also refreshes layer 2 for its finalists (twice the
    budget) and picks among them."""
    from pcr_sglang.reuse.blend_select import BlendProbe

    model, pools = _stand_in_model(5)
    probe = BlendProbe(model, pools)
    deviation = probe.layer1(*PROBE_ARGS).deviation[CANDIDATES]
    none = torch.zeros(5, dtype=torch.bool)
    anchored = torch.tensor([False, False, False, False, True])
    for selector in ("deviation", "gradual", "query", "prophet"):
        for anchors in (none, anchored):
            chosen = probe.select(*PROBE_ARGS, CANDIDATES, 2, anchors, selector, QUESTION).chosen
            assert len(set(chosen.tolist())) == 2, selector
            assert set(chosen.tolist()) <= set(CANDIDATES.tolist()), selector
            assert not anchors.any() or 5 in chosen.tolist(), selector
    by_deviation = probe.select(*PROBE_ARGS, CANDIDATES, 2, none, "deviation", QUESTION)
    assert sorted(by_deviation.chosen.tolist()) == sorted(CANDIDATES[torch.topk(deviation, 2).indices].tolist())
    assert [e.layer for e in by_deviation.exact] == [1]
    gradual = probe.select(*PROBE_ARGS, CANDIDATES, 2, none, "gradual", QUESTION)
    finalists = CANDIDATES[torch.topk(deviation, 4).indices]
    assert [e.layer for e in gradual.exact] == [1, 2] and set(gradual.exact[1].offsets.tolist()) == set(
        finalists.tolist()
    )
    assert set(gradual.chosen.tolist()) <= set(finalists.tolist())
    # Among the finalists, layer 2's deviation picks (not layer 1's).
    first = probe.layer1(*PROBE_ARGS)
    second, _ = probe.layer2_deviation(first, finalists, *PROBE_ARGS[1:])
    deviation2 = (second.v.float() - pools[2][1][PROBE_ARGS[3][finalists]].float()).square().sum(dim=(1, 2))
    assert sorted(gradual.chosen.tolist()) == sorted(finalists[torch.topk(deviation2, 2).indices].tolist())
    torch.testing.assert_close(gradual.exact[1].v, second.v)
    weakest = torch.zeros(5, dtype=torch.bool)
    weakest[int(deviation.argmin())] = True  # anchored: a finalist, whatever its deviation
    anchored_finalists = probe.select(*PROBE_ARGS, CANDIDATES, 2, weakest, "gradual", QUESTION).exact[1].offsets
    assert int(CANDIDATES[weakest]) in anchored_finalists.tolist() and len(anchored_finalists) == 4
    assert (probe.layers_read("deviation"), probe.layers_read("gradual"), probe.layers_read("prophet")) == (2, 3, 5)


def test_gradual_and_prophet_reduce_to_deviation_and_query_on_two_layers():
    """On a two-layer model there is no layer 2: ``gradual`` is ``deviation`` and
    ``prophet`` fuses layer 1 alone, which is ``query``."""
    from pcr_sglang.reuse.blend_select import BlendProbe

    model, pools = _stand_in_model(2)
    probe = BlendProbe(model, pools)
    none = torch.zeros(5, dtype=torch.bool)

    def chosen(selector):
        return sorted(probe.select(*PROBE_ARGS, CANDIDATES, 2, none, selector, QUESTION).chosen.tolist())

    assert chosen("gradual") == chosen("deviation") and chosen("prophet") == chosen("query")
    assert probe.layers_read("gradual") == probe.layers_read("prophet") == 2


def test_prophet_does_not_read_what_gap_slots_hold_above_layer_1():
    """A gap's slots hold no KV before the forward computes it: above layer 1 the question
    must not attend them, so what they hold cannot move the scores (it moves them when the
    gap is not declared)."""
    from pcr_sglang.reuse.blend_select import BlendProbe

    model, pools = _stand_in_model(5)
    probe = BlendProbe(model, pools)
    gaps = torch.tensor([0])  # token 0 (slot 30) is a gap
    first = probe.layer1(*PROBE_ARGS)
    before = probe.question_attention(first, QUESTION, *PROBE_ARGS[1:], 4, gaps)
    unmasked = probe.question_attention(first, QUESTION, *PROBE_ARGS[1:], 4)
    for k, v in pools[2:]:
        k[30].normal_()
        v[30].normal_()
    torch.testing.assert_close(probe.question_attention(first, QUESTION, *PROBE_ARGS[1:], 4, gaps), before)
    assert not torch.allclose(probe.question_attention(first, QUESTION, *PROBE_ARGS[1:], 4), unmasked)
    # At layer 1 the gap is seen: its full-context KV is the probe's own.
    torch.testing.assert_close(
        probe.question_attention(first, QUESTION, *PROBE_ARGS[1:], 1, gaps),
        probe.question_attention(first, QUESTION, *PROBE_ARGS[1:], 1),
    )


def test_blend_copies_the_layers_its_selector_reads_before_the_probe_and_the_rest_after():
    """``_keep_unrecomputed``: every candidate's first layers (as many as the selector
    reads) are copied before the probe, the kept tokens' other layers after it; a question
    selector with no question after the documents is run (and copied for) as deviation.
    What it placed comes back (the plan served, the kept slots, the row), nothing kept."""
    from types import SimpleNamespace

    from pcr_sglang.reuse.doc_copy import DocCopier
    from pcr_sglang.reuse.plan import CopySegment, ReusePlan, row_order

    plan = ReusePlan((CopySegment(0, 4, 8, 4), CopySegment(1, 8, 14, 4)), 4, 14, 8, recompute_count=2)
    for selector, question_after, first in (
        ("deviation", True, 2),
        ("gradual", True, 3),
        ("prophet", True, 5),
        ("prophet", False, 2),
    ):
        copies, probed, freed = [], [], []

        def copy(plan, chains, slots, layers=None, keep=None):
            copies.append((list(layers), None if keep is None else keep.tolist()))

        def blend_selection(req, plan, node, slots):
            probed.append(plan.selector)
            return (9, 12)

        this = SimpleNamespace(
            copy=copy,
            _blend_selection=blend_selection,
            kv_layers=[None] * 8,
            probe=SimpleNamespace(layers_read={"deviation": 2, "gradual": 3, "prophet": 5}.get),
            allocator=SimpleNamespace(free=lambda slots: freed.append(slots.tolist())),
        )
        req = SimpleNamespace(origin_input_ids=list(range(100, 120 if question_after else 114)))
        asked = ReusePlan(**{**plan.__dict__, "selector": selector})
        placed = DocCopier._keep_unrecomputed(this, req, asked, {}, None, torch.arange(20, 30))
        expected = "deviation" if not question_after else selector
        assert probed == [expected] and placed.plan.selector == expected and placed.plan.recompute == (9, 12)
        kept = [True] * 10
        kept[9 - 4] = kept[12 - 4] = False
        assert copies == [(list(range(first)), None), (list(range(first, 8)), kept)], selector
        assert placed.slots.tolist() == [20, 21, 22, 23, 24, 26, 27, 29] and freed == [[25, 28]]
        assert placed.row == row_order(placed.plan) and placed.row.positions[-2:] == (9, 12)


def test_a_load_that_did_not_go_through_leaves_no_row_order_behind():
    """A recompute request loaded at an admission SGLang then gave up on is matched again:
    its slots are freed and its old row order dropped, so a new plan without recompute
    (its exact prefix grew meanwhile) cannot permute a row that is in order."""
    from types import SimpleNamespace

    from pcr_sglang.reuse.bounds import DocSpan, Recompute
    from pcr_sglang.reuse.placement import DocReuse, DocReuseStats, _Planned
    from pcr_sglang.reuse.plan import RowOrder

    freed = []
    docs = object.__new__(DocReuse)
    docs.free_slots = freed.append
    docs.stats = DocReuseStats()
    docs.chunk, docs.pad_token_id, docs.fill_gaps = 4, 0, True
    docs.keyer = SimpleNamespace(request_root=lambda tenant: b"root")
    docs.state = SimpleNamespace(match=lambda keys, touch=False: SimpleNamespace(device=0, host=0, nodes=[]))
    entry = _Planned((DocSpan(0, 2, 6), DocSpan(1, 6, 10)), Recompute("lego", 2))
    entry.slots, entry.row = torch.arange(8), RowOrder(2, (2, 3, 4, 5, 8, 9, 6, 7))
    docs._requests = {"r": entry}
    req = SimpleNamespace(
        rid="r", sampling_params=None, origin_input_ids=list(range(12)), extra_key=None, cache_salt=None
    )
    assert docs.plan(req, list(range(11)), exact_len=0) is None  # nothing cached now
    assert len(freed) == 1 and freed[0].tolist() == list(range(8))
    assert docs.row("r") is None and entry.row is None


def test_the_null_collaborator_answers_every_question_document_reuse_answers():
    """``NoDocReuse`` stands in for ``DocReuse`` without --pcr-doc-reuse: both answer every
    question of the seam the adapter holds them through (``reuse/seam.py``), with the seam's
    parameters, and the null collaborator answers nothing else (a rename on one side fails
    here, not in a server without document reuse; mypy checks the types where the scheduler
    loop holds them)."""
    import inspect
    import re

    from pcr_sglang.reuse.disabled import NoDocReuse
    from pcr_sglang.reuse.placement import DocReuse
    from pcr_sglang.reuse.seam import DocReuseRows, DocReuseSeam, SchedulerDocReuse

    names = sorted(n for n in vars(NoDocReuse) if not n.startswith("_"))
    seam = sorted({n for face in (SchedulerDocReuse, DocReuseRows) for n in vars(face) if not n.startswith("_")})
    assert names == seam and not [n for n in vars(DocReuseSeam) if not n.startswith("_")]
    for name in names:
        real, null = inspect.getattr_static(DocReuse, name, None), vars(NoDocReuse)[name]
        if callable(null):
            assert callable(real), name
            wanted = list(inspect.signature(real).parameters)
            assert list(inspect.signature(null).parameters) == wanted, name
            face = SchedulerDocReuse if name in vars(SchedulerDocReuse) else DocReuseRows
            assert list(inspect.signature(vars(face)[name]).parameters) == wanted, name
        else:  # an attribute: a class attribute, or set on every instance
            assigned = re.search(rf"self\.{name}\b[^=\n]*=", inspect.getsource(DocReuse.__init__))
            assert real is not None or assigned, name
