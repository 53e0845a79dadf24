"""The transfer engine's re-placements (document reuse): a reused document's KV copied into
a request's private slots with K rotated by the position delta
(:func:`~pcr_sglang.transfer.rope_shift.replace_layer`), layer by layer with the loads.

Layer ``i`` is re-placed after layer ``i`` of the loads submitted before it (the document's
chain may be one of them) and before the forward reads layer ``i``. On CPU the engine runs
each layer inline when the forward first reads it (:meth:`Replacements.run`). On CUDA they
run on a second side stream (a load's layers are all queued on the first when it is
submitted, so a rotation queued behind them would wait for every layer): each layer waits
for the loads' event of that layer, and records one the forward waits on.

This module holds that bookkeeping apart from :mod:`pcr_sglang.transfer.engine`, which
owns the loads and offloads these are ordered against and calls in here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pcr_sglang.transfer.rope_shift import RopeSpec, replace_layer
from pcr_sglang.transfer.streams import DEVICE_KV, Event, Region, Streams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Replacement:
    """KV of device slots ``src`` into ``dst``, K rotated by ``delta`` positions, for
    layers ``next_layer`` to ``end_layer - 1`` (those not run yet)."""

    src: torch.Tensor
    dst: torch.Tensor
    delta: torch.Tensor
    rope: RopeSpec
    next_layer: int
    end_layer: int


class Replacements:
    """The re-placements submitted to one transfer engine, over its KV layers.

    ``layerwise`` (``--pcr-layerwise`` includes loads): each layer runs after that layer
    of the loads; otherwise a re-placement runs whole when it is submitted (the loads ran
    at their submission). The CUDA methods take the engine's streams."""

    def __init__(self, kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]], layerwise: bool) -> None:
        self._kv_layers = kv_layers
        self._layerwise = layerwise
        self._queued: list[Replacement] = []  # CPU: submitted, layers not all run yet
        self.stream: Any = None  # CUDA: created with the first re-placement
        # CUDA: the newest re-placement event per layer, and the newest of all (until it
        # completes); one stream runs them in order, so the newest covers the older ones.
        self._layer_events: list[Optional[Event]] = [None] * len(kv_layers)
        self._tail: Optional[Event] = None

    # ------------------------------------------------------------------ CPU: inline
    def add(self, job: Replacement) -> None:
        """Run ``job``'s layers as the forward reads them (layer-wise loads), or now."""
        if self._layerwise:
            self._queued.append(job)
        else:  # loads ran at submission: nothing to wait for
            self._run_one(job, len(self._kv_layers) - 1)

    def _run_one(self, job: Replacement, up_to: int) -> None:
        """Layers ``[job.next_layer, up_to]`` of ``job``, now."""
        for layer in range(job.next_layer, min(up_to + 1, job.end_layer)):
            k_buffer, v_buffer = self._kv_layers[layer]
            replace_layer(k_buffer, v_buffer, job.src, job.dst, job.delta, job.rope, verify_slots=False)
            job.next_layer = layer + 1

    def run(self, up_to: int) -> None:
        """Every queued layer up to ``up_to``, after the loads' layers up to it."""
        if not self._queued:
            return
        for job in self._queued:
            self._run_one(job, up_to)
        self._queued = [j for j in self._queued if j.next_layer < j.end_layer]

    @property
    def pending(self) -> int:
        """Re-placements with layers not run yet."""
        return len(self._queued)

    # ------------------------------------------------------------------ CUDA: a side stream
    def issue(
        self,
        streams: Streams,
        job: Replacement,
        layers: range,
        compute: Sequence[Any],
        loads: Any,
        load_events: Sequence[Optional[Event]],
    ) -> None:
        """Queue ``layers`` of ``job`` on the re-placement stream: after the work on the
        ``compute`` streams (sources written, or targets last read, by a forward) and each
        layer after ``load_events`` (the loads' newest event per layer); without layer-wise
        loads, after everything on ``loads`` (the loads' side stream), and the compute
        streams wait for the whole re-placement."""
        if self.stream is None:
            self.stream = streams.new_stream("pcr-replace")
        stream = self.stream
        for waiting in compute:
            streams.wait_stream(stream, waiting)
        if not self._layerwise:
            # Whole loads, submitted before. (Also implied: load() made the compute streams
            # wait for them, and this stream waited for those just above.)
            streams.wait_stream(stream, loads)
        with streams.use(stream):
            for tensor in (job.src, job.dst, job.delta):
                streams.keep_alive(tensor, stream)
            event: Optional[Event] = None
            for layer in layers:
                load_event = load_events[layer]
                if load_event is not None:
                    # mutant: ordering-replacement-before-its-layers-load
                    streams.wait_event(stream, load_event)
                k_buffer, v_buffer = self._kv_layers[layer]
                replace_layer(k_buffer, v_buffer, job.src, job.dst, job.delta, job.rope, verify_slots=False)
                if streams.records_accesses:
                    streams.accesses(
                        stream, [Region(DEVICE_KV, layer, job.src)], [Region(DEVICE_KV, layer, job.dst)], "re-placement"
                    )
                event = streams.record_event(stream)
                if self._layerwise:
                    self._layer_events[layer] = event
        job.next_layer = job.end_layer
        self._tail = event
        if not self._layerwise:  # the next kernel waits for the whole re-placement
            assert event is not None  # the engine submits no job without layers
            for waiting in compute:
                streams.wait_event(waiting, event)

    def wait_layer(self, streams: Streams, current: Any, layer: int) -> None:
        """The forward on ``current`` is about to read layer ``layer``: it waits for that
        layer's newest re-placement."""
        event = self._layer_events[layer]
        if event is not None:
            streams.wait_event(current, event)
            self._layer_events[layer] = None

    def in_flight(self) -> bool:
        """Whether the newest re-placement (so any) is still running."""
        if self._tail is not None and self._tail.query():
            self._tail = None
        return self._tail is not None
