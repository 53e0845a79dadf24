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
