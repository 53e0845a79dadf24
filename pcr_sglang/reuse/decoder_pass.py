"""One pre-norm decoder layer driven module by module, for blend's probe
(:mod:`~pcr_sglang.reuse.blend_select`): its Q, K and V projections with RoPE, a
position-causal attention over keys gathered by the caller, then the output projection
and the MLP. The probe calls the model's own modules rather than SGLang's forward, so
each layer class it runs on must have this structure (``blend_select.PROBE_LAYERS``,
checked by ``probe_support``). The attention runs its queries in blocks, so one block's
scores stay within ``SCORE_ELEMENTS`` whatever the request's length.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# Attention scores one query block of the probe aims at (heads x queries x keys): 2^26
# float32 is about 256 MiB per block, beside SGLang's own budget (approximate: a block has
# at least one query, and SDPA's temporaries, the mask and the keys come on top).
SCORE_ELEMENTS = 1 << 26


def _first(output: Any) -> torch.Tensor:
    """A module's output tensor (SGLang's linear layers return ``(output, bias)``)."""
    first: torch.Tensor = output[0] if isinstance(output, tuple) else output
    return first


def project(module: Any, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The decoder layer ``module``'s Q, K, V for the residual stream ``hidden`` (RoPE at
    ``positions``), as [tokens, heads, head_dim]."""
    attn = module.self_attn
    n, d = hidden.shape[0], attn.head_dim
    q, k, v = torch.split(
        _first(attn.qkv_proj(_first(module.input_layernorm(hidden)))),
        [attn.q_size, attn.kv_size, attn.kv_size],
        dim=-1,
    )
    q, k = attn.rotary_emb(positions, q, k)
    return q.reshape(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)


def finish(module: Any, hidden: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
    """The residual stream after the decoder layer ``module``: its output projection and MLP."""
    residual = hidden + _first(module.self_attn.o_proj(attention_out))
    mlp_out: torch.Tensor = module.mlp(_first(module.post_attention_layernorm(residual)))
    return residual + mlp_out


def attend(
    module: Any,
    q: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    key_valid: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The decoder layer ``module``'s position-causal attention of ``q`` ([n, heads, d] at
    ``positions``) over ``keys``/``values`` ([keys, kv_heads, d] at ``key_positions``), flat
    per token. With ``weights`` ([keys] float32), each key's attention (summed over queries and
    heads) is added to it; ``key_valid`` (a [keys] mask) hides the others. Queries run
    in blocks of at most ``SCORE_ELEMENTS`` scores."""
    attn = module.self_attn
    n, heads, d = q.shape
    kv_heads = keys.shape[1]
    block = max(1, SCORE_ELEMENTS // (heads * key_positions.shape[0]))
    parts = []
    if weights is not None:  # the explicit path's scores are float32
        keys, values = keys.float(), values.float()
    for begin in range(0, n, block):
        end = min(begin + block, n)
        mask = key_positions.unsqueeze(0) <= positions[begin:end].unsqueeze(1)  # [block, keys]
        if key_valid is not None:
            mask &= key_valid
        if weights is None:
            out = torch.nn.functional.scaled_dot_product_attention(
                q[begin:end].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=heads != kv_heads,
            )
            parts.append(out.squeeze(0).transpose(0, 1).reshape(end - begin, -1))
            continue
        grouped = q[begin:end].reshape(end - begin, kv_heads, heads // kv_heads, d).float()
        probs = torch.einsum("mkgd,lkd->mkgl", grouped, keys).mul_(attn.scaling)
        probs.masked_fill_(~mask[:, None, None, :], float("-inf"))
        probs = probs.softmax(dim=-1)
        weights += probs.sum(dim=(0, 1, 2))
        out = torch.einsum("mkgl,lkd->mkgd", probs, values)
        parts.append(out.reshape(end - begin, -1).to(q.dtype))
    return torch.cat(parts)
