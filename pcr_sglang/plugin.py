"""SGLang plugin entry point (group ``sglang.srt.plugins``), run in every SGLang process.

It registers the ``pcr`` radix-cache backend and these hooks, each a thin call into
``pcr_sglang.sglang_adapter``:

* ``create_tree_cache`` (AROUND): ``--enable-pcr`` selects PCR's tree cache, otherwise
  SGLang's own selection runs untouched;
* ``ServerArgs.resolve_once`` (AFTER): PCR flags are validated once the page size is
  resolved, so a bad value fails at startup with a message naming the flag, and models,
  KV recipes, layouts and flags PCR cannot serve are refused before any weight loads
  (``sglang_adapter/refusals``);
* ``prepare_server_args`` (BEFORE, only when the installed SGLang is not the patched
  0.5.23): PCR flags on the command line fail with an explanation instead of argparse's
  "unrecognized arguments";
* the scheduler's ``get_next_batch_to_run`` (BEFORE): once per loop iteration on every
  rank, the scheduler side's step (I/O completions, TP agreement, look-ahead, prefetch,
  metrics);
* ``PrefillAdder.add_one_req`` (AROUND): a request whose SSD chunks are being read, or
  that could take its batch's position mask past its budget, waits in the queue (the
  adder moves on to the next request) instead of being admitted;
  ``PrefillAdder.preempt_to_schedule`` (AROUND): such a request preempts nobody;
* ``ScheduleBatch.prepare_for_extend`` (AROUND) and ``prepare_for_decode`` (AFTER): a
  request's hits are counted once, by tier, as SGLang reports them, and the chunks the
  coming forward completes get host slots to be offloaded into during it;
  with ``--pcr-doc-reuse lego/blend`` the extend input of a permuted row is its tokens in
  row order, and the batch's ``ForwardPlan`` is planned (``reuse/forward_plan``);
* ``ForwardBatch.init_new`` (AFTER), the ``torch_native`` and ``triton`` backends' extend
  metadata and kernels (AROUND): that plan is bound to the forward (true positions) and
  its attention is position-causal; no other forward changes (``sglang_adapter/forward_hooks``);
* the scheduler's ``run_batch`` (AROUND): the offloads planned for a batch's requests run
  in that batch and no other;
* ``ModelRunner.forward`` (AROUND): the forward's stream and extend timings;
* the tokenizer manager's ``_validate_one_request`` (AFTER), ``_send_one_request`` and
  ``_send_batch_request`` (AROUND): document bounds are checked (HTTP 400), and with ``--pcr-doc-reuse`` a request's
  documents are warmed before it is sent (``reuse/tokenizer``); a ``reorder`` request's
  documents are put in an order served before, and ``_stream_one_response`` (AROUND)
  reports it (``reuse/reorder``);
* documents sent as text: the chat and completions serving classes' ``handle_request``,
  the chat's ``_convert_to_internal_request`` and ``_render_and_encode_chat_template``,
  the tokenizer manager's ``generate_request``, ``_tokenize_one_request`` (AROUND) and
  ``_validate_one_request`` (AFTER), ``Engine.generate`` / ``async_generate`` (AROUND):
  the server renders, tokenizes and marks them (``reuse/chat``, ``reuse/doc_requests``);
  ``prepare_for_extend`` and ``SchedulerOutputStreamer.get_cached_tokens_details``
  (AFTER): reused document tokens are reported apart from exact hits (``reuse/usage``);
* the tokenizer manager's ``_validate_one_request`` (AFTER): session fields of the wrong
  type get HTTP 400 instead of killing SGLang's scheduler (``sglang_adapter/session_checks``);
* the scheduler's ``_add_request_to_queue`` (AROUND) and the tokenizer manager's
  ``_validate_one_request`` and ``_init_req_state`` (AFTER): KV hints (``kv_hints`` action
  ``pcr.lookahead_prefetch``) are checked (HTTP 400), registered for the prefetcher, and a
  hint-only request finishes without a forward (``sglang_adapter/kv_hints``);
* ``runtime_context.describe_kv_events_publisher`` (AFTER) and
  ``SchedulerKvEventsPublisher.local_kv_event_sources`` (AROUND): with
  ``--kv-events-config``, ``/server_info``'s ``kv_events.block_size`` and the event sources
  advertised to gRPC routers say PCR's chunk size, the size of the blocks its events carry
  (SGLang's say the page size; ``sglang_adapter/kv_events``);
* SGLang's four ``update_weights_from_*`` calls and ``end_weight_update`` (AROUND): the
  cache namespace moves to the new weights', so no KV computed with the old ones is served
  again from any tier (``sglang_adapter/weight_updates``);
* the scheduler's ``get_internal_state`` (AFTER): ``/server_info`` reports PCR's state;
  the tokenizer manager's ``init_communicators`` (AFTER) and ``get_internal_state``
  (AROUND): ``/server_info?pcr_check_invariants=1`` asks for the O(tree) bookkeeping
  check (``sglang_adapter/invariant_route``).

SGLang's plugin loader logs and swallows exceptions raised here, so nothing in
``register`` may raise for a user error: errors surface through the hooks instead.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from pcr_sglang.flags import flag_value
from pcr_sglang.install_check import check_sglang_install
from pcr_sglang.sglang_adapter.startup import (
    BACKEND_NAME,
    PCRStartupError,
    pcr_selected,
    validate_after_resolution,
)

logger = logging.getLogger(__name__)

_registered = False


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
    HookRegistry.register("sglang.srt.mem_cache.registry.create_tree_cache", _create_tree_cache, HookType.AROUND)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.resolve_once", validate_after_resolution, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run", _on_scheduler_step, HookType.BEFORE
    )
    HookRegistry.register("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", _add_one_req, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.managers.schedule_policy.PrefillAdder.preempt_to_schedule",
        _preempt_to_schedule,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend", _prepare_for_extend, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode", _plan_decode_offloads, HookType.AFTER
    )
    from pcr_sglang.sglang_adapter import forward_hooks

    forward_hooks.register(HookRegistry, HookType)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.run_batch", _around_run_batch, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward", _around_forward, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
        _add_pcr_internal_state,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.runtime_context.describe_kv_events_publisher", _kv_event_block_size, HookType.AFTER
    )
    HookRegistry.register(KV_POOL_BUDGET, _reserve_doc_scratch, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.kv_events_publisher.SchedulerKvEventsPublisher."
        "local_kv_event_sources",
        _kv_event_sources,
        HookType.AROUND,
    )
    from pcr_sglang.reuse import reorder as reuse_reorder
    from pcr_sglang.reuse import tokenizer as reuse_tokenizer
    from pcr_sglang.sglang_adapter import document_hooks, invariant_route, kv_hints, session_checks, weight_updates

    for method in weight_updates.WRAPPED_METHODS:
        HookRegistry.register(
            f"sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.{method}",
            functools.partial(weight_updates.around_weight_update, method),
            HookType.AROUND,
        )

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
        kv_hints.add_request_to_queue,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        kv_hints.validate_kv_hints,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        session_checks.validate_session_fields,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._init_req_state",
        kv_hints.stamp_caller,
        HookType.AFTER,
    )

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        reuse_tokenizer.validate_doc_bounds,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._send_one_request",
        reuse_tokenizer.send_after_warming,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._send_batch_request",
        reuse_tokenizer.send_batch_after_warming,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._stream_one_response",
        reuse_reorder.report_doc_order,
        HookType.AROUND,
    )

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.init_communicators",
        invariant_route.add_server_info_route,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.get_internal_state",
        invariant_route.get_internal_state,
        HookType.AROUND,
    )
    document_hooks.register(HookRegistry, HookType)


def _make_argv_guard(problem: str) -> Callable[..., Any]:
    """Explain an unusable install instead of argparse's "unrecognized arguments"."""

    def guard(argv: list[str], *args: Any, **kwargs: Any) -> None:
        if any(a == "--enable-pcr" or a.startswith("--pcr-") for a in argv):
            raise PCRStartupError(f"--enable-pcr cannot be used: {problem}")
        return None

    return guard


def _create_tree_cache(original: Callable[..., Any], ctx: Any, *args: Any, **kwargs: Any) -> Any:
    if flag_value(ctx.server_args, "enable_pcr"):
        from pcr_sglang.sglang_adapter.factory import build_pcr_prefix_cache

        return build_pcr_prefix_cache(ctx)
    return original(ctx, *args, **kwargs)


def _pcr_cache(owner: Any) -> Any:
    """``owner``'s tree cache if it is PCR's (a scheduler, batch or adder), else None."""
    from pcr_sglang.sglang_adapter.prefix_cache import pcr_cache_of

    return pcr_cache_of(owner)


def _on_scheduler_step(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    cache = _pcr_cache(scheduler)
    if cache is not None:
        running = getattr(scheduler, "running_batch", None)
        busy = bool(scheduler.waiting_queue) or (running is not None and not running.is_empty())
        cache.on_scheduler_step(scheduler.waiting_queue, busy)
    return None


def _add_one_req(original: Callable[..., Any], adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """A request that could take its batch's position mask past ``--pcr-position-mask-mb``
    (``sglang_adapter/mask_admission``) ends this pass: the batch is full for masks, and
    nothing behind it in the queue goes first (so it cannot starve). A request waiting for
    its SSD reads is not admitted this pass, and the adder goes on to the next one, as it
    does past a request whose documents wait for device room beside others in flight."""
    cache = _pcr_cache(adder)
    if cache is None:
        return original(adder, req, *args, **kwargs)
    # mutant: batch-mask-not-asked-at-admission
    if cache.scheduler.batch_masks.hold(adder, req):
        return _batch_full()
    if not cache.scheduler.admission.admit_now(req):
        return adder.budget_state()
    running = getattr(adder, "running_batch", None)
    others = bool(adder.can_run_list) or (running is not None and not running.is_empty())
    with cache.scheduler.admission.adding(others_in_flight=others) as attempt:
        result = original(adder, req, *args, **kwargs)
    # mutant: a-request-waiting-for-room-ends-the-pass
    return adder.budget_state() if attempt.deferred else result


def _batch_full() -> Any:
    """SGLang's verdict that ends the adder's pass over the waiting queue."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    return AddReqResult.OTHER


def _preempt_to_schedule(original: Callable[..., Any], adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Priority preemption retracts running requests to make room for ``req``: not for a
    request that would then wait for its batch's mask or its SSD reads (asked first; SGLang
    asks before matching the request, so the mask's bound is taken from its whole input)."""
    cache = _pcr_cache(adder)
    if cache is not None and (
        cache.scheduler.batch_masks.hold(adder, req, count=False, before_match=True)
        or not cache.scheduler.admission.admit_now(req)
    ):
        return False
    return original(adder, req, *args, **kwargs)


def _prepare_for_extend(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
    """After SGLang prepares an extend batch: count each request's hits the first time
    SGLang splits its cached prefix by tier (its response reports that split), and plan
    the offload of the batch's new chunks."""
    cache = _pcr_cache(batch)
    if cache is None:
        return original(batch, *args, **kwargs)
    fresh = [r for r in batch.reqs if not r._cache_breakdown_computed and not r.retracted_stain]
    result = original(batch, *args, **kwargs)
    cache.scheduler.rows_written(batch.reqs)
    cache.scheduler.plan_forward(batch)
    for req in fresh:
        if req._cache_breakdown_computed:
            cache.scheduler.admitted(req)
    _plan_offloads(cache, batch, decode=False)
    return result


def _plan_decode_offloads(result: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """After SGLang prepares a decode step: chunks it completes get offloaded during it."""
    cache = _pcr_cache(batch)
    if cache is not None:
        # The batch decodes from now on: its extend's ForwardPlan (device copies included)
        # is not kept for as long as SGLang keeps the batch object.
        cache.scheduler.forward_plans.prepared(batch, None)
    if cache is not None and batch.reqs:
        _plan_offloads(cache, batch, decode=True)
    return result


def _plan_offloads(cache: Any, batch: Any, decode: bool) -> None:
    """Host slots for the whole chunks ``batch``'s coming forward completes, from the batch's
    sequence lengths on the host (none planned without them: ``offloads.host_seq_lens``)."""
    from pcr_sglang.sglang_adapter.offloads import host_seq_lens

    seq_lens = host_seq_lens(batch)
    if seq_lens is not None:
        cache.scheduler.plan_offloads(batch.reqs, seq_lens, cache.req_to_token_pool.req_to_token, decode=decode)


def _around_run_batch(original: Callable[..., Any], scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    cache = _pcr_cache(scheduler)
    worker = cache.scheduler.worker if cache is not None else None
    if worker is None:
        return original(scheduler, batch, *args, **kwargs)
    return worker.run_batch(lambda: original(scheduler, batch, *args, **kwargs), [r.rid for r in batch.reqs])


def _around_forward(
    original: Callable[..., Any], model_runner: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    from pcr_sglang.sglang_adapter.worker_side import WorkerSide

    worker = WorkerSide.for_pool(getattr(model_runner, "token_to_kv_pool", None))
    if worker is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    return worker.forward(lambda: original(model_runner, forward_batch, *args, **kwargs), forward_batch)


def _add_pcr_internal_state(result: Any, controller: Any, recv_req: Any = None, *args: Any, **kwargs: Any) -> Any:
    """Publish PCR's state under ``"pcr"`` in ``/server_info``'s ``internal_states``; the
    O(tree) invariant check only when asked (``/server_info?pcr_check_invariants=1``)."""
    from pcr_sglang.sglang_adapter.invariant_route import check_requested

    cache = _pcr_cache(controller.scheduler)
    if cache is not None:
        result.internal_state["pcr"] = cache.report(check_invariants=check_requested(recv_req))
    return result


# Where SGLang sizes its KV pool from free GPU memory (bytes; its slack for activations taken out).
KV_POOL_BUDGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"


def _reserve_doc_scratch(result: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang sizes its KV pool: document reuse's GPU scratch (blend's probe, the position
    mask) comes out of it, not out of SGLang's slack (``reuse/scratch.py``)."""
    from sglang.srt.runtime_context import get_server_args

    server_args = get_server_args()
    if not isinstance(result, int) or server_args is None or not pcr_selected(server_args):
        return result
    from pcr_sglang.config import PCRConfig
    from pcr_sglang.reuse.scratch import reserve_from_kv_pool, scratch_reserve

    return reserve_from_kv_pool(
        result, scratch_reserve(PCRConfig.from_server_args(server_args)), str(getattr(configurator, "device", ""))
    )


def _kv_event_block_size(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """Routers hash prompts at the advertised block size: PCR's events carry chunks."""
    if isinstance(result, dict) and pcr_selected(server_args):
        from pcr_sglang.config import PCRConfig

        result["block_size"] = PCRConfig.from_server_args(server_args).chunk_size
    return result


def _kv_event_sources(original: Callable[..., Any], publisher: Any, block_size: int, *args: Any, **kwargs: Any) -> Any:
    """The sources SGLang advertises to gRPC routers, at the block size of PCR's events."""
    cache = _pcr_cache(publisher)
    return original(publisher, cache.chunk_size if cache is not None else block_size, *args, **kwargs)
