"""Pinned staging for the small index tensors a transfer sends to the GPU, allocated once.

Every load, offload and demotion sends its host slot numbers (a few int64) to the device.
Built with ``torch.tensor(...).pin_memory().to(device, non_blocking=True)`` that is one
pinned allocation per transfer in the scheduler thread (the first ones a ``cudaHostAlloc``
each, slow); built without ``pin_memory()`` it is a pageable copy, which PyTorch makes
synchronous: the scheduler would wait for the forward in flight. Here one pinned buffer is
allocated at startup and used as a ring: each staging writes its values into the next free
region on the host, enqueues one non-blocking copy on the current stream and records an
event (from the stream's pool, :class:`~pcr_sglang.transfer.streams.CudaStreams`); a
region is written again only once the event of the copy that read it has completed
(``query()``, never a wait). A staging that finds no free region (more in flight than the
ring holds) allocates a pinned tensor of its own, counted in :attr:`overflows` and logged
once: slower, never wrong.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Sequence, Union

import torch

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 1 << 16  # int64 entries: 512 KiB, far more host slot numbers than a step sends


def _host_int64(values: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(torch.int64)
    return torch.tensor(list(values), dtype=torch.int64)


class PinnedStaging:
    """A ring over one pinned int64 buffer (see the module docstring)."""

    def __init__(
        self,
        device: torch.device,
        pin: Callable[[int, torch.dtype], torch.Tensor],
        record_event: Callable[[], Any],
        capacity: int = DEFAULT_CAPACITY,
    ):
        """``pin(n, dtype)`` allocates pinned host memory (called here once, and on overflow);
        ``record_event()`` records an event on the current stream."""
        self.device = device
        self._pin = pin
        self._record_event = record_event
        self._buffer = pin(capacity, torch.int64)
        self.capacity = capacity
        self._head = 0
        self._in_use: deque[tuple[int, int, Any]] = deque()  # (start, end, event), oldest first
        self.overflows = 0

    def _retire(self) -> None:
        while self._in_use and self._in_use[0][2].query():
            self._in_use.popleft()

    def _free(self, start: int, end: int) -> bool:
        return all(end <= s or e <= start for s, e, _ in self._in_use)

    def to_device(self, values: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
        """``values`` (host integers, or a CPU integer tensor) as an int64 tensor on the
        device, copied from pinned memory without blocking the host (ordered on the current
        stream)."""
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                raise ValueError(f"staging takes host values; this tensor is on {values.device}")
            values = values.reshape(-1)
        n = len(values)
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        if n == 0:
            return out
        self._retire()
        start = self._head if self._head + n <= self.capacity else 0
        # mutant: gpu-staging-overwrites-a-region-in-flight
        if n > self.capacity or not self._free(start, start + n):
            self.overflows += 1
            if self.overflows == 1:
                logger.warning(
                    "PCR transfer staging: %d index entries in flight exceed the pinned ring of %d; "
                    "allocating pinned memory for this transfer (counted, logged once)",
                    n + sum(e - s for s, e, _ in self._in_use),
                    self.capacity,
                )
            staged = self._pin(n, torch.int64)
            staged.copy_(_host_int64(values))
            out.copy_(staged, non_blocking=True)
            return out
        region = self._buffer[start : start + n]
        region.copy_(_host_int64(values))
        # mutant: gpu-staging-uploads-from-pageable-memory
        out.copy_(region, non_blocking=True)
        self._in_use.append((start, start + n, self._record_event()))
        self._head = start + n
        return out
