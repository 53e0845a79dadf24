"""What ``--enable-pcr`` refuses, decided at flag resolution (before any weight loads).

Each rule reads the resolved ``ServerArgs`` (and, for the model rules, SGLang's own
``ModelConfig`` of the checkpoint, which resolution has already built from its
``config.json``) and returns a message naming the flag and what to do instead, or None.
:func:`check_supported` runs every rule and raises one error listing every reason, so a
user fixes them all at once instead of one restart per refusal.

Why these configurations, in short:

* the model's attention is not "every layer keeps K and V for every token": sliding-window
  (hybrid SWA), state-space / linear-attention (SSM, GDN, KDA) and DeepSeek sparse
  attention (DSA) layers keep state PCR's chunk tree neither frees nor restores;
* the host tier (``--pcr-dram-gb``) copies exactly one token-major row of ``k_buffer`` and
  one of ``v_buffer`` per layer and token. That is wrong for MLA (one latent buffer), for
  KV recipes whose per-token scales live in separate buffers (``nvfp4``,
  ``fp4_mx_block16``, ``mxfp8``: the scales would be lost), and for pools that are not
  token-major (HND, AITER's ``vectorized_5d``, page-major / unified pools): a row there is
  a page, and the Triton copy kernel has no bounds check;
* layer-wise offload issues layer ``i``'s copies on the first write of layer ``i``; with
  two-batch overlap the second micro-batch has not written it yet;
* layer-wise loads (and document re-placements) are waited for, or run, when the forward
  first reads layer ``i`` (SGLang's per-layer hook); a full prefill CUDA graph replays the
  forward without running that hook, and that a breakable one (SGLang's default on CUDA)
  runs it at replay has not been shown on a GPU yet;
* pipeline stages would share one cache namespace (and one SSD directory), and a read's
  outcome is agreed across TP ranks only, not across stages;
* ``concat`` under TP: a document copy failing on one rank would change that rank's
  prefix length alone;
* a startup LoRA adapter whose files are not local cannot be fingerprinted, and the SSD
  and remote tiers would then serve a retrained adapter the old one's KV; nor can a model
  whose weights are still not found locally once SGLang has loaded them (checked where the
  tree cache is built), whose name alone would be shared by all its revisions;
* PCR's tree evicts in LRU order, so ``--radix-eviction-policy`` other than ``lru`` would
  be silently ignored.

The same conditions are checked again where the tree cache is built
(``factory.build_pcr_prefix_cache`` / ``tier_builders.build_host_pool``), as a second line of defence.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from pcr_sglang.config import PCRConfigError
from pcr_sglang.reuse.bounds import EXACT_MODES, RECOMPUTE_ATTENTION_BACKENDS, RECOMPUTE_MODES
from pcr_sglang.sglang_adapter.refusal_inputs import Rule as Rule
from pcr_sglang.sglang_adapter.refusal_inputs import SupportInputs as SupportInputs
from pcr_sglang.sglang_adapter.refusal_inputs import collect_inputs as collect_inputs
from pcr_sglang.sglang_adapter.refusal_inputs import inputs_from_server_args as inputs_from_server_args

logger = logging.getLogger(__name__)

# --kv-cache-dtype values whose SGLang pool keeps per-token scales beside k/v_buffer.
SCALE_BUFFER_KV_DTYPES = ("nvfp4", "fp4_mx_block16", "mxfp8")
OFFLOADING_LAYERWISE_MODES = ("offload", "both")


class UnsupportedConfigError(PCRConfigError):
    """``--enable-pcr`` cannot serve this configuration (the message says why and what to do)."""


def check_eviction_policy(x: SupportInputs) -> Optional[str]:
    policy = getattr(x.cfg, "radix_eviction_policy", "lru") or "lru"
    if policy != "lru":
        return f"--enable-pcr evicts chunks in LRU order only: drop --radix-eviction-policy {policy} (or pass lru)"
    return None


def check_full_attention(x: SupportInputs) -> Optional[str]:
    """SGLang's own tests, as its tree-cache builder applies them (``kv_cache_builder``)."""
    mc = x.model_config
    if mc is None:
        return None
    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_dsa
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state

    kinds = []
    if getattr(mc, "is_hybrid_swa", False):
        kinds.append("sliding-window")
    if mc.attention_arch == AttentionArch.SSM or uses_ssm_state(mc):
        kinds.append("state-space / linear-attention")
    if is_deepseek_dsa(mc.hf_config):
        kinds.append("DeepSeek sparse-attention (DSA)")
    if not kinds:
        return None
    arch = ",".join(getattr(mc.hf_config, "architectures", None) or ["?"])
    return (
        f"--enable-pcr supports models whose layers all use full attention; --model-path "
        f"{x.cfg.model_path} ({arch}) has {' and '.join(kinds)} layers: run it without --enable-pcr"
    )


def check_mla_host_tier(x: SupportInputs) -> Optional[str]:
    mc = x.model_config
    if mc is None or not x.host_tier:
        return None
    from sglang.srt.configs.model_config import AttentionArch

    if mc.attention_arch == AttentionArch.MLA:
        return (
            "--pcr-dram-gb copies separate K and V rows (MHA/GQA); this model uses MLA (one "
            "latent KV buffer): drop --pcr-dram-gb (PCR on the device pool alone works)"
        )
    return None


def check_scale_buffers(x: SupportInputs) -> Optional[str]:
    dtype = getattr(x.cfg, "kv_cache_dtype", "auto")
    if x.host_tier and dtype in SCALE_BUFFER_KV_DTYPES:
        return (
            f"--pcr-dram-gb copies only the K and V buffers, not the per-token scale buffers "
            f"of --kv-cache-dtype {dtype}: use --kv-cache-dtype auto, bf16 or fp8_e4m3/fp8_e5m2 "
            "with the host tier, or drop --pcr-dram-gb"
        )
    return None


def check_token_major_layout(x: SupportInputs) -> Optional[str]:
    if not x.host_tier:
        return None
    what = None
    if getattr(x.cfg, "enable_unified_memory", False):
        what = "--enable-unified-memory (a page-major unified pool)"
    elif getattr(x.cfg, "enable_page_major_kv_layout", False):
        what = "--enable-page-major-kv-layout"
    elif x.use_hnd_kvcache:
        what = "SGLANG_USE_HND_KVCACHE=1 (a head-major HND pool)"
    elif x.aiter_kv_layout == "vectorized_5d":
        what = "SGLANG_AITER_KV_CACHE_LAYOUT=vectorized_5d"
    if what is None:
        return None
    return (
        f"--pcr-dram-gb copies token-major (NHD) KV rows; {what} lays the pool out by pages "
        "or heads: drop that setting, or drop --pcr-dram-gb"
    )


LOADING_LAYERWISE_MODES = ("load", "both")


def prefill_graph_backend(cfg: Any) -> str:
    graphs = getattr(cfg, "cuda_graph_config", None)
    return str(getattr(getattr(graphs, "prefill", None), "backend", "disabled") or "disabled").lower()


def check_full_prefill_graph(x: SupportInputs) -> Optional[str]:
    if x.host_tier and x.pcr.layerwise in LOADING_LAYERWISE_MODES and prefill_graph_backend(x.cfg) == "full":
        return (
            f"--pcr-layerwise {x.pcr.layerwise} has each layer's copies waited for (or, for a reused "
            "document, run) where the forward first reads the layer, which a full prefill CUDA graph "
            "replays without: pass --pcr-layerwise offload (or off), or --cuda-graph-backend-prefill "
            "disabled (--cuda-graph-backend-prefill breakable is refused with it too, see below)"
        )
    return None


def check_graph_prefill_layerwise(x: SupportInputs) -> Optional[str]:
    """Layer-wise loads with a prefill CUDA graph that is not full (``breakable`` or
    another backend): SGLang runs the attention eagerly between graph segments there, so
    the per-layer read hook (``get_key_buffer``: the loads' wait) should run at replay, but
    no GPU run has shown it yet; a hook captured instead would let attention read slots
    whose copies were never waited for. Refused until a GPU run shows the hook order at
    capture and replay (issue 42)."""
    backend = prefill_graph_backend(x.cfg)
    # mutant: gpu-breakable-prefill-graph-with-layerwise-loads
    if not x.host_tier or x.pcr.layerwise not in LOADING_LAYERWISE_MODES or backend in ("disabled", "none", "full"):
        return None
    return (
        f"--pcr-layerwise {x.pcr.layerwise} with --cuda-graph-backend-prefill {backend}: that each layer's "
        "copies are waited for at a prefill graph's replay has not been shown on a GPU yet: pass "
        "--pcr-layerwise offload (or off), or --cuda-graph-backend-prefill disabled"
    )


def check_two_batch_overlap(x: SupportInputs) -> Optional[str]:
    if (
        x.host_tier
        and x.pcr.layerwise in OFFLOADING_LAYERWISE_MODES
        and getattr(x.cfg, "enable_two_batch_overlap", False)
    ):
        return (
            f"--pcr-layerwise {x.pcr.layerwise} copies layer i to the host tier when the first "
            "micro-batch writes it, before --enable-two-batch-overlap's second micro-batch has: "
            "pass --pcr-layerwise load (or off), or drop --enable-two-batch-overlap"
        )
    return None


# RoPE variants whose angle is not position x a fixed frequency per pair (so a cached K
# cannot be moved by rotating it), or that have several position components.
DOC_REUSE_REFUSED_ROPE = {
    "dynamic": "dynamic NTK scaling (frequencies depend on the sequence length)",
    "mrope": "multi-axis mRoPE",
    "default_mrope": "multi-axis mRoPE",
}


# Extend attention backends that take a position-causal mask over a permuted row.


def permuted_row_flags(cfg: Any) -> Optional[str]:
    """Why these flags cannot run a permuted row (None if they can): its extend runs under
    a position-causal mask, set where SGLang builds an eager extend. Recompute modes need
    one; ``concat`` uses one to compute an uncached document in place between reused ones."""
    prefill = getattr(cfg, "prefill_attention_backend", None) or getattr(cfg, "attention_backend", None)
    if prefill is not None and prefill not in RECOMPUTE_ATTENTION_BACKENDS:
        return (
            f"recomputes tokens inside a permuted row, which needs the "
            f"{' or '.join(RECOMPUTE_ATTENTION_BACKENDS)} attention backend for prefill; this server's is "
            f"{prefill}: pass --attention-backend triton (GPU) or torch_native (CPU), or use concat"
        )
    if getattr(cfg, "enable_dp_attention", False):
        return "is not supported with --enable-dp-attention: use concat"
    if int(getattr(cfg, "dcp_size", 1) or 1) > 1:
        return "is not supported with decode context parallelism (its extend takes no custom mask): use concat"
    if getattr(cfg, "enable_pdmux", False):
        return "is not supported with --enable-pdmux (a split prefill runs one batch over several forwards)"
    chunked = getattr(cfg, "chunked_prefill_size", None)  # SGLang mixes chunks only with chunked prefill on
    # mutant: mixed-chunk-accepted-with-permuted-rows
    if getattr(cfg, "enable_mixed_chunk", False) and not (chunked is not None and int(chunked) <= 0):
        return (
            "is not supported with --enable-mixed-chunk (a mixed forward's position mask also covers every running "
            "request's decode row, which admission cannot hold to --pcr-position-mask-mb): drop it, or use concat"
        )
    prefill_graph = prefill_graph_backend(cfg)
    if prefill_graph not in ("disabled", "none"):
        return (
            f"sets extend positions and a position-causal mask per batch, which a captured prefill CUDA "
            f"graph (backend {prefill_graph}) does not see: pass --disable-prefill-cuda-graph"
        )
    return None


def _recompute_flags(cfg: Any) -> Optional[str]:
    """Why the flags cannot run a recompute mode (None if they can): a permuted row, and
    ``blend``'s probe on one rank with the base model's layers."""
    problem = permuted_row_flags(cfg)
    if problem is not None:
        return problem
    if int(getattr(cfg, "tp_size", 1) or 1) > 1:
        return (
            "(a recompute mode: a request on it may ask for blend, whose probe runs on one rank) "
            "does not support --tp-size > 1: use concat"
        )
    if getattr(cfg, "enable_lora", False) or getattr(cfg, "lora_paths", None):
        return (
            "(a recompute mode: blend's probe runs the base model's layers) does not support LoRA adapters: use concat"
        )
    return None


def check_doc_reuse(x: SupportInputs) -> Optional[str]:
    """Document reuse rotates cached K in place of recomputing it: quantized KV and RoPE
    variants where a rotation is not a move are refused here; the loaded model's own RoPE
    is checked again at startup (``doc_reuse_setup.layer0_self_test``)."""
    if x.pcr.doc_reuse in EXACT_MODES:
        return None
    flag = f"--pcr-doc-reuse {x.pcr.doc_reuse}"
    dtype = str(getattr(x.cfg, "kv_cache_dtype", "auto") or "auto")
    if dtype not in ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"):
        return f"{flag} rotates K in the KV cache's dtype; --kv-cache-dtype {dtype} is quantized: use auto"
    if x.pcr.doc_reuse in RECOMPUTE_MODES:
        problem = _recompute_flags(x.cfg)
        if problem is not None:
            return f"{flag} {problem}"
    mc = x.model_config
    if mc is None:
        return None
    from sglang.srt.configs.model_config import AttentionArch

    if mc.attention_arch == AttentionArch.MLA:
        return f"{flag} needs separate K and V per head (MHA/GQA); this model uses MLA"
    hf = getattr(mc, "hf_text_config", None) or mc.hf_config
    scaling = getattr(hf, "rope_scaling", None) or {}
    kind = str(scaling.get("rope_type", scaling.get("type", "")) or "") if isinstance(scaling, dict) else ""
    if "mrope_section" in (scaling if isinstance(scaling, dict) else {}):
        kind = "mrope"
    if kind in DOC_REUSE_REFUSED_ROPE:
        return f"{flag} cannot move this model's cached keys: it uses {DOC_REUSE_REFUSED_ROPE[kind]}"
    return None


def check_doc_reuse_tp(x: SupportInputs) -> Optional[str]:
    """A document copy that fails on one rank (an allocation, say) makes that rank alone
    recompute the request, so the ranks would admit different prefix lengths; until that
    outcome is agreed across ranks, no document reuse under TP (recompute modes are refused
    for their own reason in :func:`check_doc_reuse`)."""
    if x.pcr.doc_reuse == "concat" and int(getattr(x.cfg, "tp_size", 1) or 1) > 1:
        return (
            "--pcr-doc-reuse concat does not support --tp-size > 1 yet (a rank-local copy failure "
            "would change one rank's prefix length): run it with TP size 1, or without document reuse"
        )
    return None


def check_pipeline_parallel(x: SupportInputs) -> Optional[str]:
    """Every pipeline stage would name its KV by the same namespace (one SSD directory, one
    key), so a stage could read another stage's layers as its own, and whether a read
    landed is agreed across TP ranks only, not across stages."""
    # mutant: pipeline-parallelism-accepted
    if int(getattr(x.cfg, "pp_size", 1) or 1) > 1:
        return (
            f"--enable-pcr does not support pipeline parallelism (--pp-size {x.cfg.pp_size}) yet: its cache "
            f"namespace does not tell the stages apart and the stages do not agree on prefix lengths; "
            f"use --tp-size instead"
        )
    return None


def check_lora_persistent_tiers(x: SupportInputs) -> Optional[str]:
    """A startup adapter's files are part of the cache namespace (``fingerprint.adapters_text``);
    one PCR cannot read (a hub id SGLang downloads itself) would be named by its path alone,
    and a persistent tier would then serve a retrained adapter the old one's KV."""
    if x.pcr.ssd_bytes <= 0 and x.pcr.remote == "off":
        return None
    from pcr_sglang.sglang_adapter.fingerprint import unresolved_adapters

    missing = unresolved_adapters(x.cfg)
    if missing:
        return (
            f"the SSD and remote tiers key KV by the LoRA adapters' files, and these are not local "
            f"folders: {', '.join(missing)}; pass local adapter folders in --lora-paths, or run without "
            f"--pcr-ssd-path/--pcr-remote"
        )
    return None


def check_weights_local(x: SupportInputs) -> Optional[str]:
    """The cache namespace names the weights by their files (``fingerprint.model_fingerprint``);
    weights PCR cannot find locally would be named by their path (hub id) and revision
    alone, so every revision pushed under that name would share the SSD and remote tiers'
    KV. Decided once SGLang has loaded the weights (a hub id is downloaded then): at flag
    resolution a hub id not yet downloaded is not refused."""
    # mutant: name-only-fingerprint-accepted-with-persistent-tiers
    if not x.weights_loaded or x.model_config is None or (x.pcr.ssd_bytes <= 0 and x.pcr.remote == "off"):
        return None
    from pcr_sglang.sglang_adapter.fingerprint import weights_are_local

    model_path = str(getattr(x.cfg, "model_path", "") or "")
    if weights_are_local(
        x.model_config, model_path, getattr(x.cfg, "revision", None), getattr(x.cfg, "download_dir", None)
    ):
        return None
    return (
        f"the SSD and remote tiers key KV by the weights' files, and those of --model-path {model_path} "
        f"are not found on this machine (the cache namespace would be its name only, shared by every "
        f"revision): download the model and pass its local folder in --model-path, or run without "
        f"--pcr-ssd-path/--pcr-remote"
    )


def check_remote(x: SupportInputs) -> Optional[str]:
    """The remote tier's probes and reads are not agreed across TP ranks (each rank has
    its own objects and its own I/O process): one rank could admit what another recomputes."""
    if x.pcr.remote != "off" and int(getattr(x.cfg, "tp_size", 1) or 1) > 1:
        return f"--pcr-remote {x.pcr.remote} does not support --tp-size > 1 yet: run it with TP size 1"
    return None


RULES: tuple[Rule, ...] = (
    check_doc_reuse,
    check_doc_reuse_tp,
    check_pipeline_parallel,
    check_lora_persistent_tiers,
    check_weights_local,
    check_remote,
    check_full_attention,
    check_mla_host_tier,
    check_scale_buffers,
    check_token_major_layout,
    check_two_batch_overlap,
    check_full_prefill_graph,
    check_graph_prefill_layerwise,
    check_eviction_policy,
)


def unsupported_reasons(inputs: SupportInputs, rules: tuple[Rule, ...] = RULES) -> list[str]:
    return [m for m in (rule(inputs) for rule in rules) if m is not None]


def check_supported(server_args: Any) -> None:
    """Raise :class:`UnsupportedConfigError` listing every reason ``--enable-pcr`` refuses."""
    reasons = unsupported_reasons(inputs_from_server_args(server_args))
    if reasons:
        raise UnsupportedConfigError("; ".join(reasons))
