"""A recording stand-in for the ``torch.cuda`` calls PCR's CUDA branches make, on CPU.

No GPU is at hand in CI: the CUDA branches of the transfer engine (streams, events, pinned
staging, kernel launches) are run here on CPU tensors with this object in place of
``torch.cuda``, and the tests assert on what was called: how many events and pinned
buffers were made and when, synchronizations, the copies' ``non_blocking`` flag and their
source, and host reads of tensors (``tolist``/``item``/``cpu``, a device-to-host wait on a
GPU). It proves what the code asks of CUDA, not what a GPU does with it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode


class RecordingEvent:
    def __init__(self, recorder: "RecordingCuda"):
        self.recorder = recorder
        self.records = 0

    def record(self, stream: Any = None) -> None:
        self.records += 1
        self.recorder.log.append(("record", getattr(stream, "name", "?")))

    def query(self) -> bool:
        return self.recorder.complete

    def synchronize(self) -> None:
        self.recorder.synchronizations += 1


@dataclass(eq=False)
class RecordingStream:
    recorder: "RecordingCuda"
    name: str

    def wait_event(self, event: Any) -> None:
        self.recorder.log.append(("wait_event", self.name))

    def wait_stream(self, other: Any) -> None:
        self.recorder.log.append(("wait_stream", self.name))

    def synchronize(self) -> None:
        self.recorder.synchronizations += 1


@dataclass
class RecordingCuda:
    """Stands in for ``torch.cuda`` (``Stream``, ``Event``, ``current_stream``, ``stream``,
    ``is_current_stream_capturing``, ``synchronize``) and for pinned allocation (``pin``)."""

    complete: bool = True  # what every event's query() answers
    capturing: bool = False
    events_made: int = 0
    pinned: list[torch.Tensor] = field(default_factory=list)
    synchronizations: int = 0
    log: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.default = RecordingStream(self, "default")
        self._current = [self.default]
        self._streams = 0

    # torch.cuda
    def Stream(self, device: Any = None) -> RecordingStream:  # noqa: N802 - torch.cuda's name
        self._streams += 1
        return RecordingStream(self, f"side{self._streams}")

    def Event(self, **kwargs: Any) -> RecordingEvent:  # noqa: N802 - torch.cuda's name
        self.events_made += 1
        return RecordingEvent(self)

    def current_stream(self, device: Any = None) -> RecordingStream:
        return self._current[-1]

    @contextlib.contextmanager
    def stream(self, stream: RecordingStream) -> Iterator[None]:
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def synchronize(self, device: Any = None) -> None:
        self.synchronizations += 1

    # pinned allocation
    def pin(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.empty(n, dtype=dtype)
        self.pinned.append(tensor)
        return tensor

    def is_pinned_memory(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        for buffer in self.pinned:
            base = buffer.data_ptr()
            if base <= start < base + buffer.numel() * buffer.element_size():
                return True
        return False


_HOST_READS = {"tolist", "item", "cpu", "numpy", "pin_memory", "__bool__", "__int__", "__index__"}
# Calls that make a new tensor (memory from the caching allocator on a GPU).
_ALLOCATIONS = {
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "cat",
    "stack",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "clone",
    "new_empty",
    "new_zeros",
    "new_full",
    "new_tensor",
}


def _moves_to_a_device(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a ``to`` call names a device (``to(device)``, ``to("cuda")``, ``to(device=...)``):
    PCR's code calls it so only to move host values to the GPU."""
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:2])


class HostTraffic(TorchFunctionMode):
    """Records, while active, every tensor method that would wait for the GPU or allocate
    pinned memory (``_HOST_READS``; also a factory call with ``pin_memory=True``), every
    ``copy_`` with its ``non_blocking`` flag and whether its source is ``recorder``'s pinned
    memory, every upload (a ``to``/``cuda`` naming a device, a ``copy_`` into memory that is
    not pinned) with the same two facts, and every tensor made (``_ALLOCATIONS``) by the
    current :attr:`phase`. On a GPU an upload from memory that is not pinned is a pageable
    copy, which PyTorch makes synchronous whatever ``non_blocking`` says."""

    def __init__(self, recorder: RecordingCuda):
        super().__init__()
        self.recorder = recorder
        self.host_reads: list[str] = []
        self.copies: list[tuple[str, bool, bool]] = []  # (method, non_blocking, from pinned)
        self.uploads: list[tuple[str, bool, bool]] = []  # (method, non_blocking, from pinned)
        self.phase = ""  # set by a test around a part of the step, e.g. "layers"
        self.allocations: list[tuple[str, str]] = []  # (phase, function)

    @property
    def pageable_uploads(self) -> list[tuple[str, bool, bool]]:
        return [upload for upload in self.uploads if not upload[2]]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READS or kwargs.get("pin_memory"):
            self.host_reads.append(name if name in _HOST_READS else "pin_memory")
        elif name == "copy_" and len(args) >= 2:
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            pinned = self.recorder.is_pinned_memory(args[1])
            self.copies.append(("copy_", non_blocking, pinned))
            if not self.recorder.is_pinned_memory(args[0]):  # into the device (not into the staging ring)
                self.uploads.append(("copy_", non_blocking, pinned))
        elif (
            name in ("to", "cuda")
            and args
            and isinstance(args[0], torch.Tensor)
            and (name == "cuda" or _moves_to_a_device(args, kwargs))
        ):
            self.uploads.append(
                (name, bool(kwargs.get("non_blocking", False)), self.recorder.is_pinned_memory(args[0]))
            )
        if name in _ALLOCATIONS:
            self.allocations.append((self.phase, name))
        return func(*args, **kwargs)
