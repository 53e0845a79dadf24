"""Recompute modes in SGLang's forward: a permuted row's input, positions and attention.

A ``lego``/``blend`` request's row is ``[exact prefix ‖ kept reused tokens ‖ recomputed
tokens ‖ the rest]`` (:class:`pcr_sglang.reuse.plan.RowOrder`), so the recomputed
tokens are part of the extend SGLang runs. Three things then differ from a plain extend,
each set where SGLang builds it, for the requests whose extend touches a permuted part:

* the extend's input ids (``prepare_for_extend`` takes ``fill_ids[prefix_len:]``): the
  tokens at the slots' positions (:func:`permute_extend_inputs`, scheduler side);
* the positions (``ForwardBatch.init_new`` computes ``prefix_len + i``): each token's
  true position (``ForwardPlans.bind``, :mod:`pcr_sglang.reuse.forward_plan`), so RoPE and
  the sampled token are right;
* attention: a query sees exactly the keys at positions up to its own, in whatever slot
  they sit (:func:`position_causal_sdpa_extend` for ``torch_native``;
  :func:`triton_position_mask` for ``triton``'s custom mask, prefix included).

Row slot positions travel down with one :class:`~pcr_sglang.reuse.forward_plan.ForwardPlan`
per batch: planned after ``prepare_for_extend``, bound once in ``ForwardBatch.init_new``,
read by the attention backends of that forward. A batch with no permuted request has no
plan and runs SGLang's own code unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from pcr_sglang.reuse.plan import RowOrder

if TYPE_CHECKING:
    from pcr_sglang.reuse.forward_plan import ForwardPlan, ForwardPlans

# CUDA: index and position tensors reach the device through one pinned ring per device,
# allocated once, with non-blocking copies: a pageable ``.to(device)`` is a copy PyTorch
# makes synchronous, a wait for the forward in flight in the scheduler thread.
_STAGING: dict[torch.device, Any] = {}


def _staging(device: torch.device) -> Any:
    staging = _STAGING.get(device)
    if staging is None:
        from pcr_sglang.transfer.streams import CudaStreams

        staging = _STAGING[device] = CudaStreams(device).staging
    return staging


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host integer tensor ``values`` on ``device``: through the pinned ring on CUDA
    (int64, non-blocking), a plain ``.to`` elsewhere."""
    if device.type != "cuda":
        return values.to(device)
    return _staging(device).to_device(values)  # type: ignore[no-any-return]


def permute_extend_inputs(batch: Any, row_of: Callable[[str], Optional[RowOrder]]) -> Optional[dict[int, torch.Tensor]]:
    """After ``prepare_for_extend``: for each request whose extend overlaps its permuted
    part, put the tokens of the slots' positions in the batch's extend input ids, and
    return the positions of its row slots ``[0, seq_len)`` by batch index (None if none)."""
    rows: dict[int, torch.Tensor] = {}
    ids = batch.prefill_input_ids_cpu if getattr(batch, "prefill_input_ids_cpu", None) is not None else batch.input_ids
    offset = 0
    for i, req in enumerate(batch.reqs):
        prefix, extend = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
        row = row_of(req.rid)
        if row is not None and row.permutes(prefix, prefix + extend):
            positions = row.positions_of_slots(0, prefix + extend)
            fill = req.get_fill_ids()
            tokens = torch.tensor([fill[p] for p in positions[prefix:]], dtype=torch.int64)
            ids[offset : offset + extend] = to_device(tokens, ids.device).to(ids.dtype)
            rows[i] = torch.tensor(positions, dtype=torch.int64)
        offset += extend
    return rows or None


def position_mask_bytes(prefix_lens: list[int], extend_lens: list[int]) -> int:
    """Bytes of the Triton position mask over a batch: one per query and key of each
    request's extend (a bool per key ``[0, prefix + extend)``)."""
    return sum(e * (p + e) for p, e in zip(prefix_lens, extend_lens))


def row_mask_bound(cached: int, total: int) -> int:
    """The most bytes a request's own part of the position mask can take in any forward:
    its extend (``[cached, total)``, at most whole: chunked prefill only makes it smaller)
    over keys ``[0, total)``. Known at admission, before anything is placed."""
    return max(total - cached, 0) * total


def _slot_positions(rows: dict[int, torch.Tensor], i: int, seq_len: int, device: torch.device) -> torch.Tensor:
    positions = rows.get(i)
    if positions is None:
        return torch.arange(seq_len, device=device)
    return positions[:seq_len]


def position_causal_sdpa_extend(
    rows: dict[int, torch.Tensor],
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    scaling: Optional[float],
    enable_gqa: bool,
    host_lengths: Optional[tuple[list[int], list[int], list[int]]] = None,
) -> torch.Tensor:
    """``torch_native``'s extend attention (query ``[tokens, heads, dim]``) with query
    ``i`` of a request attending the row keys whose position is at most its own: for a
    request without a permuted row that is the bottom-right causal mask of a plain extend.
    ``host_lengths`` (prefix, extend, sequence lengths: :meth:`ForwardPlan.host_lengths`)
    spare reading the length tensors element by element, a wait each on a GPU."""
    if host_lengths is None:
        host_lengths = (extend_prefix_lens.tolist(), extend_seq_lens.tolist(), seq_lens.tolist())
    start = 0
    for i, (prefix, extend, seq_len) in enumerate(zip(*host_lengths)):
        q = query[start : start + extend].movedim(0, 1)  # [heads, extend, dim]
        slots = req_to_token[req_pool_indices[i], :seq_len]
        k = k_cache[slots].movedim(0, 1)
        v = v_cache[slots].movedim(0, 1)
        if not (q.dtype == k.dtype == v.dtype):
            k, v = k.to(q.dtype), v.to(q.dtype)
        positions = _slot_positions(rows, i, seq_len, q.device)
        mask = positions.unsqueeze(0) <= positions[prefix:seq_len].unsqueeze(1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=enable_gqa
        )
        output[start : start + extend] = out.squeeze(0).movedim(1, 0)
        start += extend
    return output


def triton_position_mask(
    rows: dict[int, torch.Tensor], seq_lens: list[int], prefix_lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's Triton extend ``custom_mask`` (flat bool, per request ``[extend x seq_len]``
    row-major, keys in row order: prefix then extend) and its ``mask_indptr``, for a
    position-causal mask over every request of the batch (pass
    ``skip_prefix_custom_mask=False`` so the prefix part is masked too)."""
    offsets = [0]
    for seq_len, prefix in zip(seq_lens, prefix_lens):
        offsets.append(offsets[-1] + (seq_len - prefix) * seq_len)
    # One allocation of exactly the mask's bytes (position_mask_bytes), each request's part
    # written in place: no per-request masks and no concatenation, which would double it.
    mask = torch.empty(offsets[-1], dtype=torch.bool, device=device)
    for i, (seq_len, prefix) in enumerate(zip(seq_lens, prefix_lens)):
        positions = _slot_positions(rows, i, seq_len, device)
        # mutant: position-mask-excludes-the-query-itself
        torch.le(
            positions.unsqueeze(0),
            positions[prefix:seq_len].unsqueeze(1),
            out=mask[offsets[i] : offsets[i + 1]].view(seq_len - prefix, seq_len),
        )
    indptr = to_device(torch.tensor(offsets, dtype=torch.int64), device)
    return mask, indptr


@functools.lru_cache(maxsize=8)
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature`` of the wrapped SGLang method, read once: it runs in every layer
    of a forward with permuted rows (30 times a request on SmolLM2), where reading it afresh
    cost about a tenth of the attention's time on CPU."""
    return inspect.signature(function)


def native_extend_with_rows(
    original: Callable[..., Any], backend: Any, plan: ForwardPlan, *args: Any, **kwargs: Any
) -> Any:
    """Around ``TorchNativeAttnBackend._run_sdpa_forward_extend`` in a forward that carries
    permuted rows: the position-causal loop for full causal attention; anything else
    (cross-attention, sliding windows: refused at startup for recompute modes) unchanged."""
    bound = _signature(original).bind(backend, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    # mutant: doc-reuse-recompute-without-position-mask
    rows = plan.for_attention(a["req_pool_indices"])
    if not rows or not a.get("causal", True) or a.get("is_cross_attn") or a.get("sliding_window_size") is not None:
        return original(backend, *args, **kwargs)
    return position_causal_sdpa_extend(
        rows,
        a["query"],
        a["output"],
        a["k_cache"],
        a["v_cache"],
        a["req_to_token"],
        a["req_pool_indices"],
        a["seq_lens"],
        a["extend_prefix_lens"],
        a["extend_seq_lens"],
        a.get("scaling"),
        bool(a.get("enable_gqa")),
        plan.host_lengths(int(a["seq_lens"].shape[0])),
    )


def set_triton_position_mask(
    backend: Any, forward_batch: Any, rows: dict[int, torch.Tensor], plan: ForwardPlan, plans: ForwardPlans
) -> bool:
    """After ``TritonAttnBackend.init_forward_metadata`` for a forward with permuted rows
    (``plan``, its ``rows`` checked by :meth:`ForwardPlan.for_attention`): whether the mask
    was set (an extend; the kernel must then mask the prefix too,
    :attr:`ForwardPlan.position_mask`)."""
    metadata = backend.forward_metadata
    if metadata is None or not forward_batch.forward_mode.is_extend() or forward_batch.forward_mode.is_target_verify():
        return False
    host = plan.host_lengths(int(forward_batch.seq_lens.shape[0]))  # a shape: no wait
    # mutant: gpu-row-mask-lengths-read-from-the-device
    if host is not None:
        prefix_lens, _, seq_lens = host
    else:
        seq_lens = plans.host_list(forward_batch, "seq_lens")
        prefix_lens = plans.host_list(forward_batch, "extend_prefix_lens")
    plans.mask_bytes_peak = max(
        plans.mask_bytes_peak, position_mask_bytes(prefix_lens, [s - p for s, p in zip(seq_lens, prefix_lens)])
    )
    mask, indptr = triton_position_mask(rows, seq_lens, prefix_lens, forward_batch.seq_lens.device)
    metadata.custom_mask = mask
    metadata.mask_indptr = indptr
    return True
