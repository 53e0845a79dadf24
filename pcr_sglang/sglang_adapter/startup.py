"""What is checked when SGLang resolves its arguments: whether PCR is selected, and the
flags, conflicts and features it refuses with a message naming the flag (before any
weight loads; the model-side refusals are ``refusals.py``)."""

from __future__ import annotations

from typing import Any

from pcr_sglang.flags import flag_value

BACKEND_NAME = "pcr"


class PCRStartupError(RuntimeError):
    """pcr-sglang cannot start: the installation or the flags are wrong."""


def pcr_selected(server_args: Any) -> bool:
    """``--enable-pcr`` or ``--radix-cache-backend pcr``."""
    from sglang.srt.arg_groups.overrides import resolving_view

    return bool(
        flag_value(server_args, "enable_pcr")
        or getattr(resolving_view(server_args), "radix_cache_backend", None) == BACKEND_NAME
    )


_CONFLICTS = (
    ("disable_radix_cache", "--disable-radix-cache"),
    ("enable_hierarchical_cache", "--enable-hierarchical-cache"),
    ("enable_lmcache", "--enable-lmcache"),
    ("enable_flexkv", "--enable-flexkv"),
    ("enable_streaming_session", "--enable-streaming-session"),
    ("enable_session_radix_cache", "--enable-session-radix-cache"),
)
# What to do instead, where the refusal alone would leave a user stuck.
_CONFLICT_ADVICE = {
    "enable_streaming_session": (
        ": SGLang keeps a streaming session's KV in session slots of its own radix cache "
        "(UnifiedRadixCache), outside any tree, which PCR's chunk tree does not provide yet. "
        "Drop the flag and send each turn with the whole conversation so far (no session): "
        "PCR's tree then serves the history from its device, host and SSD tiers, all but the "
        "last partial chunk (docs/testing.md, 'Streaming sessions')"
    ),
}


def validate_after_resolution(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Every check below runs for both ways of selecting PCR's cache: ``--enable-pcr`` and
    ``--radix-cache-backend pcr``."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if not pcr_selected(server_args):
        if flag_value(server_args, "pcr_doc_reuse") != "off":
            raise PCRStartupError("--pcr-doc-reuse needs --enable-pcr (documents are reused through PCR's cache)")
        return None
    from pcr_sglang.config import PCRConfig
    from pcr_sglang.reuse import settings as reuse_settings

    config = PCRConfig.from_server_args(server_args)
    config.validate(int(cfg.page_size or 1))
    reuse_settings.validate(config)
    for field, flag in _CONFLICTS:
        if getattr(cfg, field, False):
            # mutant: streaming-session-refusal-without-advice
            raise PCRStartupError(f"--enable-pcr cannot be combined with {flag}{_CONFLICT_ADVICE.get(field, '')}")
    backend = getattr(cfg, "radix_cache_backend", None)
    if backend not in (None, BACKEND_NAME):
        raise PCRStartupError(
            f"--enable-pcr selects the '{BACKEND_NAME}' tree cache; drop --radix-cache-backend={backend}"
        )
    if getattr(cfg, "speculative_algorithm", None):
        raise PCRStartupError("--enable-pcr does not support speculative decoding yet")
    # Model kinds, KV recipes, layouts and flags PCR cannot serve: refused here, before
    # any weight loads, with every reason in one message.
    from pcr_sglang.sglang_adapter.refusals import check_supported

    check_supported(server_args)
    return None
