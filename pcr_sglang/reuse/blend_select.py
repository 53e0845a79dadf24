"""``blend`` mode's token selection: which re-placed tokens deviate most from full prefill.

CacheBlend recomputes the tokens whose KV at layer 1 differs most between the reused
(re-placed) KV and the KV full prefill would give, since those deviations grow through
the layers and concentrate where a document attends to the documents before it. Layer 0
is context-free (a projection of each token, then RoPE: the rotation is exact there, see
``doc_reuse_setup.layer0_self_test``), so full-context layer-1 KV needs only layer 0's
attention in full context and layer 0's MLP, for the reused tokens: the probe runs those
with the model's own modules on the request's layer-0 KV already in the pool (the exact
prefix and the just re-placed documents), then layer 1's projections. Its layer-1 K and V
also replace the reused ones in the private slots, as CacheBlend keeps its check layer's
fresh KV: the kept tokens are then exact through layer 1.

The selection score is CacheBlend's reference one: the squared difference of layer-1 V,
summed over heads and dimensions (V carries no position, so rotation error cannot enter).

The probe drives the decoder layers' modules directly (norms, projections, MLP) rather
than SGLang's forward, so it is allowed only for the layer classes whose structure it
reproduces (``DEVIATION_LAYERS``); :func:`deviation_support` says why not for any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

# Pre-norm decoder layers: x + attn(norm(x)), then + mlp(norm(.)), attention from a fused
# qkv projection with RoPE, no q/k norms, no soft cap, full attention.
DEVIATION_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
# Attention scores one query block of the probe aims at (heads x queries x keys): 2^26
# float32 is about 256 MiB per block, beside SGLang's own budget (approximate: a block has
# at least one query, and SDPA's temporaries, the mask and the keys come on top).
SCORE_ELEMENTS = 1 << 26


def deviation_support(model: Any) -> Optional[str]:
    """None when :class:`Layer1Deviation` can run on ``model``; else why not."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "embed_tokens", None) is None or len(layers) < 2:
        return f"{type(model).__name__} has no model.embed_tokens / two model.layers for the layer-1 probe"
    for layer in list(layers)[:2]:
        name = type(layer).__name__
        if name not in DEVIATION_LAYERS:
            return f"the layer-1 probe reproduces {', '.join(DEVIATION_LAYERS)}; this model's layers are {name}"
        attn = getattr(layer, "self_attn", None)
        for part in ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size", "head_dim", "scaling"):
            if not hasattr(attn, part):
                return f"{name}.self_attn has no {part} for the layer-1 probe"
        if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
            return f"{name} normalizes q/k, which the layer-1 probe does not reproduce"
        if float(getattr(getattr(attn, "attn", None), "logit_cap", 0.0) or 0.0) > 0:
            return f"{name} soft-caps attention logits, which the layer-1 probe does not reproduce"
        for part in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if getattr(layer, part, None) is None:
                return f"{name} has no {part} for the layer-1 probe"
    return None


@dataclass
class DeviationResult:
    deviation: torch.Tensor  # [tokens] float32, squared layer-1 V difference per reused token
    k1: torch.Tensor  # [tokens, kv_heads, head_dim] full-context layer-1 K, in the KV dtype
    v1: torch.Tensor
    # [tokens] float32: the attention the question's layer-1 queries give each reused token
    # (summed over the question's tokens and heads); None without a question.
    attention: Optional[torch.Tensor] = None


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


class Layer1Deviation:
    def __init__(self, model: Any, kv_layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.embed = model.model.embed_tokens
        self.layers = list(model.model.layers)[:2]
        self.kv_layers = kv_layers

    @torch.no_grad()
    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, prefix_slots: torch.Tensor,
            reused_slots: torch.Tensor, query_ids: Optional[torch.Tensor] = None) -> DeviationResult:
        """Full-context layer-1 KV for the reused tokens ``token_ids`` at ``positions``
        (ascending; the exact prefix's slots ``prefix_slots`` hold positions 0..), whose
        re-placed KV sits in ``reused_slots``, and its deviation from that KV. Queries run
        in blocks, so the attention scores of one block stay within ``SCORE_ELEMENTS``.

        ``query_ids``: the tokens right after the reused ones (the question). Their layer-1
        queries' attention over the reused tokens' full-context layer-1 keys is the
        query-aware selector's score (ProphetKV's idea, at the probe's one layer): layer 0
        is exact for every token and the reused tokens' layer-1 K is full prefill's here, so
        this is the attention full prefill's question gives each document token at layer 1."""
        k0_pool, v0_pool = self.kv_layers[0]
        k1_pool, v1_pool = self.kv_layers[1]
        n = token_ids.shape[0]
        hidden, q, k, v = self._layer0_qkv(token_ids, positions)
        keys = torch.cat([k0_pool[prefix_slots].to(q.dtype), k]).transpose(0, 1).unsqueeze(0)
        values = torch.cat([v0_pool[prefix_slots].to(q.dtype), v]).transpose(0, 1).unsqueeze(0)
        key_positions = torch.cat([torch.arange(prefix_slots.shape[0], device=q.device), positions])
        _, k1, v1 = self._layer1_projections(hidden, q, positions, keys, values, key_positions)
        d1 = self.layers[1].self_attn.head_dim
        k1, v1 = k1.reshape(n, -1, d1).to(k1_pool.dtype), v1.reshape(n, -1, d1).to(v1_pool.dtype)
        deviation = (v1.float() - v1_pool[reused_slots].float()).square().sum(dim=(1, 2))
        attention = None
        if query_ids is not None and query_ids.shape[0] > 0:
            attention = self._question_attention(query_ids, positions, prefix_slots, keys, values, key_positions, k1)
        return DeviationResult(deviation, k1, v1, attention)

    def _layer0_qkv(self, token_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer 0 is context-free up to its attention: the embeddings, and Q, K, V (RoPE at
        ``positions``) as [tokens, heads, head_dim]."""
        attn0 = self.layers[0].self_attn
        n, d = token_ids.shape[0], attn0.head_dim
        hidden = self.embed(token_ids)
        q, k, v = _first(attn0.qkv_proj(_first(self.layers[0].input_layernorm(hidden)))).split(
            [attn0.q_size, attn0.kv_size, attn0.kv_size], dim=-1)
        q, k = attn0.rotary_emb(positions, q, k)
        return hidden, q.reshape(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)

    def _layer1_projections(self, hidden: torch.Tensor, q: torch.Tensor, positions: torch.Tensor,
                            keys: torch.Tensor, values: torch.Tensor,
                            key_positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer 0's attention in full context (``keys``/``values`` at ``key_positions``,
        position-causal) and MLP for the tokens of ``hidden`` and ``q`` at ``positions``,
        then layer 1's Q, K, V (RoPE applied), flat per token. Queries run in blocks, so the
        attention scores of one block stay within ``SCORE_ELEMENTS``."""
        layer0, layer1 = self.layers
        attn0, attn1 = layer0.self_attn, layer1.self_attn
        n = q.shape[0]
        gqa = q.shape[1] != keys.shape[1]
        block = max(1, SCORE_ELEMENTS // (q.shape[1] * key_positions.shape[0]))
        q1_parts, k1_parts, v1_parts = [], [], []
        for begin in range(0, n, block):
            end = min(begin + block, n)
            mask = key_positions.unsqueeze(0) <= positions[begin:end].unsqueeze(1)  # [block, keys]
            out = torch.nn.functional.scaled_dot_product_attention(
                q[begin:end].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=attn0.scaling,
                enable_gqa=gqa)
            out = out.squeeze(0).transpose(0, 1).reshape(end - begin, -1)
            residual = hidden[begin:end] + _first(attn0.o_proj(out))
            residual = residual + layer0.mlp(_first(layer0.post_attention_layernorm(residual)))
            normed1 = _first(layer1.input_layernorm(residual))
            q1, k1, v1 = _first(attn1.qkv_proj(normed1)).split([attn1.q_size, attn1.kv_size, attn1.kv_size], dim=-1)
            q1, k1 = attn1.rotary_emb(positions[begin:end], q1, k1)
            q1_parts.append(q1)
            k1_parts.append(k1)
            v1_parts.append(v1)
        return torch.cat(q1_parts), torch.cat(k1_parts), torch.cat(v1_parts)

    def _question_attention(self, query_ids: torch.Tensor, positions: torch.Tensor, prefix_slots: torch.Tensor,
                            keys0: torch.Tensor, values0: torch.Tensor, key_positions0: torch.Tensor,
                            reused_k1: torch.Tensor) -> torch.Tensor:
        """Layer-1 attention of the question (``query_ids``, right after ``positions``) on
        each reused token, summed over the question's tokens and heads."""
        attn1 = self.layers[1].self_attn
        k1_pool = self.kv_layers[1][0]
        m = query_ids.shape[0]
        q_positions = torch.arange(int(positions[-1]) + 1, int(positions[-1]) + 1 + m, device=positions.device)
        hidden, q, k, v = self._layer0_qkv(query_ids, q_positions)
        keys = torch.cat([keys0, k.transpose(0, 1).unsqueeze(0)], dim=2)
        values = torch.cat([values0, v.transpose(0, 1).unsqueeze(0)], dim=2)
        all_positions = torch.cat([key_positions0, q_positions])
        q1, k1, _ = self._layer1_projections(hidden, q, q_positions, keys, values, all_positions)
        d1 = attn1.head_dim
        keys1 = torch.cat([k1_pool[prefix_slots].float(), reused_k1.float(), k1.reshape(m, -1, d1).float()])
        kv_heads = keys1.shape[1]
        queries = q1.reshape(m, kv_heads, -1, d1).float()  # [questions, kv heads, group, dim]
        block = max(1, SCORE_ELEMENTS // (queries.shape[1] * queries.shape[2] * all_positions.shape[0]))
        weights = torch.zeros(keys1.shape[0], dtype=torch.float32, device=keys1.device)
        for begin in range(0, m, block):
            end = min(begin + block, m)
            mask = all_positions.unsqueeze(0) <= q_positions[begin:end].unsqueeze(1)
            logits = torch.einsum("mkgd,lkd->mkgl", queries[begin:end], keys1) * attn1.scaling
            logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
            weights += torch.softmax(logits, dim=-1).sum(dim=(0, 1, 2))
        start = prefix_slots.shape[0]
        return weights[start:start + reused_k1.shape[0]]
