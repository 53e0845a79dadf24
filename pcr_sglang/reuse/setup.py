"""``--pcr-doc-reuse``: the startup gate, and the document-reuse side wired to the model.

Re-placing a document's KV is only right if the rotation PCR applies is the model's own
RoPE. LMCache's blending shipped with no per-model gate and garbled some models (its issue
4666), so before serving, this module checks on the loaded model itself: layer 0's K for a
run of tokens at positions ``p``, rotated by ``δ``, must equal layer 0's K computed at
``p + δ`` up to rounding. Layer-0 K is a per-token projection of the embeddings followed
by RoPE, so any difference is the rotation's. A model that fails, or whose layer 0 this
check cannot run, is refused with a message naming the flag.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.core.residency import CacheState
from pcr_sglang.reuse import settings as reuse_settings
from pcr_sglang.reuse.blend_select import BlendProbe, probe_support
from pcr_sglang.reuse.bounds import EXACT_MODES, RECOMPUTE_ATTENTION_BACKENDS, RECOMPUTE_MODES
from pcr_sglang.reuse.calibration import CalibrationConditions
from pcr_sglang.reuse.gate import CalibrationGate
from pcr_sglang.reuse.mask_warmup import warm_up_position_mask
from pcr_sglang.reuse.model_rope import UnsupportedRope, model_rope_spec
from pcr_sglang.reuse.placement import DocReuse
from pcr_sglang.reuse.seam import DocReuseStatus
from pcr_sglang.transfer.rope_shift import RopeSpec, replace_layer
from pcr_sglang.transfer.warmup import warm_up_on_cuda

logger = logging.getLogger(__name__)

_SELF_TEST_TOKENS = 48
_SELF_TEST_DELTAS = (1, 977)  # and the largest the table allows, up to _SELF_TEST_MAX_POSITION
# SGLang's fp32 cos/sin table itself drifts from exact angles at long positions (t x inv_freq
# in fp32: ~2e-4 at 32k), and linear scaling grows its table past the context length without
# the factor; a wrong rotation is off by O(1), so the test stays below where either matters.
_SELF_TEST_MAX_POSITION = 8192
# Relative error of the rotated K against the freshly computed one: two roundings to the
# KV dtype at most (measured on SmolLM2-135M in bf16 and fp32: see docs/document-reuse.md).
_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-8}
_HALF_TOLERANCE = 2e-2


def doc_pad_token_id(hf_config: Any) -> int:
    """The token that fills a canonical sequence up to the chunk grid (its KV is never
    copied; any fixed token works, but the tokenizer and the scheduler must agree)."""
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(hf_config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int) and value >= 0:
            return value
    return 0


def layer0_self_test(model: Any, spec: RopeSpec, kv_dtype: torch.dtype) -> Optional[str]:
    """None when re-placed layer-0 K matches the model's own; else why not."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    embed = getattr(inner, "embed_tokens", None)
    if layers is None or embed is None or len(layers) == 0:
        return f"{type(model).__name__} has no model.layers / model.embed_tokens for the layer-0 self-test"
    layer = layers[0]
    attn = getattr(layer, "self_attn", None)
    needed = ("qkv_proj", "rotary_emb", "q_size", "kv_size", "head_dim")
    if (
        attn is None
        or getattr(layer, "input_layernorm", None) is None
        or any(not hasattr(attn, name) for name in needed)
    ):
        return f"{type(model).__name__}'s layer 0 is not a q/k/v-projection attention the self-test can run"
    weight = next(iter(embed.parameters()), None)
    device = weight.device if weight is not None else torch.device("cpu")
    vocab = int(getattr(embed, "num_embeddings", 0) or getattr(embed, "org_vocab_size", 0) or 1000)
    n = _SELF_TEST_TOKENS
    ids = (torch.arange(n, device=device) * 7919 + 11) % vocab
    positions = torch.arange(n, device=device) + 5
    with torch.no_grad():
        hidden = embed(ids)
        hidden = layer.input_layernorm(hidden)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        qkv = attn.qkv_proj(hidden)
        qkv = qkv[0] if isinstance(qkv, tuple) else qkv
        q, k, _ = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        head_dim = attn.head_dim
        heads = attn.kv_size // head_dim

        def rotated(pos: torch.Tensor) -> torch.Tensor:
            _, key = attn.rotary_emb(pos, q.clone(), k.clone())
            rotated_key: torch.Tensor = key.reshape(n, heads, head_dim).to(kv_dtype)  # the model's: untyped
            return rotated_key

        at_p = rotated(positions)
        tolerance = _TOLERANCE.get(kv_dtype, _HALF_TOLERANCE)
        cache = getattr(attn.rotary_emb, "cos_sin_cache", None)
        max_position = min(int(cache.shape[0]) if cache is not None else 4096, _SELF_TEST_MAX_POSITION)
        deltas = [d for d in _SELF_TEST_DELTAS if d + n + 5 < max_position] + [max_position - n - 5 - 1]
        for delta in deltas:
            expected = rotated(positions + delta)
            pool = torch.zeros((2 * n, heads, head_dim), dtype=kv_dtype, device=device)
            values = torch.zeros((2 * n, heads, 1), dtype=kv_dtype, device=device)
            pool[:n] = at_p
            src = torch.arange(n, device=device)
            replace_layer(pool, values, src, src + n, torch.full((n,), delta, dtype=torch.int64, device=device), spec)
            error = ((pool[n:].float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()
            if not error <= tolerance:
                return (
                    f"layer-0 K rotated by {delta} positions differs from the model's own RoPE at the new "
                    f"positions by {error:.2e} (relative; tolerance {tolerance:.0e})"
                )
    return None


def attach_doc_reuse(
    config: PCRConfig,
    state: CacheState,
    scheduler: Any,
    allocator: Any,
    tp_worker: Any,
    hf_config: Any,
    tp_size: int = 1,
    row_flags_problem: Optional[str] = None,
    model_fingerprint: str = "",
) -> Optional[DocReuse]:
    """The document-reuse side for ``--pcr-doc-reuse`` (None when off). Raises
    :class:`PCRConfigError` naming the flag when the model cannot support it.
    ``row_flags_problem``: why the server's flags cannot run a permuted row
    (``refusals.permuted_row_flags``); ``concat`` then stops reusing at the first
    document that is not cached instead of computing it in place."""
    if config.doc_reuse in EXACT_MODES:
        return None  # reorder's order is chosen in the tokenizer process; the scheduler serves it exactly
    flag = f"--pcr-doc-reuse {config.doc_reuse}"
    model = getattr(getattr(tp_worker, "model_runner", None), "model", None)
    if model is None:
        raise PCRConfigError(f"{flag}: the loaded model is not reachable from the tree cache")
    kvcache = allocator.get_kvcache()
    k_buffers, v_buffers = getattr(kvcache, "k_buffer", None), getattr(kvcache, "v_buffer", None)
    if not k_buffers or not v_buffers:
        raise PCRConfigError(
            f"{flag} needs a KV pool with per-layer K and V buffers (MHA/GQA), not {type(kvcache).__name__}"
        )
    if k_buffers[0].dim() != 3 or v_buffers[0].dim() != 3:
        raise PCRConfigError(
            f"{flag} rotates token-major K rows ([tokens, heads, head_dim]); this pool's "
            f"buffers are {tuple(k_buffers[0].shape)} (a head- or page-major layout)"
        )
    kv_dtype = k_buffers[0].dtype
    if kv_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise PCRConfigError(f"{flag} rotates K in the KV dtype; {kv_dtype} KV (quantized) is not supported")
    try:
        spec = model_rope_spec(model)
    except UnsupportedRope as e:
        raise PCRConfigError(f"{flag}: {e}") from None
    problem = layer0_self_test(model, spec, kv_dtype)
    if problem is not None:
        raise PCRConfigError(f"{flag} is refused for this model: {problem}")
    kv_layers = list(zip(k_buffers, v_buffers))
    warm_up_on_cuda(kv_layers=kv_layers, rope=spec)  # the rotation kernel compiled now, not at the first admission
    probe = None
    if config.doc_reuse in RECOMPUTE_MODES:
        problem = recompute_support(tp_worker, model, tp_size)
        if problem is not None:
            raise PCRConfigError(f"{flag} is refused: {problem}")
        if (
            isinstance(config.blend_probe_mb, bool)
            or not isinstance(config.blend_probe_mb, int)
            or config.blend_probe_mb <= 0
        ):
            raise PCRConfigError(
                f"--pcr-blend-probe-mb must be a positive number of MiB, got {config.blend_probe_mb!r}"
            )
        probe = BlendProbe(model, kv_layers, scratch_bytes=config.blend_probe_mb << 20)
        fill_gaps = True  # DocReuse fills gaps in every recompute mode (its rows are permuted anyway)
    else:
        gap_problem = row_flags_problem or permuted_row_support(tp_worker, tp_size)
        fill_gaps = gap_problem is None
        if not fill_gaps:
            logger.info(
                "PCR document reuse (concat): a request's reuse stops at its first document that is not "
                "cached; computing that document in place needs a permuted row (%s)",
                gap_problem,
            )
    # SGLang's extend kernel with the position mask compiled now, not at the first permuted admission
    warm_up_position_mask(tp_worker, model, fill_gaps=fill_gaps)
    pad = doc_pad_token_id(hf_config)
    conditions = CalibrationConditions(
        config.doc_selector, int(config.doc_anchor_tokens), str(kv_dtype).removeprefix("torch.")
    )
    calibration = calibration_status(config, model_fingerprint, conditions)
    logger.info(
        "PCR document reuse: mode %s, RoPE %s, layer-0 self-test passed, pad token %d",
        config.doc_reuse,
        spec.signature(),
        pad,
    )
    # Without an engine, a copy is ordered after the forward in flight on this stream (a
    # GPU-side wait; HiCache fences on the same one).
    forward_stream = getattr(getattr(tp_worker, "model_runner", None), "forward_stream", None)
    docs = DocReuse(
        state,
        reuse_settings.recompute(config),
        config.chunk_size,
        pad,
        spec,
        kv_layers,
        allocator,
        scheduler.keyer,
        scheduler.executor.free_private,
        probe=probe,
        fill_gaps=fill_gaps,
        engine=scheduler.engine,
        limits=reuse_settings.limits(config),
        forward_stream=forward_stream if kv_layers[0][0].is_cuda else None,
        mask_bytes=config.position_mask_mb << 20 if fill_gaps else None,
    )
    docs.calibration = with_gate(calibration, docs.server.gate)
    docs.conditions = conditions
    return docs


def with_gate(status: dict[str, Any], gate: Optional[CalibrationGate]) -> dict[str, Any]:
    """``status`` (:func:`calibration_status`'s) with the request gate's part for
    ``/server_info``: whether it only warns, why reuse stopped (None while it serves), and
    the overrides it let through (the gate's own dict, so the report stays current)."""
    if gate is None:
        return status
    return {**status, "warn": gate.warn, "stopped": gate.stopped, "overrides": gate.overrides}


def recheck_calibration(docs: DocReuseStatus, model_fingerprint: str) -> None:
    """The weights changed in place (``weight_updates.begin``, with ``model_fingerprint``
    the new namespace's): a calibration holds for the weights it was measured on only. On
    others document reuse stops (marked requests are served exactly, as with it off) and
    ``/server_info`` says why; back on the calibrated weights (a rollback) it resumes. A
    stop is not lifted by ``--pcr-doc-reuse-calibration-warn``, as a startup on other
    weights is not."""
    gate = docs.server.gate
    if gate is None:
        return
    stopped = None
    # mutant: calibration-not-rechecked-after-a-weight-update
    if model_fingerprint != gate.fingerprint:
        stopped = (
            f"the weights changed in place (fingerprint {model_fingerprint[:16]}...); the calibration "
            f"{Path(gate.file).name} was measured on {gate.fingerprint[:16]}...: document reuse is off "
            "(marked requests are served exactly) until those weights are back; calibrate these and "
            "restart with that file to reuse documents on them"
        )
    if stopped != gate.stopped:
        if stopped:
            logger.warning("PCR document reuse: %s", stopped)
        else:
            logger.info("PCR document reuse: the calibrated weights are back (%s); reuse resumes", gate.file)
    gate.stopped = stopped
    docs.calibration.update(stopped=stopped, meets_target=None if stopped else gate.meets)


def calibration_status(
    config: PCRConfig, model_fingerprint: str, conditions: Optional[CalibrationConditions] = None
) -> dict[str, Any]:
    """What is known of the mode's accuracy on this model, for the startup log and
    ``/server_info``; raises :class:`PCRConfigError` for a calibration of other weights or
    measured under other ``conditions`` (selector, anchor tokens, KV dtype), or of a mode
    that missed its target (unless ``--pcr-doc-reuse-calibration-warn``)."""
    flag = f"--pcr-doc-reuse {config.doc_reuse}"
    calibration = reuse_settings.calibration(config)
    if calibration is None:
        logger.warning(
            "PCR document reuse: %s changes answers, by an amount that depends on the model, and its "
            "accuracy on this model is unmeasured: measure it with `python -m pcr_tools.calibrate --url "
            "URL` and start with --pcr-doc-reuse-calibration FILE",
            flag,
        )
        return {"file": None, "measured": False}
    if model_fingerprint and calibration.model_fingerprint != model_fingerprint:
        raise PCRConfigError(
            f"--pcr-doc-reuse-calibration {config.doc_reuse_calibration} was measured on other "
            f"weights ({calibration.model or 'a model'} with fingerprint "
            f"{calibration.model_fingerprint[:16]}..., this server's is {model_fingerprint[:16]}...): "
            f"calibrate this model"
        )
    differences = calibration.conditions.differences(conditions) if conditions is not None else []
    if differences:
        raise PCRConfigError(
            f"--pcr-doc-reuse-calibration {config.doc_reuse_calibration} was measured under other "
            f"conditions: {'; '.join(differences)}: calibrate under this server's"
        )
    verdict = reuse_settings.calibration_verdict(config)
    assert verdict is not None
    target = calibration.target
    status = {
        "file": config.doc_reuse_calibration,
        "measured": True,
        "meets_target": verdict.meets,
        "value": verdict.value,
        "target": {"top1_min": target.top1_min, "gold_ratio_min": target.gold_ratio_min},
        "questions": calibration.questions,
        "created": calibration.created,
        "conditions": asdict(calibration.conditions),
    }
    what = (
        f"top-1 agreement >= {target.top1_min:.0%} and gold answers >= {target.gold_ratio_min:.0%} of full "
        f"prefill's on {calibration.questions} questions"
    )
    if not verdict.meets:
        if not config.doc_reuse_calibration_warn:
            raise PCRConfigError(
                f"{flag} missed its accuracy target on this model ({what}) in "
                f"{config.doc_reuse_calibration}; pass --pcr-doc-reuse-calibration-warn to serve it "
                f"anyway, or choose another mode"
            )
        logger.warning(
            "PCR document reuse: %s MISSED its accuracy target on this model (%s); served anyway "
            "(--pcr-doc-reuse-calibration-warn)",
            flag,
            what,
        )
    else:
        setting = (
            ""
            if verdict.value is None
            else (f", K={int(verdict.value)}" if config.doc_reuse == "lego" else f", R={verdict.value:g}")
        )
        logger.info("PCR document reuse: %s meets its accuracy target on this model (%s%s)", flag, what, setting)
    return status


def permuted_row_support(tp_worker: Any, tp_size: int) -> Optional[str]:
    """None when this server's attention takes a position-causal mask over a permuted row
    on one rank; else why not (what computing gap tokens in place needs)."""
    runner = getattr(tp_worker, "model_runner", None)
    backend = getattr(runner, "attn_backend", None)
    names = {type(backend).__name__}
    for part in ("prefill_backend", "decode_backend"):
        inner = getattr(backend, part, None)
        if inner is not None:
            names.add(type(inner).__name__)
    allowed = {"TorchNativeAttnBackend", "TritonAttnBackend"}
    if not names & allowed or any(n not in allowed and n != "HybridAttnBackend" for n in names):
        return (
            f"a permuted row needs --attention-backend {' or '.join(RECOMPUTE_ATTENTION_BACKENDS)} "
            f"(a position-causal mask over a permuted row); this server's is {', '.join(sorted(names))}"
        )
    if tp_size > 1:
        return "runs permuted rows on one rank only; --tp-size > 1 is not supported"
    return None


def recompute_support(tp_worker: Any, model: Any, tp_size: int) -> Optional[str]:
    """None when this server can run the recompute modes (``lego`` and ``blend``: a
    request on a recompute server may ask for either); else why not. They need an
    attention backend that takes a position-causal mask over a permuted row, and
    ``blend``'s probe runs the model's first layers (two, up to five for ``prophet``) on one rank."""
    if tp_size > 1:
        return "blend's probe runs on one rank; --tp-size > 1 is not supported (use concat)"
    return permuted_row_support(tp_worker, tp_size) or probe_support(model)
