"""One forward's permuted rows: planned at prepare time, bound once when SGLang builds the
forward, read by that forward's attention backend.

A recompute-mode request's row holds its tokens in row order (:mod:`pcr_sglang.reuse.rows`),
so its forward differs from a plain extend in two things: the positions and the attention
mask. :class:`ForwardPlan` carries exactly that, for one batch, through three steps:

* planned after ``prepare_for_extend`` by the scheduler side (:meth:`ForwardPlans.prepared`):
  the host positions of each permuted request's row slots, by batch index;
* bound once in ``ForwardBatch.init_new`` (:meth:`ForwardPlans.bind`): the true positions
  written into the forward's ``positions``, the slot positions copied to the forward's
  device, the per-request lengths taken from the host;
* read by the attention backend of that forward (:meth:`ForwardPlans.for_pool`, then
  :attr:`ForwardPlans.current`): SGLang's runners hand the backend copies of the
  ``ForwardBatch``, so the plan is found through the KV pool the backend holds, never
  through an attribute put on SGLang's objects.

A batch with no permuted request has no plan, and SGLang's own code runs unchanged.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pcr_sglang.reuse import rows as permuted_rows

logger = logging.getLogger(__name__)

# The KV pool -> the plans of the forwards over it (one per scheduler process, like the pool).
_BY_POOL: weakref.WeakKeyDictionary[Any, ForwardPlans] = weakref.WeakKeyDictionary()


@dataclass
class ForwardPlan:
    """The permuted rows of one extend batch."""

    # Planned: batch index -> the positions of the request's row slots [0, seq_len), on the host.
    rows: dict[int, torch.Tensor]
    # Planned: batch index -> the request-pool row its request held then (checked at bind:
    # a batch filtered or reordered in between would hand the positions to another request).
    pool_rows: dict[int, int] = field(default_factory=dict)
    # Bound: batch index -> (its request-pool row, those positions on the forward's device).
    bound: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # The forward's per-request lengths on the host (SGLang's ``*_cpu`` companions, or the
    # batch's own lists), for the attention backends: reading the device tensors
    # (``.tolist()``) would wait for the forward in flight.
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    # The Triton backend put the position mask in this forward's metadata: its extend kernel
    # must then mask the prefix too.
    position_mask: bool = False

    def host_lengths(self, batch_size: int) -> Optional[tuple[list[int], list[int], list[int]]]:
        """The forward's prefix, extend and sequence lengths on the host, if bound for a
        batch of ``batch_size`` requests."""
        if len(self.extend_lens) != batch_size or len(self.prefix_lens) != batch_size:
            return None
        seq_lens = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        return self.prefix_lens, self.extend_lens, seq_lens

    def for_attention(self, req_pool_indices: torch.Tensor) -> Optional[dict[int, torch.Tensor]]:
        """The positions by batch index, after checking the rows are this batch's: on the
        host for host indices, on the device (an assert queued without a host wait) for
        device ones, whose ``.tolist()`` would wait for the forward in flight."""
        if not self.bound:
            return None
        if req_pool_indices.device.type != "cpu":
            size = int(req_pool_indices.shape[0])  # shapes are host metadata: no sync
            outside = [i for i in self.bound if i >= size]
            if outside:
                raise RuntimeError(
                    f"PCR document reuse: permuted rows for batch entries {outside}, but this forward "
                    f"has {size}; refusing to attend with wrong positions"
                )
            device = req_pool_indices.device
            entries = permuted_rows.to_device(torch.tensor(list(self.bound), dtype=torch.int64), device)
            rows = [row for row, _ in self.bound.values()]
            expected = permuted_rows.to_device(torch.tensor(rows, dtype=torch.int64), device)
            torch._assert_async(
                (req_pool_indices[entries].to(torch.int64) == expected).all(),
                "PCR document reuse: a permuted row is not in this forward; refusing to attend with wrong positions",
            )
            return {i: positions for i, (_, positions) in self.bound.items()}
        pool = req_pool_indices.tolist()
        for i, (row, _) in self.bound.items():
            if i >= len(pool) or int(pool[i]) != row:
                raise RuntimeError(
                    f"PCR document reuse: the permuted row of batch entry {i} (request-pool row "
                    f"{row}) is not in this forward ({pool}); refusing to attend with wrong positions"
                )
        return {i: positions for i, (_, positions) in self.bound.items()}


class ForwardPlans:
    """Document reuse's worker side: the plan of each prepared batch until its forward is
    built, and the plan of the forward being run (a process runs one forward at a time,
    like SGLang's request-to-token pool), found by the KV pool both sides hold."""

    def __init__(self) -> None:
        # Prepared batch -> its plan, for as long as SGLang keeps the batch: by identity (a
        # ``ScheduleBatch`` is a dataclass, unhashable), checked against a weak reference.
        self._planned: dict[int, tuple[weakref.ref[Any], ForwardPlan]] = {}
        self.current: Optional[ForwardPlan] = None
        # Lengths read from a device tensor because no host copy was at hand (a wait for the
        # GPU each): none in the configurations PCR serves (SGLang sets the companions on
        # every extend but speculative decoding's, which PCR refuses); counted to show it.
        self.host_waits = 0
        # The largest position mask a forward built (bytes; see rows.position_mask_bytes).
        self.mask_bytes_peak = 0

    def attach(self, kv_pool: Any) -> ForwardPlans:
        """Be the plans of the forwards over ``kv_pool`` (what the backends hold)."""
        _BY_POOL[kv_pool] = self
        return self

    @staticmethod
    def for_pool(kv_pool: Any) -> Optional[ForwardPlans]:
        try:
            return _BY_POOL.get(kv_pool)
        except TypeError:  # not weakly referenceable: not a pool of ours
            return None

    def prepared(self, batch: Any, rows: Optional[dict[int, torch.Tensor]]) -> None:
        """After ``prepare_for_extend``: ``batch``'s permuted rows (None: it has none)."""
        key = id(batch)
        if not rows:
            self._planned.pop(key, None)
            return

        def forget(ref: weakref.ref[Any]) -> None:  # the batch is gone: so is its plan
            if self._planned.get(key, (None,))[0] is ref:
                del self._planned[key]

        pool_rows = {i: int(batch.reqs[i].kv.req_pool_idx) for i in rows}
        self._planned[key] = (weakref.ref(batch, forget), ForwardPlan(rows, pool_rows))

    def _plan_of(self, batch: Any) -> Optional[ForwardPlan]:
        entry = self._planned.get(id(batch))
        return entry[1] if entry is not None and entry[0]() is batch else None

    def bind(self, forward_batch: Any, batch: Any) -> Optional[ForwardPlan]:
        """After ``ForwardBatch.init_new``: the plan of ``batch`` (if it has one and this is
        its extend) becomes the current forward's: the permuted requests' extend tokens get
        their true positions and the slot positions go to the forward's device. Any other
        forward (a decode, a batch without permuted rows) has no current plan."""
        self.current = None
        plan = self._plan_of(batch)
        if plan is None or forward_batch.positions is None or not forward_batch.forward_mode.is_extend():
            return None
        prefix_lens = self.host_list(forward_batch, "extend_prefix_lens", batch, "prefix_lens")
        extend_lens = self.host_list(forward_batch, "extend_seq_lens", batch, "extend_lens")
        device = forward_batch.positions.device
        start = 0
        bound: dict[int, tuple[int, torch.Tensor]] = {}
        for i, extend in enumerate(extend_lens):
            if i in plan.rows:
                prefix = prefix_lens[i]
                # mutant: gpu-row-positions-pageable
                positions = permuted_rows.to_device(plan.rows[i], device)  # one non-blocking copy per permuted request
                forward_batch.positions[start : start + extend] = positions[prefix : prefix + extend].to(
                    forward_batch.positions.dtype
                )
                row = int(batch.reqs[i].kv.req_pool_idx)
                if row != plan.pool_rows.get(i, row):
                    raise RuntimeError(
                        f"PCR document reuse: batch entry {i} holds request-pool row {row}, planned with row "
                        f"{plan.pool_rows[i]}; refusing to attend with wrong positions"
                    )
                bound[i] = (row, positions)
            start += extend
        plan.bound, plan.prefix_lens, plan.extend_lens, plan.position_mask = bound, prefix_lens, extend_lens, False
        self.current = plan
        return plan

    def host_list(self, forward_batch: Any, name: str, batch: Any = None, batch_name: str = "") -> list[int]:
        """A per-request length list from the host: SGLang's ``<name>_cpu`` companion, else the
        batch's own list ``batch_name``. Only when neither is on the host is the device tensor
        read, a wait for the GPU in the scheduler thread, counted in :attr:`host_waits` and
        logged once (no configuration PCR serves gets there)."""
        found = _on_host(getattr(forward_batch, f"{name}_cpu", None))
        if found is None and batch is not None and batch_name:
            # mutant: gpu-row-lengths-read-from-the-device
            found = _on_host(getattr(batch, batch_name, None))
        if found is not None:
            return found
        if self.host_waits == 0:
            logger.warning(
                "PCR document reuse: %s has no host copy in this forward; reading it from the "
                "device waits for the GPU (counted in host_waits)",
                name,
            )
        self.host_waits += 1
        return [int(x) for x in getattr(forward_batch, name).tolist()]


def _on_host(values: Any) -> Optional[list[int]]:
    """``values`` as host integers if it is on the host (a list, a CPU tensor), else None."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            return None
        values = values.tolist()
    return [int(x) for x in values]
