"""SGLang plugin entry point (group ``sglang.srt.plugins``), run in every SGLang process.

It registers the ``pcr`` radix-cache backend and these hooks:

* ``create_tree_cache`` (AROUND): ``--enable-pcr`` selects PCR's tree cache, otherwise
  SGLang's own selection runs untouched;
* ``ServerArgs.resolve_once`` (AFTER): PCR flags are validated once the page size is
  resolved, so a bad value fails at startup with a message naming the flag;
* ``prepare_server_args`` (BEFORE, only when the installed SGLang is not the patched
  0.5.23): PCR flags on the command line fail with an explanation instead of argparse's
  "unrecognized arguments" (``Engine(enable_pcr=True)`` there fails in ServerArgs with
  "unexpected keyword", and the plugin's log line says why);
* the scheduler's ``_get_new_batch_prefill_raw`` (BEFORE): each scheduling pass, the
  waiting queue's head feeds the look-ahead LRU and PCR's metrics are published;
* ``ScheduleBatch.prepare_for_extend`` (AROUND): responses count chunks copied back
  from the host tier under ``cached_tokens_details["host"]`` (from the SSD tier: under
  SGLang's storage column), and the batch's new
  chunks get host slots to be offloaded into during its forward, and prefetches its
  requests waited for are counted late;
* ``ScheduleBatch.prepare_for_decode`` (AFTER): a chunk a decode step completes gets
  offloaded during that step;
* ``ModelRunner.forward`` (AROUND): a forward starts, and with it the offloads planned
  for it (``--pcr-layerwise``); prefills are timed for the SSD tier's cost model;
* the scheduler's ``get_internal_state`` (AFTER): ``/server_info`` reports PCR's state.

SGLang's plugin loader logs and swallows exceptions raised here, so nothing in
``register`` may raise for a user error: errors surface through the hooks instead.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pcr_sglang.install_check import check_sglang_install

logger = logging.getLogger(__name__)

BACKEND_NAME = "pcr"
_registered = False


class PCRStartupError(RuntimeError):
    """pcr-sglang cannot start: the installation or the flags are wrong."""


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    problem = check_sglang_install()
    if problem is not None:
        logger.error("pcr-sglang is disabled: %s", problem.message)
        HookRegistry.register(
            "sglang.srt.server_args.prepare_server_args",
            _make_argv_guard(problem.message),
            HookType.BEFORE,
        )
        return

    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    from pcr_sglang.sglang_adapter.factory import build_pcr_prefix_cache

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build_pcr_prefix_cache)
    HookRegistry.register(
        "sglang.srt.mem_cache.registry.create_tree_cache", _create_tree_cache, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.resolve_once", _validate_after_resolution, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
        _on_scheduler_step,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
        _prepare_for_extend,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
        _plan_decode_offloads,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        _around_forward,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state."
        "SchedulerInternalStateController.get_internal_state",
        _add_pcr_internal_state,
        HookType.AFTER,
    )


def _make_argv_guard(problem: str) -> Callable[..., Any]:
    """Explain an unusable install instead of argparse's "unrecognized arguments"."""

    def guard(argv: list[str], *args: Any, **kwargs: Any) -> None:
        if any(a == "--enable-pcr" or a.startswith("--pcr-") for a in argv):
            raise PCRStartupError(f"--enable-pcr cannot be used: {problem}")
        return None

    return guard


def _create_tree_cache(original: Callable[..., Any], ctx: Any, *args: Any, **kwargs: Any) -> Any:
    if getattr(ctx.server_args, "enable_pcr", False):
        from pcr_sglang.sglang_adapter.factory import build_pcr_prefix_cache

        return build_pcr_prefix_cache(ctx)
    return original(ctx, *args, **kwargs)


def _on_scheduler_step(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Before each prefill scheduling pass: the waiting queue feeds the look-ahead LRU,
    and PCR's counters are published to Prometheus."""
    from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

    tree_cache = getattr(scheduler, "tree_cache", None)
    if isinstance(tree_cache, PCRPrefixCache):
        tree_cache.on_scheduler_step(scheduler.waiting_queue)
    return None


def _prepare_for_extend(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
    """After SGLang prepares an extend batch: count its requests' late prefetches, plan
    the offload of its new chunks, and move the tokens PCR copied back from host memory
    from the ``device`` to the ``host`` column of a response's ``cached_tokens_details``.

    SGLang splits a request's cached prefix by tier once, in ``prepare_for_extend``, from
    HiCache's load-back bookkeeping; PCR loads during its match instead and records the
    loaded tokens on the request, so the split is corrected right after SGLang makes it.
    """
    from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

    fresh = [r for r in batch.reqs if not getattr(r, "_cache_breakdown_computed", True)]
    result = original(batch, *args, **kwargs)
    if isinstance(batch.tree_cache, PCRPrefixCache):
        batch.tree_cache.count_admitted(batch.reqs)
        batch.tree_cache.plan_offloads(batch.reqs, batch.seq_lens_cpu.tolist())
    for req in fresh:
        host = req.__dict__.pop("pcr_host_loaded_tokens", 0)
        ssd = req.__dict__.pop("pcr_ssd_loaded_tokens", 0)
        if (host or ssd) and req._cache_breakdown_computed:
            moved = min(host, req.cached_tokens_device)
            req.cached_tokens_device -= moved
            req.cached_tokens_host += moved
            moved = min(ssd, req.cached_tokens_device)
            req.cached_tokens_device -= moved
            req.cached_tokens_storage += moved
    return result


def _plan_decode_offloads(result: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """After SGLang prepares a decode step: chunks it completes get offloaded during it."""
    from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

    if isinstance(batch.tree_cache, PCRPrefixCache) and batch.reqs:
        batch.tree_cache.plan_offloads(batch.reqs, batch.seq_lens_cpu.tolist(), decode=True)
    return result


def _around_forward(original: Callable[..., Any], model_runner: Any, forward_batch: Any,
                    *args: Any, **kwargs: Any) -> Any:
    cache = getattr(model_runner.token_to_kv_pool, "pcr_cache", None)
    if cache is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    return cache.run_forward(lambda: original(model_runner, forward_batch, *args, **kwargs), forward_batch)


def _add_pcr_internal_state(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    """Publish PCR's state under ``"pcr"`` in ``/server_info``'s ``internal_states``."""
    from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

    tree_cache = getattr(controller.scheduler, "tree_cache", None)
    if isinstance(tree_cache, PCRPrefixCache):
        result.internal_state["pcr"] = tree_cache.report(check_invariants=True)
    return result


_CONFLICTS = (
    ("disable_radix_cache", "--disable-radix-cache"),
    ("enable_hierarchical_cache", "--enable-hierarchical-cache"),
    ("enable_lmcache", "--enable-lmcache"),
    ("enable_flexkv", "--enable-flexkv"),
    ("enable_streaming_session", "--enable-streaming-session"),
    ("enable_session_radix_cache", "--enable-session-radix-cache"),
)


def _validate_after_resolution(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    if not getattr(server_args, "enable_pcr", False):
        return None
    from sglang.srt.arg_groups.overrides import resolving_view

    from pcr_sglang.config import PCRConfig

    cfg = resolving_view(server_args)
    PCRConfig.from_server_args(server_args).validate(int(cfg.page_size or 1))
    for field, flag in _CONFLICTS:
        if getattr(cfg, field, False):
            raise PCRStartupError(f"--enable-pcr cannot be combined with {flag}")
    backend = getattr(cfg, "radix_cache_backend", None)
    if backend not in (None, BACKEND_NAME):
        raise PCRStartupError(
            f"--enable-pcr selects the '{BACKEND_NAME}' tree cache; drop --radix-cache-backend={backend}"
        )
    if getattr(cfg, "speculative_algorithm", None):
        raise PCRStartupError("--enable-pcr does not support speculative decoding yet")
    return None
