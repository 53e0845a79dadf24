"""Compile SGLang's Triton extend kernel in its position-mask form at startup, on every rank.

With document reuse filling gaps, a forward carrying a permuted row runs the Triton
backend's extend with PCR's position mask (:func:`pcr_sglang.reuse.rows.triton_position_mask`
in the metadata, ``skip_prefix_custom_mask=False`` from the forward hook): a specialization
of SGLang's ``_fwd_kernel`` (``USE_CUSTOM_MASK`` on, ``SKIP_PREFIX_CUSTOM_MASK`` off) no
other forward compiles. Its first launch would compile it in the scheduler thread: seconds
of stall at the first permuted admission, at different moments on different ranks.

So where the cache is assembled, on CUDA only, this module launches SGLang's own
``extend_attention_fwd`` the way ``TritonAttnBackend.forward_extend`` and PCR's hooks call
it: once per attention-layer shape (head counts, head dims, logit cap: constexprs and
``kv_group_num``) and per class Triton sorts the batch size into (an integer argument:
1, a multiple of 16, any other), over the serving pool's K/V buffers of that layer (read
only: each request's prefix is slot 0; the output goes to a scratch tensor), with the mask
and index tensors in the dtypes serving builds.

Not guaranteed to be serving's specialization: Triton also specializes integer strides on
divisibility by 16. The warm-up's q/k/v are contiguous; serving's q is often a view of the
fused qkv projection (row stride ``(heads + 2 kv_heads) x head_dim``). With a head_dim that
is a multiple of 16 every stride is; with another, serving may still compile once. Attention
sinks (passed as None here) and ``--enable-deterministic-inference`` (another kernel) are
not warmed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from pcr_sglang.reuse.rows import triton_position_mask
from pcr_sglang.transfer.warmup import WarmupReport

logger = logging.getLogger(__name__)

# One batch size per class Triton specializes the kernel's batch-size argument into.
BATCH_SIZES = (1, 2, 16)
# Per warm-up request: a one-token prefix (slot 0, SGLang's padding slot) and a two-token
# extend; request 0's row is permuted (positions 0, 2, 1), as a recompute row is.
_PREFIX, _EXTEND = 1, 2
_PERMUTED_ROW = (0, 2, 1)
KERNEL = "extend-mask"


@dataclass(frozen=True)
class ExtendShape:
    """What one attention layer makes SGLang's extend kernel specialize on, beyond the
    dtypes and the batch size (as ``TritonAttnBackend.forward_extend`` passes them)."""

    q_heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    logit_cap: float
    xai_temperature_len: int


def layer_shape(layer: Any) -> Optional[ExtendShape]:
    """``layer``'s (a ``RadixAttention``) shape, or None where its extend is not the causal
    full attention PCR masks (cross or bidirectional attention, a sliding window, a logit
    capping the Triton backend rejects: refused at startup, or never permuted)."""
    kind = getattr(getattr(layer, "attn_type", None), "value", "decoder")
    window = getattr(layer, "sliding_window_size", -1)
    if (
        kind != "decoder"
        or getattr(layer, "is_cross_attention", False)
        or (window is not None and window > -1)
        or getattr(layer, "logit_capping_method", "tanh") != "tanh"
    ):
        return None
    return ExtendShape(
        int(layer.tp_q_head_num),
        int(layer.tp_k_head_num),
        int(layer.qk_head_dim),
        int(layer.v_head_dim),
        layer.logit_cap,
        layer.xai_temperature_len,
    )


def attention_layers(model: Any) -> list[Any]:
    """The model's attention layers (SGLang's ``RadixAttention`` modules), in order."""
    needed = ("tp_q_head_num", "tp_k_head_num", "qk_head_dim", "v_head_dim", "layer_id", "scaling")
    modules: Iterable[Any] = model.modules() if hasattr(model, "modules") else ()
    return [m for m in modules if all(hasattr(m, name) for name in needed)]


def triton_extend_backend(tp_worker: Any) -> Optional[Any]:
    """The ``TritonAttnBackend`` that runs this server's extends (a hybrid's prefill side)."""
    backend = getattr(getattr(tp_worker, "model_runner", None), "attn_backend", None)
    for candidate in (backend, getattr(backend, "prefill_backend", None)):
        if type(candidate).__name__ == "TritonAttnBackend":
            return candidate
    return None


def _unwarmable(backend: Any) -> Optional[str]:
    """Why this backend's masked extend is another kernel than ``extend_attention_fwd``."""
    if getattr(backend, "enable_deterministic", False):
        return "deterministic inference runs the unified extend kernel"
    if getattr(backend, "dllm_attention", None) is not None:
        return "diffusion LM attention"
    if (getattr(backend, "dcp_size", 1) or 1) > 1:
        return "decode context parallelism"
    return None


def launch_masked_extends(
    backend: Any, layers: Iterable[Any], dtype: torch.dtype, report: WarmupReport, extend: Callable[..., Any]
) -> None:
    """``extend`` (SGLang's ``extend_attention_fwd``) once per distinct layer shape and per
    batch-size class, on that layer's pool buffers, with PCR's serving mask and flags."""
    shapes: dict[ExtendShape, Any] = {}
    for layer in layers:
        shape = layer_shape(layer)
        if shape is not None:
            shapes.setdefault(shape, layer)
    pool = backend.token_to_kv_pool
    for shape, layer in shapes.items():
        k_buffer, v_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        device = k_buffer.device
        scaled = getattr(layer, "k_scale", None) is not None and getattr(layer, "v_scale", None) is not None
        k_descale, v_descale = (layer.k_scale_float, layer.v_scale_float) if scaled else (1.0, 1.0)
        for bs in BATCH_SIZES:
            tokens, seq_len = bs * _EXTEND, _PREFIX + _EXTEND
            q = torch.zeros(tokens, shape.q_heads, shape.qk_head_dim, dtype=dtype, device=device)
            k = torch.zeros(tokens, shape.kv_heads, shape.qk_head_dim, dtype=dtype, device=device)
            v = torch.zeros(tokens, shape.kv_heads, shape.v_head_dim, dtype=dtype, device=device)
            out = torch.empty(tokens, shape.q_heads, shape.v_head_dim, dtype=dtype, device=device)
            rows = {0: torch.tensor(_PERMUTED_ROW, dtype=torch.int64, device=device)}
            mask, mask_indptr = triton_position_mask(rows, [seq_len] * bs, [_PREFIX] * bs, device)
            # The index dtypes of TritonAttnBackend.init_forward_metadata's extend metadata.
            qo_dtype = getattr(getattr(backend, "qo_indptr", None), "dtype", torch.int64)
            kv_dtype = getattr(getattr(backend, "kv_indptr", None), "dtype", torch.int32)
            qo_indptr = torch.arange(0, tokens + 1, _EXTEND, dtype=qo_dtype, device=device)
            kv_indptr = torch.arange(0, bs * _PREFIX + 1, _PREFIX, dtype=kv_dtype, device=device)
            kv_indices = torch.zeros(bs * _PREFIX, dtype=torch.int64, device=device)  # slot 0
            extend(
                q,
                k,
                v,
                out,
                k_buffer,
                v_buffer,
                qo_indptr,
                kv_indptr,
                kv_indices,
                mask,
                True,
                mask_indptr,
                _EXTEND,
                k_descale,
                v_descale,
                layer.scaling,
                logit_cap=shape.logit_cap,
                sliding_window_size=-1,
                sinks=None,
                window_kv_offsets=None,
                xai_temperature_len=shape.xai_temperature_len,
                page_size=getattr(backend, "page_size", 1) or 1,
                score_mod=None,
                aux_tensors=None,
                extend_seq_lens_cpu=[_EXTEND] * bs,
                # mutant: position-mask-warm-up-skips-the-prefix
                skip_prefix_custom_mask=False,  # as forward_hooks.triton_extend_kernel: the prefix masked too
            )
            detail = f"batch {bs}, heads {shape.q_heads}/{shape.kv_heads}, dims {shape.qk_head_dim}/{shape.v_head_dim}"
            report.launches.append((KERNEL, int(layer.layer_id), detail))


def warm_up_position_mask(
    tp_worker: Any,
    model: Any,
    *,
    fill_gaps: bool,
    on_cuda: Optional[bool] = None,
    extend: Optional[Callable[..., Any]] = None,
    synchronize: Optional[Callable[[], None]] = None,
) -> Optional[WarmupReport]:
    """Where the cache is assembled (on each rank): compile SGLang's masked extend kernel
    if permuted rows can run (``fill_gaps``) through the Triton backend on CUDA; else
    None, launching nothing. Waits for the launches. A launch that fails is logged and
    left to compile at first use, as without this warm-up: it never stops the server.

    ``on_cuda``, ``extend``, ``synchronize``: decided from the pool's device, the backend's
    kernel, and ``torch.cuda.synchronize``; tests pass stand-ins to check on CPU."""
    try:
        return _warm_up(tp_worker, model, fill_gaps, on_cuda, extend, synchronize)
    except Exception as e:  # a warm-up only saves time: serving compiles at first use instead
        logger.warning(
            "PCR: compiling SGLang's masked extend kernel at startup failed (%s); it compiles at first use", e
        )
        return None


def _warm_up(
    tp_worker: Any,
    model: Any,
    fill_gaps: bool,
    on_cuda: Optional[bool],
    extend: Optional[Callable[..., Any]],
    synchronize: Optional[Callable[[], None]],
) -> Optional[WarmupReport]:
    backend = triton_extend_backend(tp_worker)
    if not fill_gaps or backend is None:
        return None
    layers = attention_layers(model)
    if not layers:
        return None
    if on_cuda is None:
        on_cuda = backend.token_to_kv_pool.get_key_buffer(layers[0].layer_id).device.type == "cuda"
    if not on_cuda:
        return None
    why_not = _unwarmable(backend)
    if why_not is not None:
        logger.info("PCR: SGLang's masked extend kernel is not compiled at startup (%s)", why_not)
        return None
    runner = getattr(tp_worker, "model_runner", None)
    dtype = getattr(runner, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        dtype = backend.token_to_kv_pool.get_key_buffer(layers[0].layer_id).dtype
    report = WarmupReport()
    start = time.monotonic()
    with torch.no_grad():
        launch_masked_extends(backend, layers, dtype, report, extend or backend.extend_attention_fwd)
    (synchronize or torch.cuda.synchronize)()
    report.seconds = time.monotonic() - start
    logger.info(
        "PCR: compiled SGLang's Triton extend kernel with the position mask at startup (%d launches: batch "
        "sizes %s for %s; %.1f s)",
        len(report.launches),
        ", ".join(map(str, BATCH_SIZES)),
        "; ".join(sorted({detail.split(", ", 1)[1] for _, _, detail in report.launches})),
        report.seconds,
    )
    return report
