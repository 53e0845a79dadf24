"""SGLang's forward, for batches with document reuse's permuted rows (``reuse/rows``).

Four hooks, each finding the forward's :class:`~pcr_sglang.reuse.forward_plan.ForwardPlans`
through the KV pool its owner holds (the batch's allocator, the attention backend's pool):

* ``ForwardBatch.init_new`` (AFTER): the batch's plan is bound to the forward being built
  (true positions, slot positions on the device), and no other forward has one;
* ``TorchNativeAttnBackend._run_sdpa_forward_extend`` (AROUND): the position-causal
  extend for a forward with a plan;
* ``TritonAttnBackend.init_forward_metadata`` and ``_forward_extend_kernel`` (AROUND): the
  position mask in the extend metadata, and the kernel told to mask the prefix too.

A forward without a plan runs SGLang's own code unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pcr_sglang.reuse import rows as permuted_rows
from pcr_sglang.reuse.forward_plan import ForwardPlan, ForwardPlans

NATIVE_BACKEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
TRITON_BACKEND = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"


def register(HookRegistry: Any, HookType: Any) -> None:
    HookRegistry.register(
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", bind_forward_plan, HookType.AFTER
    )
    HookRegistry.register(f"{NATIVE_BACKEND}._run_sdpa_forward_extend", native_extend, HookType.AROUND)
    HookRegistry.register(f"{TRITON_BACKEND}.init_forward_metadata", triton_metadata, HookType.AROUND)
    HookRegistry.register(f"{TRITON_BACKEND}._forward_extend_kernel", triton_extend_kernel, HookType.AROUND)


def plans_of_batch(batch: Any) -> Optional[ForwardPlans]:
    """The plans over ``batch``'s KV pool (a ``ScheduleBatch``), if PCR serves it."""
    get_kvcache = getattr(getattr(batch, "token_to_kv_pool_allocator", None), "get_kvcache", None)
    return ForwardPlans.for_pool(get_kvcache()) if get_kvcache is not None else None


def current_plan(backend: Any) -> tuple[Optional[ForwardPlans], Optional[ForwardPlan]]:
    """The plans over an attention backend's KV pool, and the current forward's plan."""
    plans = ForwardPlans.for_pool(getattr(backend, "token_to_kv_pool", None))
    return plans, (plans.current if plans is not None else None)


def bind_forward_plan(result: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """After ``ForwardBatch.init_new``: ``batch``'s plan bound to the forward it built. The
    attention backends find it through the model runner's KV pool: a plan bound where that
    pool leads elsewhere would leave a permuted row to plain causal attention, so it is an
    error, never a silent fallback."""
    plans = plans_of_batch(batch)
    if plans is None:
        return result
    plan = plans.bind(result, batch)
    model_runner = args[0] if args else kwargs.get("model_runner")
    runner_pool = getattr(model_runner, "token_to_kv_pool", None)
    if plan is not None and ForwardPlans.for_pool(runner_pool) is not plans:
        plans.current = None
        raise RuntimeError(
            "PCR document reuse: the model runner's KV pool is not the one the batch's plan was made for; "
            "refusing to attend a permuted row without its position mask"
        )
    return result


def native_extend(original: Callable[..., Any], backend: Any, *args: Any, **kwargs: Any) -> Any:
    _, plan = current_plan(backend)
    if plan is None:
        return original(backend, *args, **kwargs)
    return permuted_rows.native_extend_with_rows(original, backend, plan, *args, **kwargs)


def triton_metadata(original: Callable[..., Any], backend: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(backend, forward_batch, *args, **kwargs)
    plans, plan = current_plan(backend)
    if plans is not None and plan is not None:
        pool = getattr(forward_batch, "req_pool_indices_cpu", None)
        rows = plan.for_attention(pool if pool is not None else forward_batch.req_pool_indices)
        plan.position_mask = rows is not None and permuted_rows.set_triton_position_mask(
            backend, forward_batch, rows, plan, plans
        )
    return result


def triton_extend_kernel(original: Callable[..., Any], backend: Any, *args: Any, **kwargs: Any) -> Any:
    _, plan = current_plan(backend)
    if plan is not None and plan.position_mask:
        kwargs["skip_prefix_custom_mask"] = False  # the permuted prefix is masked by position too
    return original(backend, *args, **kwargs)
