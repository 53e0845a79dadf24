"""CPU stand-in for ``sgl_kernel`` (pcr-sglang).

Installed only on machines without CUDA, where PyPI's ``sglang-kernel`` (a 1.2 GB CUDA
build) cannot run. Functions SGLang's CPU path calls have pure-torch bodies; the rest are
named placeholders that raise :class:`SglKernelUnavailableError` when called.
"""

from __future__ import annotations

from sgl_kernel._unavailable import SglKernelUnavailableError, export_unavailable
from sgl_kernel.cpu_ops import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu

__version__ = "0.5.23+pcr.cpu"
IS_PCR_CPU_STANDIN = True

# Imported by SGLang's CPU path at module load; used only by speculative decoding,
# which has no CPU implementation here.
_CUDA_ONLY = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]

export_unavailable(globals(), "sgl_kernel", _CUDA_ONLY)

__all__ = [
    "SglKernelUnavailableError",
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    *_CUDA_ONLY,
]
