"""TransferEngine: KV copies between the device KV pool and host chunk slots, layer by layer,
each with its own ticket.

A forward pass runs layer after layer, so a copy need not finish before the forward
starts, only before the layer that reads it (a load) or after the layer that wrote it
(an offload):

* **Loads** (host -> device) are submitted when a request is admitted. The attention of
  layer ``i`` waits only for layer ``i``: SGLang's KV pool calls ``wait_until(i)`` on a
  registered layer-transfer counter in ``get_key_buffer``/``get_value_buffer``, and this
  class is that counter.
* **Offloads** (device -> host) of a request's new chunks are planned for that request
  and run only in a batch that contains it (``begin_batch`` / ``end_batch`` around
  SGLang's ``run_batch``): right after layer ``i``'s KV is written (``set_kv_buffer``),
  layer ``i`` of those chunks is copied to their host slots. A forward of another batch
  never runs them.
* **Demotions** (device -> host at eviction) copy every layer at once.
* **Re-placements** (device -> device, document reuse): a reused document's KV copied
  into a request's private slots with K rotated by the position delta, layer ``i`` after
  layer ``i`` of the loads submitted before it and before the forward reads layer ``i``
  (:mod:`pcr_sglang.transfer.replacements`).

On CUDA the copies run on a side stream: a copy first waits for the work queued on the
compute streams (slots it overwrites may just have been freed there), loads record one
event per layer that the compute stream waits on at that layer, and each transfer
records an event when it is complete: its ticket. Nothing here blocks the CPU on the GPU:
:meth:`host_slot_ready` asks whether the copies touching a host slot have completed (its
ticket, :mod:`pcr_sglang.transfer.tickets`), which the scheduler checks before it hands
the slot to the I/O process; :meth:`fence_before_reuse` makes the compute stream wait (on
the GPU) for the copies before device slots are reused. On CPU there is no copy engine to
overlap with, so the same protocol runs each copy inline where CUDA would wait for it: a
load's layer ``i`` when layer ``i`` is first read, an offload's layer ``i`` right after it
is written, and whatever is left at the end of the batch. Re-placements run on a second
side stream on CUDA, each layer after the loads' event of that layer.

The streams and events of the CUDA algorithm go through a
:class:`~pcr_sglang.transfer.streams.Streams` object: ``torch.cuda``'s on a GPU
(:class:`~pcr_sglang.transfer.streams.CudaStreams`, the default there), none on a CPU
pool (the inline algorithm above). Tests pass an
:class:`~pcr_sglang.transfer.streams.OrderingModel` to run the CUDA algorithm on CPU
tensors: the copies run at once, and the model checks that the waits issued order every
copy against the forward as a GPU would need.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.copy_kv import Direction, Host, check_copy_slots_on_device, copy_layer
from pcr_sglang.transfer.host_pointer import resolve as resolve_host_pointer
from pcr_sglang.transfer.layerwise_mode import LayerwiseMode
from pcr_sglang.transfer.replacements import Replacement, Replacements
from pcr_sglang.transfer.rope_shift import RopeSpec, check_slots_on_device
from pcr_sglang.transfer.streams import DEVICE_KV, HOST_KV, CudaStreams, Event, Region, Streams
from pcr_sglang.transfer.tickets import Tickets, Transfer

__all__ = ["LayerwiseMode", "TransferEngine"]  # LayerwiseMode: re-exported, as before its own module

logger = logging.getLogger(__name__)


class TransferEngine:
    """Issues per-layer copies and tells SGLang's forward when a layer is ready. Every
    method runs on the scheduler's thread (which also launches the forward)."""

    # SGLang's pool consults ``consumer_index >= 0`` before some per-layer waits.
    consumer_index = 0

    def __init__(
        self,
        kv_layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        host_buffer: torch.Tensor,
        layout: HostChunkLayout,
        mode: LayerwiseMode = LayerwiseMode.BOTH,
        streams: Optional[Streams] = None,
        debug_checks: bool = False,
    ) -> None:
        """``streams``: run the stream algorithm on these (default: CUDA's on a CUDA pool,
        none on a CPU pool, which runs each copy inline). ``debug_checks``
        (``--pcr-debug-checks``): every transfer's and re-placement's slots are checked on
        the device too (device-side asserts, no host wait), as the CPU path checks them."""
        if len(kv_layers) != layout.num_layers:
            raise ValueError(f"{len(kv_layers)} KV layers but the host layout has {layout.num_layers}")
        self._kv_layers = list(kv_layers)
        self.debug_checks = debug_checks
        self.layout = layout
        self.num_layers = layout.num_layers
        self.mode = LayerwiseMode(mode)
        self.device = kv_layers[0][0].device if kv_layers else torch.device("cpu")
        # CUDA: the copy kernel gets the registered pool's device address, resolved once
        # here (as HiCache's pointer tables), never the CPU tensor.
        self._host: Host = host_buffer
        if self.device.type == "cuda" and host_buffer.device.type == "cpu":
            self._host = resolve_host_pointer(host_buffer, self.device)
        if streams is None and self.device.type == "cuda":
            # Event rings sized for what one step holds: a load's event per layer, a
            # re-placement's per layer, completions.
            streams = CudaStreams(self.device, events_per_stream=4 * self.num_layers + 16)
        self._streams = streams
        self._stream = streams.new_stream("pcr-copy") if streams is not None else None
        self._forward_stream: Any = None  # CUDA: the stream the last forward ran on
        self._loads: list[Transfer] = []  # CPU: submitted, layers not all issued yet
        self._tickets = Tickets(self.num_layers)  # each host slot's last copy, offloads planned per request
        self._active: list[Transfer] = []  # offloads of the batch now running
        self._in_flight: list[Transfer] = []  # issued, not known complete (CUDA)
        self._layer_events: list[Optional[Event]] = [None] * self.num_layers  # CUDA: newest load event per layer
        self._replacements = Replacements(self._kv_layers, self.mode.loads)
        # Concatenated indices of a set of transfers copied together, until one completes.
        self._merged: dict[tuple[Transfer, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def kernel_operands(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, Host]:
        """Layer ``layer``'s K and V buffers and the host pool as the copy kernel gets them
        (on CUDA its resolved device address): what the startup warm-up launches on."""
        k, v = self._kv_layers[layer]
        return k, v, self._host

    def _pool_tokens(self) -> int:
        return int(self._kv_layers[0][0].shape[0]) if self._kv_layers else 0

    # ------------------------------------------------------------------ streams
    def note_forward_stream(self) -> None:
        """Called as a forward starts: the overlap scheduler runs forwards on a stream of
        its own, which copies must be ordered against."""
        if self._streams is not None:
            self._forward_stream = self._streams.current_stream()

    def _compute_streams(self, streams: Streams) -> list[Any]:
        compute = [streams.current_stream()]
        if self._forward_stream is not None and self._forward_stream != compute[0]:
            compute.append(self._forward_stream)
        return compute

    def fence_after_forward(self) -> None:
        """A copy on the current stream is about to read or write device slots a forward
        still running on the overlap scheduler's stream may touch: wait for it (CUDA)."""
        if self._streams is None:
            return
        current = self._streams.current_stream()
        if self._forward_stream is not None and self._forward_stream != current:
            self._streams.wait_stream(current, self._forward_stream)

    def _side_waits_for_compute(self, streams: Streams) -> None:
        for stream in self._compute_streams(streams):
            # mutant: ordering-side-stream-skips-the-compute-streams
            streams.wait_stream(self._stream, stream)

    def _compute_waits_for(self, streams: Streams, transfer: Transfer) -> None:
        """The next kernel on the compute streams waits for every layer of ``transfer``."""
        assert transfer.event is not None  # recorded when its last layer was issued
        for stream in self._compute_streams(streams):
            streams.wait_event(stream, transfer.event)

    # ------------------------------------------------------------------ issuing
    def _make(self, direction: Direction, device_slots: torch.Tensor, host_slots: Sequence[int]) -> Transfer:
        if self._streams is not None:  # staged through pinned memory allocated once (CUDA)
            # mutant: gpu-index-tensor-pageable-per-transfer
            index = self._streams.index_tensor(host_slots)
        else:
            index = torch.tensor(list(host_slots), dtype=torch.int64)
        # A copy: the caller's slot tensor may be a row of SGLang's req_to_token, rewritten later.
        # mutant: gpu-serving-launch-not-warmed
        transfer = Transfer(direction, device_slots.to(torch.int64, copy=True), index, tuple(host_slots))
        if self.debug_checks:
            if transfer.device_slots.numel() != len(transfer.host_slots) * self.layout.chunk_size:
                raise ValueError(
                    f"{transfer.device_slots.numel()} device token slots for "
                    f"{len(transfer.host_slots)} chunks of {self.layout.chunk_size}"
                )
            # mutant: gpu-debug-checks-skip-copies
            check_copy_slots_on_device(transfer.device_slots, index, self._pool_tokens(), self.layout.num_slots)
        self._tickets.hold(transfer)
        return transfer

    def _issue(self, transfers: Sequence[Transfer], up_to: int) -> None:
        """Issue layers ``[next_layer, up_to]`` of every transfer in ``transfers``.

        One copy per layer and direction moves every listed transfer's chunks that are at
        that layer: a prompt's offloads are one transfer per chunk, and a copy call per
        chunk and layer (750 for a 400-token prompt on a 30-layer model) cost more than
        the bytes they moved (on CPU ~190 ms against ~10 ms merged; on CUDA, a kernel
        launch each). Within a layer offloads go first, as they came first before."""
        last = min(up_to, self.num_layers - 1)
        pending = [t for t in transfers if t.next_layer <= last]
        while pending:
            layer = min(t.next_layer for t in pending)
            for direction in (Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE):
                group = tuple(t for t in pending if t.next_layer == layer and t.direction == direction)
                if group:
                    self._copy_layer(group, layer)
            pending = [t for t in pending if t.next_layer <= last]
        done = [t for t in transfers if t.next_layer == self.num_layers]
        if done:
            finished_now = set(done)  # by identity
            for key in [key for key in self._merged if not finished_now.isdisjoint(key)]:
                del self._merged[key]
        if self._streams is not None:
            finished = [t for t in done if t.event is None]
            if finished:
                event = self._streams.record_event(self._stream)  # one event on the side stream completes them all
                for transfer in finished:
                    transfer.event = event
                    self._in_flight.append(transfer)

    def _copy_layer(self, group: tuple[Transfer, ...], layer: int) -> None:
        """Layer ``layer`` of every transfer in ``group`` (one direction, all at that layer)."""
        k, v = self._kv_layers[layer]
        direction = group[0].direction
        if self._streams is None:
            for device_slots, host_index in self._merged_indices(group):
                copy_layer(direction, k, v, self._host, device_slots, host_index, layer, self.layout)
        else:
            streams = self._streams
            with streams.use(self._stream):
                if layer == 0:
                    for transfer in group:
                        streams.keep_alive(transfer.device_slots, self._stream)
                        streams.keep_alive(transfer.host_index, self._stream)
                for device_slots, host_index in self._merged_indices(group):
                    copy_layer(direction, k, v, self._host, device_slots, host_index, layer, self.layout)
                    if streams.records_accesses:
                        device, host = Region(DEVICE_KV, layer, device_slots), Region(HOST_KV, layer, host_index)
                        if direction == Direction.HOST_TO_DEVICE:
                            streams.accesses(self._stream, [host], [device], "load")
                        else:
                            streams.accesses(self._stream, [device], [host], "offload")
                if direction == Direction.HOST_TO_DEVICE:
                    self._layer_events[layer] = streams.record_event(self._stream)
        for transfer in group:
            transfer.next_layer += 1

    def _merged_indices(self, group: tuple[Transfer, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The index pairs one layer of ``group`` is copied with: all of them concatenated,
        kept while the group advances layer by layer. An offload group that names a host
        slot twice is copied transfer by transfer instead, so the later write still wins."""
        if len(group) == 1:
            return [(group[0].device_slots, group[0].host_index)]
        # mutant: gpu-merged-indices-made-per-layer
        merged = self._merged.get(group)
        if merged is None:
            slots = [s for t in group for s in t.host_slots]
            if group[0].direction == Direction.DEVICE_TO_HOST and len(set(slots)) != len(slots):
                merged = [(t.device_slots, t.host_index) for t in group]
            else:
                merged = [(torch.cat([t.device_slots for t in group]), torch.cat([t.host_index for t in group]))]
            self._merged[group] = merged
        return merged

    # ------------------------------------------------------------------ loads
    def load(self, device_slots: torch.Tensor, host_slots: Sequence[int]) -> None:
        """Copy chunks ``host_slots`` into ``device_slots`` before the next forward reads
        them (layer by layer with ``--pcr-layerwise load``)."""
        transfer = self._make(Direction.HOST_TO_DEVICE, device_slots, host_slots)
        streams = self._streams
        if streams is not None:
            self._side_waits_for_compute(streams)
            self._issue((transfer,), self.num_layers - 1)
            if not self.mode.loads:  # the next kernel waits for the whole copy
                self._compute_waits_for(streams, transfer)
        elif self.mode.loads:
            self._loads.append(transfer)
        else:
            self._issue((transfer,), self.num_layers - 1)

    def wait_until(self, layer: int) -> None:
        """SGLang's per-layer read hook: layer ``layer`` of every submitted load is in place."""
        if not 0 <= layer < self.num_layers:
            return
        if self._streams is None:
            self._issue(self._loads, layer)
            self._loads = [t for t in self._loads if t.next_layer < self.num_layers]
            # mutant: doc-reuse-replacement-after-the-forwards-read
            self._replacements.run(layer)
            return
        if self._streams.is_capturing():
            return
        current = self._streams.current_stream()
        event = self._layer_events[layer]
        if event is not None:
            self._streams.wait_event(current, event)
            self._layer_events[layer] = None
        self._replacements.wait_layer(self._streams, current, layer)

    # ------------------------------------------------------------------ re-placements
    def replace(
        self, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor, rope: RopeSpec, layers: Optional[range] = None
    ) -> None:
        """Re-place device KV ``src`` -> ``dst`` (int64 slot tensors on the pool's device,
        checked by the caller), K rotated by ``delta`` positions, for ``layers`` (default:
        all), before the next forward reads each layer. Without ``--pcr-layerwise load`` it
        runs now, after every load submitted so far."""
        layers = layers if layers is not None else range(self.num_layers)
        if not len(layers):
            return
        if self.debug_checks:
            # mutant: gpu-debug-checks-skip-replacements
            check_slots_on_device(src, dst, self._pool_tokens())
        job = Replacement(src, dst, delta, rope, layers.start, layers.stop)
        if self._streams is None:
            self._replacements.add(job)
        else:
            self._replacements.issue(
                self._streams, job, layers, self._compute_streams(self._streams), self._stream, self._layer_events
            )

    @property
    def pending_replacements(self) -> int:
        """CPU: re-placements with layers not run yet."""
        return self._replacements.pending

    # ------------------------------------------------------------------ offloads
    def plan_offload(self, owner: str, device_slots: torch.Tensor, host_slot: int) -> None:
        """Copy one chunk of request ``owner`` to ``host_slot`` as a batch containing the
        request writes it (the chunk's last tokens are written by that batch's forward)."""
        self._tickets.plan(owner, self._make(Direction.DEVICE_TO_HOST, device_slots, (host_slot,)))

    def drop_plans(self, owner: str, host_slots: Optional[Iterable[int]] = None) -> None:
        """Forget offloads planned for request ``owner`` that no batch ran (those into
        ``host_slots`` only, or all): their slots are ready for other uses at once."""
        self._tickets.drop(owner, host_slots)

    def begin_batch(self, owners: Iterable[str]) -> None:
        """SGLang's ``run_batch`` starts for these requests: their planned offloads run in it."""
        self._active.extend(self._tickets.take(owners))

    def on_layer_written(self, layer: int) -> None:
        """Called right after the forward wrote layer ``layer``'s new KV."""
        if not self._active:
            return
        if self._streams is not None:
            if self._streams.is_capturing():
                return  # a graph replay would skip this: end_batch issues what is left
            # mutant: ordering-offload-before-the-forward-wrote-the-layer
            self._streams.wait_stream(self._stream, self._streams.current_stream())
        self._issue([t for t in self._active if t.next_layer == layer], layer)

    def end_batch(self) -> None:
        """``run_batch`` returned: issue what its forward left (layers written outside
        ``set_kv_buffer``, loads no layer read), so every ticket of the batch completes."""
        if self._streams is not None and self._active:
            self._side_waits_for_compute(self._streams)
        self._issue(self._active + self._loads, self.num_layers - 1)
        self._active, self._loads = [], []
        self._replacements.run(self.num_layers - 1)
        self._merged.clear()
        self._in_flight = [t for t in self._in_flight if not t.complete(self.num_layers)]
        self._replacements.in_flight()

    # ------------------------------------------------------------------ demotions
    def copy_to_host(self, device_slots: torch.Tensor, host_slots: Sequence[int]) -> None:
        """Copy whole chunks to host memory now (eviction): the device slots may be reused
        right after this call (on CUDA, later kernels are ordered after the copy)."""
        transfer = self._make(Direction.DEVICE_TO_HOST, device_slots, host_slots)
        if self._streams is not None:
            self._side_waits_for_compute(self._streams)
        self._issue((transfer,), self.num_layers - 1)
        if self._streams is not None:
            self._compute_waits_for(self._streams, transfer)

    # ------------------------------------------------------------------ readiness
    def host_slot_ready(self, slot: int) -> bool:
        """Every copy touching host slot ``slot`` has completed: another process may use it."""
        return self._tickets.ready(slot)

    def offload_ran(self, slot: int) -> bool:
        """The offload planned into ``slot`` has run (all its layers are issued)."""
        return self._tickets.ran(slot)

    def fence_before_reuse(self) -> None:
        """Device slots are about to be freed: no copy still in progress may touch them
        after a later kernel does (CPU: finish pending loads and re-placements; CUDA: a
        GPU-side wait)."""
        streams = self._streams
        if streams is None:
            self._issue(self._loads, self.num_layers - 1)
            self._loads = []
            self._replacements.run(self.num_layers - 1)
            return
        self._in_flight = [t for t in self._in_flight if not t.complete(self.num_layers)]
        if self._in_flight:
            for stream in self._compute_streams(streams):
                streams.wait_stream(stream, self._stream)
        if self._replacements.in_flight():
            for stream in self._compute_streams(streams):
                # mutant: ordering-slots-reused-before-the-replacement-read-them
                streams.wait_stream(stream, self._replacements.stream)

    @property
    def pending_loads(self) -> int:
        return len(self._loads)

    @property
    def planned_offloads(self) -> int:
        return self._tickets.planned
