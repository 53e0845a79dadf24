"""The startup gate of --pcr-doc-reuse (``layer0_self_test``) on a layer 0 built from SGLang's
real rotary embedding: it passes with the model's own RoPE spec and refuses a wrong one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang.srt.layers.rotary_embedding import get_rope

from pcr_sglang.sglang_adapter.doc_reuse_setup import doc_pad_token_id, layer0_self_test
from pcr_sglang.sglang_adapter.rope_spec import rope_spec_of

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
    rotary = get_rope(HEAD_DIM, rotary_dim=HEAD_DIM, max_position=4096, base=10000, is_neox_style=True,
                      dtype=torch.float32, **rope)
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

    from pcr_sglang.sglang_adapter.doc_reuse_setup import recompute_support

    class FlashInferAttnBackend:  # stands for any backend without the position-causal mask
        pass

    def worker(backend):
        return SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))

    native = object.__new__(TorchNativeAttnBackend)
    assert "needs --attention-backend torch_native or triton" in recompute_support(
        worker(FlashInferAttnBackend()), None, 1)
    assert "--tp-size > 1" in recompute_support(worker(native), None, 2)
    assert "no model.embed_tokens" in recompute_support(worker(native), SimpleNamespace(), 1)


def test_blend_picks_the_most_deviating_re_placed_tokens_and_refreshes_only_those():
    """``DocReuse._blend_selection`` with a probe whose deviations are given: the top ones
    among the re-placed tokens (delta != 0), never the exact ones, whatever their score;
    the probe's layer-1 KV lands in the re-placed tokens' slots only (exact slots may be
    checkpointed into the tree and must keep the forward's own KV)."""
    from types import SimpleNamespace

    from pcr_sglang.core.doc_reuse import CopySegment, ReusePlan
    from pcr_sglang.sglang_adapter.blend_probe import ProbeResult
    from pcr_sglang.sglang_adapter.doc_reuse import DocReuse

    # Positions 4..7 exact (delta 0), 8..13 re-placed; slots 20..29 hold them.
    plan = ReusePlan((CopySegment(0, 4, 8, 4), CopySegment(1, 8, 14, 4)), 4, 14, 8, recompute_count=2)
    slots = torch.arange(20, 30)
    deviation = torch.tensor([9.0, 9.0, 9.0, 9.0, 0.1, 5.0, 0.2, 0.3, 7.0, 0.4])  # exact ones score highest
    k1 = torch.full((10, 1, 2), 1.0)
    layers = [(torch.zeros(40, 1, 2), torch.zeros(40, 1, 2)), (torch.zeros(40, 1, 2), torch.zeros(40, 1, 2))]
    calls = []

    def run(ids, positions, prefix_slots, reused_slots):
        calls.append((ids.tolist(), positions.tolist(), prefix_slots.tolist(), reused_slots.tolist()))
        return ProbeResult(deviation, k1, k1 * 2)

    node = SimpleNamespace(path_from_root=lambda: [SimpleNamespace(device_value=torch.tensor([0, 1, 2, 3]))])
    this = SimpleNamespace(probe=SimpleNamespace(run=run), kv_layers=layers)
    req = SimpleNamespace(origin_input_ids=list(range(100, 120)))
    chosen = DocReuse._blend_selection(this, req, plan, node, slots)
    assert chosen == (9, 12)
    assert calls == [(list(range(104, 114)), list(range(4, 14)), [0, 1, 2, 3], list(range(20, 30)))]
    k, v = layers[1]
    assert k[24:30].eq(1.0).all() and v[24:30].eq(2.0).all()
    assert k[20:24].eq(0).all() and v[20:24].eq(0).all()  # the exact tokens' slots untouched
    assert layers[0][0].eq(0).all()
