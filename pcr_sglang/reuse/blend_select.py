"""``blend`` mode's token selection: which re-placed tokens to recompute.

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

Selectors (``SELECTORS`` in ``reuse/selectors.py``), all at one recompute budget:

* ``deviation`` (CacheBlend's released code): the squared difference of layer-1 V, summed
  over heads and dimensions (V carries no position, so rotation error cannot enter).
* ``gradual`` (the CacheBlend paper's gradual filtering): layer 1's deviation keeps
  ``GRADUAL_WIDTH`` times the budget; those tokens alone go on to layer 2 (in full context:
  every reused token's layer-1 KV is exact by then), and layer 2's V deviation picks the
  budget among them. Their layer-2 KV is exact too and replaces the reused one.
* ``query`` (ProphetKV's idea at the probe's one layer): the attention the question's
  layer-1 queries give each token, over full-context layer-1 keys.
* ``prophet`` (ProphetKV's selector: the question's queries against the cached keys,
  fused over a few layers): the question runs through layers 0..``QUERY_LAYERS`` over the
  request's KV as the forward will see it (exact through layer 1, the re-placed KV above),
  and each token's attention is summed over those layers (each layer gives the same
  total, so the sum is the mean of the layers' distributions).

The layers a selector reads must be in the pool before the probe runs (``layers_read``);
the forward's layer-wise copies of the kept tokens' other layers start after it.

Anchors (the "hybrid" selector: each re-placed document's first tokens) come first at
every stage, whatever their score.

The probe drives the decoder layers' modules directly (norms, projections, MLP:
:mod:`~pcr_sglang.reuse.decoder_pass`) rather than SGLang's forward, so it is allowed
only for the layer classes whose structure it reproduces (``PROBE_LAYERS``);
:func:`probe_support` says why not for any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pcr_sglang.reuse import decoder_pass
from pcr_sglang.reuse.decoder_pass import SCORE_ELEMENTS as SCORE_ELEMENTS
from pcr_sglang.reuse.decoder_pass import attend, finish, project
from pcr_sglang.reuse.selectors import QUESTION_SELECTORS

logger = logging.getLogger(__name__)

# Pre-norm decoder layers: x + attn(norm(x)), then + mlp(norm(.)), attention from a fused
# qkv projection with RoPE, no q/k norms, no soft cap, full attention.
PROBE_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
# ``gradual``: layer 1 keeps this many times the budget for layer 2 to choose from.
GRADUAL_WIDTH = 2
# ``prophet``: the question's attention is fused over layers 1..QUERY_LAYERS (fewer on a
# shallower model). Its layers must be copied before the probe, so this bounds how much
# of the layer-wise copy the selection waits for.
# mutant: blend-prophet-fuses-layer-1-only
QUERY_LAYERS = 4


def probe_layers(kv_layers: int) -> int:
    """How many leading decoder layers the probe drives (every selector's, capped by the model)."""
    return min(kv_layers, max(3, QUERY_LAYERS + 1))


def probe_support(model: Any) -> Optional[str]:
    """None when :class:`BlendProbe` can run on ``model``; else why not."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "embed_tokens", None) is None or len(layers) < 2:
        return f"{type(model).__name__} has no model.embed_tokens / two model.layers for blend's probe"
    for layer in list(layers)[: probe_layers(len(layers))]:
        name = type(layer).__name__
        if name not in PROBE_LAYERS:
            return f"blend's probe reproduces {', '.join(PROBE_LAYERS)}; this model's layers are {name}"
        attn = getattr(layer, "self_attn", None)
        for part in ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size", "head_dim", "scaling"):
            if not hasattr(attn, part):
                return f"{name}.self_attn has no {part} for blend's probe"
        if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
            return f"{name} normalizes q/k, which blend's probe does not reproduce"
        radix = getattr(attn, "attn", None)
        if float(getattr(radix, "logit_cap", 0.0) or 0.0) > 0:
            return f"{name} soft-caps attention logits, which blend's probe does not reproduce"
        if int(getattr(radix, "sliding_window_size", -1) or -1) > 0:
            return f"{name} attends in a sliding window, which blend's probe does not reproduce"
        for part in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if getattr(layer, part, None) is None:
                return f"{name} has no {part} for blend's probe"
    return None


@dataclass
class Layer1Result:
    """The reused tokens in full context through layer 1."""

    deviation: torch.Tensor  # [tokens] float32, squared layer-1 V difference per reused token
    k1: torch.Tensor  # [tokens, kv_heads, head_dim] full-context layer-1 K, in the KV dtype
    v1: torch.Tensor
    residual: torch.Tensor  # [tokens, hidden] the residual stream after layer 0 (layer 1's input)
    q1: torch.Tensor  # [tokens, heads, head_dim] layer 1's queries (RoPE applied)
    # Layer 0's context for the question: the prefix's and the tokens' layer-0 K/V
    # ([keys, kv_heads, head_dim], the compute dtype) at ``key_positions``.
    keys0: torch.Tensor
    values0: torch.Tensor
    key_positions: torch.Tensor


@dataclass
class ExactKv:
    """Full prefill's KV at ``layer`` for the tokens at ``offsets``: it replaces the re-placed KV."""

    layer: int
    offsets: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class Selection:
    chosen: torch.Tensor  # offsets (into the probed tokens) to recompute, on the probe's device, unordered
    exact: list[ExactKv] = field(default_factory=list)


def _v_deviation(v: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """CacheBlend's score: the squared difference between full-context V and the re-placed
    V in ``slots``, summed over heads and dimensions, per token (float32)."""
    return (v.float() - v_pool[slots].float()).square().sum(dim=(1, 2))


class ProbeBudgetError(RuntimeError):
    """The probe would need more scratch memory than ``--pcr-blend-probe-mb``: the request
    is recomputed instead (the caller's fallback for any failed probe)."""


def _width(module: Any, fallback: int) -> int:
    """Output width of a (possibly tensor-parallel) linear layer, or ``fallback``."""
    for name in ("output_size_per_partition", "out_features"):
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else fallback


class BlendProbe:
    def __init__(
        self, model: Any, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], scratch_bytes: Optional[int] = None
    ):
        """``scratch_bytes`` (``--pcr-blend-probe-mb``): the most scratch memory one
        selection may need by :meth:`scratch_estimate`; a request that would need more is
        refused before anything is allocated (:class:`ProbeBudgetError`), so the probe,
        which runs beside a forward in flight, never takes more than this."""
        self.embed = model.model.embed_tokens
        self.layers = list(model.model.layers)[: probe_layers(len(kv_layers))]
        self.kv_layers = kv_layers
        self.scratch_bytes = scratch_bytes

    def scratch_estimate(self, tokens: int, prefix: int, question: int = 0) -> int:
        """Bytes of scratch one selection over ``tokens`` probed tokens after ``prefix``
        cached ones (and ``question`` question tokens) needs at most, approximately: per
        probed token its residual stream, projections and MLP activations (model dtype);
        the keys and values gathered for one layer (float32 at worst, twice: layer 0's are
        kept); one block of attention scores (float32: the scores, their softmax and the
        mask) of at most ``SCORE_ELEMENTS``."""
        weight = getattr(self.embed, "weight", None)
        element = weight.element_size() if isinstance(weight, torch.Tensor) else 4
        hidden = int(weight.shape[1]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 4096
        attn = self.layers[0].self_attn
        heads = max(1, int(getattr(attn, "q_size", hidden)) // max(1, int(getattr(attn, "head_dim", 1))))
        kv_size = int(getattr(attn, "kv_size", hidden))
        mlp = getattr(self.layers[0], "mlp", None)
        inter = _width(getattr(mlp, "gate_up_proj", mlp), 8 * hidden)
        n = tokens + question
        keys = prefix + n
        activations = n * (4 * hidden + int(getattr(attn, "q_size", hidden)) + 2 * kv_size + inter * 3 // 2) * element
        gathered = 2 * keys * 2 * kv_size * 4
        scores = min(decoder_pass.SCORE_ELEMENTS, heads * max(n, 1) * keys) * (4 + 4 + 1)
        return int(activations + gathered + scores)

    def check_budget(self, tokens: int, prefix: int, question: int = 0) -> None:
        """:class:`ProbeBudgetError` if a selection over ``tokens`` probed tokens after
        ``prefix`` cached ones (and ``question`` question tokens) could need more scratch
        than ``scratch_bytes``: the admission asks before it copies anything, and
        :meth:`select` again before it runs."""
        if self.scratch_bytes is None:
            return
        need = self.scratch_estimate(tokens, prefix, question)
        # mutant: gpu-blend-probe-over-its-budget-runs
        if need > self.scratch_bytes:
            raise ProbeBudgetError(
                f"blend's probe would need about {need / 2**20:.0f} MiB of scratch for {tokens} tokens after a "
                f"{prefix}-token prefix, over --pcr-blend-probe-mb {self.scratch_bytes / 2**20:.0f}: recomputed"
            )

    def layers_read(self, selector: str) -> int:
        """How many leading layers of the pool ``selector`` reads (they must be copied first)."""
        if selector == "gradual":
            return min(3, len(self.layers))
        if selector == "prophet":
            return min(QUERY_LAYERS + 1, len(self.layers))
        return 2

    # ------------------------------------------------------------------ the selection
    @torch.no_grad()
    def select(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        prefix_slots: torch.Tensor,
        reused_slots: torch.Tensor,
        candidates: torch.Tensor,
        count: int,
        anchored: torch.Tensor,
        selector: str,
        question_ids: Optional[torch.Tensor] = None,
        gap_offsets: Optional[torch.Tensor] = None,
    ) -> Selection:
        """The ``count`` of ``candidates`` (offsets of the re-placed tokens among
        ``token_ids``) to recompute, ranked by ``selector``; ``anchored`` (a mask over the
        candidates, on the candidates' device) come first. ``token_ids`` sit at
        ``positions`` (ascending; the exact prefix's slots ``prefix_slots`` hold positions
        0..), their re-placed KV in ``reused_slots``; ``question_ids`` follow them (the
        question selectors'; without them those rank by deviation). Nothing here waits
        for the device: the caller reads ``chosen`` back after writing ``exact``.
        ``gap_offsets``: tokens with no cached KV (the forward computes them in place),
        which the question cannot see above layer 1 before then. A selection that would
        need more than ``scratch_bytes`` raises :class:`ProbeBudgetError` first."""
        self.check_budget(
            int(token_ids.shape[0]),
            int(prefix_slots.shape[0]),
            int(question_ids.shape[0]) if question_ids is not None else 0,
        )
        first = self.layer1(token_ids, positions, prefix_slots, reused_slots)
        exact = [ExactKv(1, candidates, first.k1[candidates], first.v1[candidates])]
        if count <= 0:
            return Selection(candidates[:0], exact)
        has_question = question_ids is not None and question_ids.shape[0] > 0
        if selector in QUESTION_SELECTORS and has_question:
            assert question_ids is not None
            depth = 1 if selector == "query" else self.layers_read("prophet") - 1
            scores = self.question_attention(
                first, question_ids, positions, prefix_slots, reused_slots, depth, gap_offsets
            )[candidates]
        else:
            scores = first.deviation[candidates]
        if selector == "gradual" and len(self.layers) > 2:
            width = min(candidates.shape[0], GRADUAL_WIDTH * count)
            wide = torch.topk(scores.float().masked_fill(anchored, float("inf")), width).indices
            second, deviation2 = self.layer2_deviation(first, candidates[wide], positions, prefix_slots, reused_slots)
            # mutant: blend-gradual-keeps-re-placed-layer-2
            exact.append(second)
            scores = torch.full_like(scores, float("-inf"), dtype=torch.float32)
            scores[wide] = deviation2
        # mutant: blend-anchors-ignored-at-admission
        top = torch.topk(scores.float().masked_fill(anchored, float("inf")), count).indices
        return Selection(candidates[top], exact)

    # ------------------------------------------------------------------ layer 1 in full context
    @torch.no_grad()
    def layer1(
        self, token_ids: torch.Tensor, positions: torch.Tensor, prefix_slots: torch.Tensor, reused_slots: torch.Tensor
    ) -> Layer1Result:
        """Full-context layer-1 KV for the reused tokens ``token_ids`` at ``positions``,
        whose re-placed KV sits in ``reused_slots``, and its deviation from that KV.
        Queries run in blocks, so the attention scores of one block stay within
        ``SCORE_ELEMENTS``."""
        k0_pool, v0_pool = self.kv_layers[0]
        v1_pool = self.kv_layers[1][1]
        hidden = self.embed(token_ids)
        q, k, v = project(self.layers[0], hidden, positions)
        keys = torch.cat([k0_pool[prefix_slots].to(q.dtype), k])
        values = torch.cat([v0_pool[prefix_slots].to(q.dtype), v])
        key_positions = torch.cat([torch.arange(prefix_slots.shape[0], device=q.device), positions])
        residual = finish(self.layers[0], hidden, attend(self.layers[0], q, positions, keys, values, key_positions))
        q1, k1, v1 = project(self.layers[1], residual, positions)
        k1, v1 = k1.to(v1_pool.dtype), v1.to(v1_pool.dtype)
        deviation = _v_deviation(v1, v1_pool, reused_slots)
        return Layer1Result(deviation, k1, v1, residual, q1, keys, values, key_positions)

    def layer2_deviation(
        self,
        first: Layer1Result,
        offsets: torch.Tensor,
        positions: torch.Tensor,
        prefix_slots: torch.Tensor,
        reused_slots: torch.Tensor,
    ) -> tuple[ExactKv, torch.Tensor]:
        """Full-context layer-2 KV of the tokens at ``offsets`` (their layer-1 attention
        over every token's exact layer-1 KV: the prefix's in the pool, the reused ones'
        from ``first``; then layer 1's MLP and layer 2's projections), and its deviation
        from their re-placed layer-2 KV."""
        k1_pool, v1_pool = self.kv_layers[1]
        dtype = first.q1.dtype
        keys = torch.cat([k1_pool[prefix_slots].to(dtype), first.k1.to(dtype)])
        values = torch.cat([v1_pool[prefix_slots].to(dtype), first.v1.to(dtype)])
        out = attend(self.layers[1], first.q1[offsets], positions[offsets], keys, values, first.key_positions)
        residual = finish(self.layers[1], first.residual[offsets], out)
        _, k2, v2 = project(self.layers[2], residual, positions[offsets])
        k2_pool, v2_pool = self.kv_layers[2]
        v2 = v2.to(v2_pool.dtype)
        return ExactKv(2, offsets, k2.to(k2_pool.dtype), v2), _v_deviation(v2, v2_pool, reused_slots[offsets])

    def question_attention(
        self,
        first: Layer1Result,
        question_ids: torch.Tensor,
        positions: torch.Tensor,
        prefix_slots: torch.Tensor,
        reused_slots: torch.Tensor,
        depth: int,
        gap_offsets: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The attention the question (``question_ids``, right after ``positions``) gives
        each reused token at layers 1..``depth``, summed over layers, question tokens and
        heads. Layer 1 sees every reused token's full-context K (``first``); the layers
        above see the pool's KV (the re-placed KV: what the forward will see) but for the
        tokens at ``gap_offsets``, which hold none yet and are left out there."""
        m = question_ids.shape[0]
        start = prefix_slots.shape[0]
        q_positions = positions[-1:] + 1 + torch.arange(m, device=positions.device)  # no read-back
        all_positions = torch.cat([first.key_positions, q_positions])
        hidden = self.embed(question_ids)
        q, k, v = project(self.layers[0], hidden, q_positions)
        keys, values = torch.cat([first.keys0, k]), torch.cat([first.values0, v])
        hidden = finish(self.layers[0], hidden, attend(self.layers[0], q, q_positions, keys, values, all_positions))
        weights = torch.zeros(all_positions.shape[0], dtype=torch.float32, device=q.device)
        filled: Optional[torch.Tensor] = None
        if gap_offsets is not None and gap_offsets.numel():
            filled = torch.ones(all_positions.shape[0], dtype=torch.bool, device=q.device)
            filled[start + gap_offsets.to(q.device)] = False
        for layer in range(1, depth + 1):
            q, k, v = project(self.layers[layer], hidden, q_positions)
            k_pool, v_pool = self.kv_layers[layer]
            context = (first.k1, first.v1) if layer == 1 else (k_pool[reused_slots], v_pool[reused_slots])
            keys = torch.cat([k_pool[prefix_slots].to(q.dtype), context[0].to(q.dtype), k])
            values = torch.cat([v_pool[prefix_slots].to(q.dtype), context[1].to(q.dtype), v])
            out = attend(
                self.layers[layer],
                q,
                q_positions,
                keys,
                values,
                all_positions,
                weights,
                # mutant: blend-prophet-reads-gap-slots
                filled if layer > 1 else None,
            )
            if layer < depth:
                hidden = finish(self.layers[layer], hidden, out)
        return weights[start : start + positions.shape[0]]
