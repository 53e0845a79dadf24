"""What the refusals (``refusals.py``) read: the resolved ``ServerArgs``, the PCR flags,
SGLang's ``ModelConfig`` of the checkpoint and the KV-layout environment SGLang's KV pool
will read, gathered once so that every rule sees the same inputs, at flag resolution and
again where the tree cache is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from pcr_sglang.config import PCRConfig


@dataclass(frozen=True)
class SupportInputs:
    """What the rules read: the resolved flags, the PCR flags, SGLang's model config
    (None for a dummy or absent model) and the KV-layout environment."""

    cfg: Any
    pcr: PCRConfig
    model_config: Any = None
    use_hnd_kvcache: bool = False
    aiter_kv_layout: Optional[str] = None  # only where SGLang's pool reads it (ROCm + AITER)
    weights_loaded: bool = False  # where the tree cache is built: SGLang has downloaded the weights

    @property
    def host_tier(self) -> bool:
        return self.pcr.dram_bytes > 0


Rule = Callable[[SupportInputs], Optional[str]]


def collect_inputs(cfg: Any, pcr: PCRConfig, model_config: Any, weights_loaded: bool = False) -> SupportInputs:
    """The rules' inputs: these flags and model config, and the KV-layout environment as
    SGLang's KV pool will read it (``weights_loaded``: called where the tree cache is built)."""
    from sglang.srt.environ import envs
    from sglang.srt.utils import is_hip

    aiter = bool(envs.SGLANG_USE_AITER.get()) and is_hip()
    return SupportInputs(
        cfg=cfg,
        pcr=pcr,
        model_config=model_config,
        use_hnd_kvcache=bool(envs.SGLANG_USE_HND_KVCACHE.get()),
        aiter_kv_layout=envs.SGLANG_AITER_KV_CACHE_LAYOUT.get().lower() if aiter else None,
        weights_loaded=weights_loaded,
    )


def inputs_from_server_args(server_args: Any) -> SupportInputs:
    """The rules' inputs from a resolved ``ServerArgs`` (called in the resolution hook:
    ``model_config_of`` returns the ModelConfig resolution already built from config.json)."""
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view

    cfg = resolving_view(server_args)
    model_path = str(getattr(cfg, "model_path", "") or "")
    model_config = None if model_path.lower() in ("", "none", "dummy") else model_config_of(server_args)
    return collect_inputs(cfg, PCRConfig.from_server_args(server_args), model_config)
