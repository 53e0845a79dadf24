"""Layer-wise KV transfers between the device KV pool and the host chunk pool.

A forward pass runs layer after layer, so a copy need not finish before the forward
starts, only before the layer that reads it (a load) or after the layer that wrote it
(an offload):

* **Loads** (host -> device) are submitted when a match finds host-only chunks. The
  attention of layer ``i`` waits only for layer ``i`` of the loads submitted before it:
  SGLang's KV pool calls ``wait_until(i)`` on a registered layer-transfer counter in
  ``get_key_buffer``/``get_value_buffer``, and this class is that counter.
* **Offloads** (device -> host) of a batch's new chunks are planned before its forward;
  right after layer ``i``'s KV is written (``set_kv_buffer``), layer ``i`` of those chunks
  is copied to their host slots, so at the end of the forward the chunks are already
  host-resident and evicting them later frees device slots without a copy.

On CUDA the copies run on a side stream: a load waits for the work already queued on
the compute stream (slots it overwrites may have just been freed by it) and records
one event per layer, which the compute stream waits on at that layer; an offload of
layer ``i`` waits on an event recorded after the layer's write. On CPU there is no copy
engine to overlap with, so the same protocol runs each copy inline at the point where
CUDA would wait for it: a load's layer ``i`` when layer ``i`` is first read, an offload's
layer ``i`` when it is written.

:meth:`settle` is the synchronisation point the owner calls before it trusts or frees
anything a transfer touched (before marking offloaded chunks host-resident, before
freeing slots): on CPU it finishes every outstanding copy; on CUDA it makes the compute
stream wait for the side stream, so no later kernel can reuse a slot a copy still
touches. It never blocks the CPU on a GPU copy.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from pcr_sglang.transfer.copy_kv import Direction, copy_layer
from pcr_sglang.transfer.layout import HostChunkLayout

logger = logging.getLogger(__name__)


class LayerwiseMode(str, enum.Enum):
    """Which transfers overlap with the forward (``--pcr-layerwise``)."""

    OFF = "off"
    LOAD = "load"
    OFFLOAD = "offload"
    BOTH = "both"

    @property
    def loads(self) -> bool:
        return self in (LayerwiseMode.LOAD, LayerwiseMode.BOTH)

    @property
    def offloads(self) -> bool:
        return self in (LayerwiseMode.OFFLOAD, LayerwiseMode.BOTH)


@dataclass
class _Transfer:
    """Chunks moving one way: ``device_slots`` holds ``chunk_size`` token slots per
    entry of ``host_slots``. ``next_layer`` counts the layers already issued."""

    direction: Direction
    device_slots: torch.Tensor
    host_slots: torch.Tensor
    on_settled: Optional[Callable[[], None]] = None
    next_layer: int = 0
    events: list = field(default_factory=list)


class LayerwiseTransfer:
    """Issues per-layer copies of chunks and tells SGLang's forward when a layer is ready.

    Implements SGLang's layer-transfer-counter protocol (``wait_until``,
    ``consumer_index``) for the KV pool's per-layer read hook, and
    :meth:`on_layer_written` for the write side. Owned by the prefix cache; every method
    is called from the scheduler's thread.
    """

    # SGLang's pool consults ``consumer_index >= 0`` before some per-layer waits.
    consumer_index = 0

    def __init__(self, kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 host_buffer: torch.Tensor, layout: HostChunkLayout):
        if len(kv_layers) != layout.num_layers:
            raise ValueError(f"{len(kv_layers)} KV layers but the host layout has {layout.num_layers}")
        self._kv_layers = list(kv_layers)
        self._host = host_buffer
        self.layout = layout
        self.num_layers = layout.num_layers
        device = kv_layers[0][0].device if kv_layers else torch.device("cpu")
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CUDA: the stream the last forward ran on (SGLang's overlap scheduler runs
        # forwards on a stream of their own, not the scheduler's current stream).
        self._forward_stream: Optional[torch.cuda.Stream] = None
        self._host_dirty = False  # copies issued that the host may not see yet
        self._loads: list[_Transfer] = []  # submitted, not yet settled
        self._planned: list[_Transfer] = []  # offloads waiting for the next forward to start
        self._offloads: list[_Transfer] = []  # offloads of a forward that started, not settled
        # CUDA: the newest load event per layer that no forward has waited on yet.
        self._layer_events: list[Optional[torch.cuda.Event]] = [None] * self.num_layers

    # ------------------------------------------------------------------ streams
    def _compute_streams(self) -> list:
        streams = [torch.cuda.current_stream(self.device)]
        if self._forward_stream is not None and self._forward_stream != streams[0]:
            streams.append(self._forward_stream)
        return streams

    def _side_waits_for_compute(self) -> None:
        assert self._stream is not None
        for stream in self._compute_streams():
            self._stream.wait_stream(stream)

    def _compute_waits_for_side(self) -> None:
        assert self._stream is not None
        for stream in self._compute_streams():
            stream.wait_stream(self._stream)

    def fence_host(self) -> None:
        """Block until every copy issued so far is done, so another process may read or
        write the host pool's bytes (CUDA only; on CPU copies are already done)."""
        if self._stream is not None and self._host_dirty:
            self._stream.synchronize()
            self._host_dirty = False

    # ------------------------------------------------------------------ copies
    def _copy(self, transfer: _Transfer, layer: int) -> None:
        k, v = self._kv_layers[layer]
        copy_layer(transfer.direction, k, v, self._host, transfer.device_slots,
                   transfer.host_slots, layer, self.layout)

    def _issue_layers(self, transfer: _Transfer, up_to: int) -> None:
        """Issue layers ``[transfer.next_layer, up_to]`` of ``transfer``."""
        while transfer.next_layer <= min(up_to, self.num_layers - 1):
            layer = transfer.next_layer
            if self._stream is None:
                self._copy(transfer, layer)
            else:
                self._host_dirty = True
                with torch.cuda.stream(self._stream):
                    if transfer.next_layer == 0:
                        # Index tensors made on a compute stream, used on this one.
                        transfer.device_slots.record_stream(self._stream)
                        transfer.host_slots.record_stream(self._stream)
                    self._copy(transfer, layer)
                    if transfer.direction == Direction.HOST_TO_DEVICE:
                        event = torch.cuda.Event()
                        event.record(self._stream)
                        self._layer_events[layer] = event
            transfer.next_layer += 1

    def _make(self, direction: Direction, device_slots: torch.Tensor, host_slots: Sequence[int],
              on_settled: Optional[Callable[[], None]]) -> _Transfer:
        index_device = device_slots.device if self._stream is not None else torch.device("cpu")
        return _Transfer(
            direction=direction,
            device_slots=device_slots.to(torch.int64),
            host_slots=torch.tensor(list(host_slots), dtype=torch.int64).to(index_device),
            on_settled=on_settled,
        )

    # ------------------------------------------------------------------ synchronous
    def copy_now(self, direction: Direction, device_slots: torch.Tensor,
                 host_slots: Sequence[int]) -> None:
        """Copy every layer before returning (no overlap): eviction-time demotions, and
        loads when ``--pcr-layerwise`` leaves loads out."""
        transfer = self._make(direction, device_slots, host_slots, None)
        if self._stream is not None:
            # Ordered after everything already queued on the compute streams, and they
            # after the copy: equivalent to a copy on the compute stream.
            self._side_waits_for_compute()
        self._issue_layers(transfer, self.num_layers - 1)
        if self._stream is not None:
            self._compute_waits_for_side()
            self._layer_events = [None] * self.num_layers

    # ------------------------------------------------------------------ loads
    def submit_load(self, device_slots: torch.Tensor, host_slots: Sequence[int],
                    on_settled: Optional[Callable[[], None]] = None) -> None:
        """Load chunks ``host_slots`` into ``device_slots``; ``on_settled`` runs in the
        :meth:`settle` after the copy is complete or ordered before later compute."""
        transfer = self._make(Direction.HOST_TO_DEVICE, device_slots, host_slots, on_settled)
        if self._stream is not None:
            # The slots may have been freed by work still queued on a compute stream.
            self._side_waits_for_compute()
            self._issue_layers(transfer, self.num_layers - 1)
        self._loads.append(transfer)

    def wait_until(self, layer: int) -> None:
        """SGLang's per-layer read hook: layer ``layer`` of every submitted load is in place."""
        if not 0 <= layer < self.num_layers:
            return
        if self._stream is None:
            for transfer in self._loads:
                self._issue_layers(transfer, layer)
            return
        event = self._layer_events[layer]
        if event is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_event(event)
            self._layer_events[layer] = None

    # ------------------------------------------------------------------ offloads
    def plan_offload(self, device_slots: torch.Tensor, host_slots: Sequence[int],
                     on_settled: Optional[Callable[[], None]] = None) -> None:
        """Copy chunks to ``host_slots`` layer by layer as the next forward writes them.

        The plan belongs to the next forward: :meth:`begin_forward` adopts it, and only
        then can :meth:`settle` complete it (settling it earlier would copy KV that does
        not exist yet).
        """
        if len(host_slots):
            self._planned.append(self._make(Direction.DEVICE_TO_HOST, device_slots, host_slots,
                                            on_settled))

    def begin_forward(self) -> None:
        """A forward pass starts: the offloads planned so far are its new chunks."""
        if self._stream is not None:
            self._forward_stream = torch.cuda.current_stream(self.device)
        if self._planned:
            self._offloads.extend(self._planned)
            self._planned = []

    def on_layer_written(self, layer: int) -> None:
        """Called right after the forward wrote layer ``layer``'s new KV."""
        if not self._offloads:
            return
        if self._stream is not None:
            if torch.cuda.is_current_stream_capturing():
                return  # a graph replay would skip this; settle() issues what is left
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for transfer in self._offloads:
            if transfer.next_layer == layer:
                self._issue_layers(transfer, layer)

    # ------------------------------------------------------------------ settling
    @property
    def busy(self) -> bool:
        return bool(self._loads or self._offloads)

    @property
    def planned_chunks(self) -> int:
        """Chunks of offloads whose forward has not started yet."""
        return sum(t.host_slots.numel() for t in self._planned)

    def settle(self) -> None:
        """Finish (CPU) or order before later compute (CUDA) every load and every offload
        whose forward has started, then run their ``on_settled`` callbacks. Offloads
        still waiting for their forward stay planned.

        An offload whose forward has already run but wrote some layers outside
        ``set_kv_buffer`` (a graph replay) has those layers issued here, after the
        compute stream's work, so they copy what the forward wrote.
        """
        if not self.busy:
            return
        if self._stream is not None:
            self._side_waits_for_compute()  # layers a graph replay wrote are in place first
        transfers, self._loads, self._offloads = self._loads + self._offloads, [], []
        for transfer in transfers:
            self._issue_layers(transfer, self.num_layers - 1)
        if self._stream is not None:
            self._compute_waits_for_side()
            self._layer_events = [None] * self.num_layers
        for transfer in transfers:
            if transfer.on_settled is not None:
                transfer.on_settled()
