"""The model worker's side of PCR: SGLang's KV pool and forward, wired to the transfer engine.

What runs where the forward runs (vLLM's KV connector draws the same line between its
scheduler and worker halves):

* the KV pool's per-layer read hook (``register_layer_transfer_counter``): layer ``i``'s
  attention waits for layer ``i`` of the loads admitted before it;
* its per-layer write (``set_kv_buffer``, wrapped on this pool instance, the one write-side
  hook SGLang has): right after layer ``i`` is written, layer ``i`` of the running batch's
  planned offloads is copied;
* ``run_batch``: the offloads planned for the batch's own requests run in it, and none
  of any other batch's;
* ``ModelRunner.forward``: the forward's stream (CUDA) and extend timings, which feed
  the SSD tier's load-or-recompute model on the scheduler side.

Nothing here decides residency: that is the scheduler side's and the cache state's.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.warmup import warm_up_on_cuda

logger = logging.getLogger(__name__)

# KV pool -> its worker side, for the ModelRunner.forward hook (no attribute on SGLang's pool).
_BY_POOL: "weakref.WeakKeyDictionary[Any, WorkerSide]" = weakref.WeakKeyDictionary()


class WorkerSide:
    def __init__(self, kvcache: Any, engine: TransferEngine):
        self.engine = engine
        self.mode = engine.mode
        self._timings: list[tuple[int, Any, Any]] = []  # (tokens, start, end): seconds or CUDA events
        self.forwards = 0  # model forwards run (extend and decode)
        if self.mode.loads:
            if getattr(kvcache, "layer_transfer_counter", None) is not None:
                raise ValueError("--pcr-layerwise load: the KV pool already has a layer-transfer counter")
            kvcache.register_layer_transfer_counter(engine)
        if self.mode.offloads:
            self._wrap_set_kv_buffer(kvcache)
        _BY_POOL[kvcache] = self

    @staticmethod
    def for_pool(kvcache: Any) -> Optional[WorkerSide]:
        try:
            return _BY_POOL.get(kvcache)
        except TypeError:  # not weakly referenceable: not ours
            return None

    def _wrap_set_kv_buffer(self, kvcache: Any) -> None:
        write = kvcache.set_kv_buffer
        start_layer = getattr(kvcache, "start_layer", 0)
        engine = self.engine

        def set_kv_buffer(layer: Any, loc: Any, cache_k: Any, cache_v: Any, *args: Any, **kwargs: Any) -> None:
            write(layer, loc, cache_k, cache_v, *args, **kwargs)
            layer_id = kwargs.get("layer_id_override")
            engine.on_layer_written((layer.layer_id if layer_id is None else layer_id) - start_layer)

        kvcache.set_kv_buffer = set_kv_buffer

    # ------------------------------------------------------------------ hooks
    def run_batch(self, run: Callable[[], Any], request_ids: Iterable[str]) -> Any:
        """Around SGLang's ``run_batch``: its requests' planned offloads run in it."""
        self.engine.begin_batch(request_ids)
        try:
            return run()
        finally:
            self.engine.end_batch()

    def forward(self, run: Callable[[], Any], forward_batch: Any) -> Any:
        """Around ``ModelRunner.forward``: note the stream, time extends."""
        self.engine.note_forward_stream()
        self.forwards += 1
        tokens = getattr(forward_batch, "extend_num_tokens", None)
        if not tokens:
            return run()
        if self.engine.device.type != "cuda":
            start = time.perf_counter()
            result = run()
            self._timings.append((int(tokens), start, time.perf_counter()))
            return result
        # torch.cuda.Event.__init__ is unannotated in torch's stubs.
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        begin.record()
        result = run()
        end.record()
        self._timings.append((int(tokens), begin, end))  # read once the GPU is done
        return result

    def take_prefill_timings(self) -> list[tuple[int, float]]:
        """Finished extends since the last call: (tokens, seconds)."""
        done: list[tuple[int, float]] = []
        while self._timings:
            tokens, start, end = self._timings[0]
            if isinstance(end, float):
                done.append((tokens, end - start))
            elif end.query():
                done.append((tokens, start.elapsed_time(end) / 1000))
            else:
                break
            self._timings.pop(0)
        return done


def attach_worker_side(allocator: Any, host_buffer: torch.Tensor, layout: Any, mode: str) -> WorkerSide:
    """Build the transfer engine over the allocator's KV pool and hook it in."""
    kvcache = allocator.get_kvcache()
    engine = TransferEngine(list(zip(kvcache.k_buffer, kvcache.v_buffer)), host_buffer, layout, LayerwiseMode(mode))
    warm_up_on_cuda(engine=engine)  # the copy kernel compiled now, not at the first host hit
    return WorkerSide(kvcache, engine)
