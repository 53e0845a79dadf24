"""Streams and events for the transfer engine: CUDA's, or a CPU model that checks their order.

The engine's CUDA algorithm orders its copies against the forward only through stream
waits and events: the copies may run in any order the GPU likes except the one those waits
impose. On a CPU the copies run the moment they are issued, so a missing wait changes
nothing there and no CPU test of the CUDA algorithm could see it. This module puts the
few stream operations the engine uses behind one small interface (:class:`Streams`):

* :class:`CudaStreams`: a thin wrapper over ``torch.cuda`` (what the engine runs on a GPU,
  the very calls it made before the interface existed: no sync is added);
* :class:`OrderingModel`: virtual streams on the CPU. The engine's copies still run at
  once on CPU tensors (so the data is checked as usual), and every stream operation and
  every copy's reads and writes of ``(buffer, layer, slots)`` are recorded. The model
  keeps a vector clock per stream (a wait joins the clocks; an event is a clock) and
  raises :class:`OrderingError` as soon as an access conflicts with an earlier one
  (the same buffer, layer and slot, one of them a write) that is not ordered before it:
  exactly what could run the other way round on a GPU. A test plays the forward by
  recording its own reads and writes on the stream it runs on.

The model proves the order of what the engine issues, under CUDA's stream semantics as
the model states them; it does not run a kernel on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch

from pcr_sglang.transfer.staging import DEFAULT_CAPACITY, PinnedStaging

logger = logging.getLogger(__name__)

# The buffers a copy reads or writes: the device KV pool (token slots) and the host chunk
# pool (chunk slots). K and V always move together, so one name covers both.
DEVICE_KV = "device-kv"
HOST_KV = "host-kv"


@dataclass(frozen=True, eq=False)
class Region:
    """Slots ``slots`` (an int tensor) of layer ``layer`` of ``buffer``."""

    buffer: str
    layer: int
    slots: torch.Tensor


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Streams(Protocol):
    """What the engine's CUDA algorithm needs of streams. Streams compare with ``==``."""

    #: Whether :meth:`accesses` does anything (the engine skips building regions if not).
    records_accesses: bool

    def current_stream(self) -> Any: ...

    def new_stream(self, name: str) -> Any: ...

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...

    def record_event(self, stream: Any) -> Event: ...

    def wait_event(self, stream: Any, event: Event) -> None: ...

    def wait_stream(self, stream: Any, other: Any) -> None: ...

    def is_capturing(self) -> bool: ...

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None: ...

    def index_tensor(self, values: Sequence[int]) -> torch.Tensor:
        """Host integers as an int64 tensor on the device, without a host-side wait."""
        ...

    def accesses(self, stream: Any, reads: Sequence[Region], writes: Sequence[Region], what: str) -> None: ...


def _pinned_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, pin_memory=True)


class CudaStreams:
    """``torch.cuda``'s streams and events on ``device``, with what the engine would
    otherwise allocate per layer and per transfer taken from pools made once:

    * events: a ring of ``events_per_stream`` per stream, made with the stream (or the first
      time an event is recorded on a stream made elsewhere), then re-recorded in turn.
      Re-recording an event on the same stream only makes it later: a ``query()`` of a
      re-recorded event is true only once the later work, and so the earlier (a stream runs
      in order), is done; a wait already issued keeps what it waited for (CUDA takes the
      event's state at the wait). So a ring too small for what is held costs overlap, never
      order.
    * index tensors: :class:`~pcr_sglang.transfer.staging.PinnedStaging`, one pinned
      buffer allocated here.

    ``cuda`` and ``pin``: ``torch.cuda`` and a pinned allocator; tests pass recording
    stand-ins to check, on CPU, what this class calls."""

    records_accesses = False

    def __init__(
        self,
        device: torch.device,
        *,
        events_per_stream: int = 256,
        cuda: Any = None,
        pin: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None,
        staging_capacity: int = DEFAULT_CAPACITY,
    ):
        self.device = device
        self.cuda: Any = cuda if cuda is not None else torch.cuda  # torch.cuda, or a test's stand-in
        self.events_per_stream = max(int(events_per_stream), 2)
        self._rings: list[tuple[Any, list[Any], list[int]]] = []  # (stream, events, [next])
        self.staging = PinnedStaging(
            device, pin or _pinned_empty, lambda: self.record_event(self.current_stream()), staging_capacity
        )

    def _ring(self, stream: Any) -> tuple[list[Any], list[int]]:
        for own, events, turn in self._rings:
            if own == stream:
                return events, turn
        events = [self.cuda.Event() for _ in range(self.events_per_stream)]
        self._rings.append((stream, events, [0]))
        return events, self._rings[-1][2]

    def current_stream(self) -> Any:
        return self.cuda.current_stream(self.device)

    def new_stream(self, name: str) -> Any:
        stream = self.cuda.Stream(self.device)
        self._ring(stream)  # its events, made now
        return stream

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        context: contextlib.AbstractContextManager[Any] = self.cuda.stream(stream)  # torch.cuda.StreamContext
        return context

    def record_event(self, stream: Any) -> Any:
        events, turn = self._ring(stream)
        # mutant: gpu-event-made-per-record
        event = events[turn[0]]
        turn[0] = (turn[0] + 1) % len(events)
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def is_capturing(self) -> bool:
        return bool(self.cuda.is_current_stream_capturing())

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """The caching allocator must not reuse ``tensor``'s memory before ``stream`` is done with it
        (a CPU tensor, as in the recorded tests, has no such allocator)."""
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def index_tensor(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` on the device: staged in the pinned ring, copied without blocking."""
        return self.staging.to_device(values)

    def accesses(self, stream: Any, reads: Sequence[Region], writes: Sequence[Region], what: str) -> None:
        return None


# ---------------------------------------------------------------------- the ordering model
class OrderingError(AssertionError):
    """Two conflicting accesses that no stream wait or event orders: a GPU may run them
    the other way round."""


Clock = dict[int, int]


def _join(into: Clock, other: Clock) -> None:
    for index, count in other.items():
        if into.get(index, 0) < count:
            into[index] = count


def _covers(clock: Clock, other: Clock, skip: int) -> bool:
    return all(clock.get(index, 0) >= count for index, count in other.items() if index != skip)


@dataclass(eq=False)
class ModelStream:
    """A virtual stream: its clock counts its own operations and what it has waited for."""

    name: str
    index: int
    clock: Clock = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"ModelStream({self.name!r})"


@dataclass(eq=False)
class ModelEvent:
    """An event recorded on ``stream``: complete once the work its clock covers is."""

    model: OrderingModel
    stream: ModelStream
    clock: Clock

    def query(self) -> bool:
        return self.model._query(self)

    def synchronize(self) -> None:
        self.model._synchronize(self)


@dataclass(frozen=True)
class _Access:
    stream: int
    count: int  # the stream's own clock at the access: ordered before C iff C[stream] >= count
    label: str  # for messages: "<what> on <stream>"


@dataclass
class _Cell:
    last_write: Optional[_Access] = None
    reads: dict[int, _Access] = field(default_factory=dict)  # newest read per stream since it


class OrderingModel:
    """CUDA's stream semantics as a CPU model (see the module docstring).

    * Operations issued on a stream run in issue order on it.
    * ``wait_stream(a, b)``: a's later work runs after everything issued on b so far;
      ``wait_event(a, e)``: after what ``e`` covers; an event covers what its stream had
      issued and waited for when it was recorded.
    * The host (the scheduler's thread, and the I/O process) is a stream too: work issued
      after a host action runs after it, and the host is ordered after an event it saw
      complete (``query()`` true, ``synchronize()``).
    * Nothing completes on its own: :meth:`finish` says the device has run up to an event
      (or everything), so ``query()`` is false until a test says otherwise. Readiness
      checks therefore see in-flight work, the case in which their waits matter.
    """

    records_accesses = True

    def __init__(self) -> None:
        self._streams: list[ModelStream] = []
        self.host = self.new_stream("host")
        self.default = self.new_stream("default")
        self._current: list[ModelStream] = [self.default]
        self._done: Clock = {}
        self._cells: dict[tuple[str, int, int], _Cell] = {}
        self.capturing = False
        self.log: list[tuple[str, str, str]] = []  # (operation, stream, detail), in issue order

    # ------------------------------------------------------------------ Streams
    def current_stream(self) -> ModelStream:
        return self._current[-1]

    def new_stream(self, name: str) -> ModelStream:
        stream = ModelStream(name, len(self._streams))
        self._streams.append(stream)
        return stream

    @contextlib.contextmanager
    def use(self, stream: ModelStream) -> Iterator[None]:
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def record_event(self, stream: ModelStream) -> ModelEvent:
        self._issue(stream)
        self.log.append(("record_event", stream.name, ""))
        return ModelEvent(self, stream, dict(stream.clock))

    def wait_event(self, stream: ModelStream, event: ModelEvent) -> None:
        self._issue(stream)
        _join(stream.clock, event.clock)
        self.log.append(("wait_event", stream.name, event.stream.name))

    def wait_stream(self, stream: ModelStream, other: ModelStream) -> None:
        self._issue(stream)
        _join(stream.clock, other.clock)
        self.log.append(("wait_stream", stream.name, other.name))

    def is_capturing(self) -> bool:
        return self.capturing

    def keep_alive(self, tensor: torch.Tensor, stream: ModelStream) -> None:
        return None  # no caching allocator here

    def index_tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64)

    def accesses(
        self, stream: ModelStream, reads: Sequence[Region], writes: Sequence[Region], what: str = "access"
    ) -> None:
        """Work on ``stream`` reading ``reads`` and writing ``writes``: checked against every
        earlier conflicting access, then remembered."""
        count = self._issue(stream)
        access = _Access(stream.index, count, f"{what} on stream {stream.name!r}")
        for region in reads:
            for cell, where in self._cells_of(region):
                write = cell.last_write
                if write is not None and not self._ordered(write, stream):
                    raise OrderingError(
                        f"{access.label} reads {where}, written by {write.label} with nothing ordering the two"
                    )
                cell.reads[stream.index] = access
        for region in writes:
            for cell, where in self._cells_of(region):
                earlier = ([cell.last_write] if cell.last_write is not None else []) + list(cell.reads.values())
                for other in earlier:
                    if not self._ordered(other, stream):
                        raise OrderingError(
                            f"{access.label} writes {where}, accessed by {other.label} with nothing ordering the two"
                        )
                cell.last_write = access
                cell.reads = {}
        self.log.append(("access", stream.name, what))

    # ------------------------------------------------------------------ the test's side
    def host_accesses(self, reads: Sequence[Region] = (), writes: Sequence[Region] = (), what: str = "host") -> None:
        """The host reads or writes (e.g. the I/O process, a host slot)."""
        self.accesses(self.host, reads, writes, what)

    def finish(self, event: Optional[ModelEvent] = None) -> None:
        """The device has run everything up to ``event`` (default: everything issued)."""
        if event is not None:
            _join(self._done, event.clock)
            return
        for stream in self._streams:
            if stream is not self.host:
                _join(self._done, stream.clock)

    def count(self, operation: str, stream: Optional[ModelStream] = None) -> int:
        """How many ``operation`` (``wait_event``, ``wait_stream``, ...) were issued (on ``stream``)."""
        return sum(1 for op, name, _ in self.log if op == operation and (stream is None or name == stream.name))

    # ------------------------------------------------------------------ internals
    def _issue(self, stream: ModelStream) -> int:
        """One operation on ``stream``: after every host action so far, after its own past."""
        if stream is not self.host:
            _join(stream.clock, self.host.clock)
        stream.clock[stream.index] = stream.clock.get(stream.index, 0) + 1
        return stream.clock[stream.index]

    def _ordered(self, earlier: _Access, stream: ModelStream) -> bool:
        return stream.clock.get(earlier.stream, 0) >= earlier.count

    def _cells_of(self, region: Region) -> Iterator[tuple[_Cell, str]]:
        for slot in region.slots.reshape(-1).tolist():
            cell = self._cells.setdefault((region.buffer, region.layer, slot), _Cell())
            yield cell, f"{region.buffer} layer {region.layer} slot {slot}"

    def _query(self, event: ModelEvent) -> bool:
        if not _covers(self._done, event.clock, skip=self.host.index):  # host actions are done at once
            return False
        self._issue(self.host)
        _join(self.host.clock, event.clock)
        return True

    def _synchronize(self, event: ModelEvent) -> None:
        _join(self._done, event.clock)
        self._query(event)
