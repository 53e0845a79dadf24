"""The fast tier in accelerator memory (TeleRAG's GPU buffer).

On a GPU machine the clusters a search is predicted to probe are copied into GPU memory
while the LLM still writes the query, and searched there: the GPU reads its own memory at
terabytes per second, where a CPU search of the same clusters is bound by DRAM (or by the
SSD, for a memory-mapped table). :class:`DeviceClusterTier` is :class:`HostClusterTier`
with the page buffer in a torch tensor on ``device``:

* a cluster's rows are read from the table (the disk read, for a memory-mapped table) into
  a pinned staging buffer on the tier's copy thread, then copied to its pages on a CUDA
  stream of the tier's own, and an event is recorded behind the copy. The cluster becomes
  ``landed`` only when its event has completed (the copy thread waits for it; a search
  never does), so a search reads only clusters whose bytes are all on the device, and a
  cluster still in flight is a miss that faiss searches on the CPU;
* a search scores each query against its landed pages with one ``mv`` over the gathered
  pages on the device (a GEMV: no TF32 rounding, unlike a float32 GEMM on recent GPUs with
  TF32 enabled), and the scores come back to the host, where the top k are taken with the
  host tier's tie rule, so exact mode still returns what faiss's IVF search returns (up
  to float rounding: a GEMV sums in another order than faiss, so two documents scored
  within about 1e-6 at the k-th place may swap).

On a machine without CUDA the same class runs with ``device="cpu"`` (a torch buffer,
copies done inline on the copy thread): the tests run every fast-tier test on it, as the
PCR copy kernels are tested on CPU. The ids stay on the host in either case: the merge
with faiss's results happens there.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from pcr_client.rag.fast_host import DEFAULT_PAGE_ROWS, HostClusterTier, _Cluster
from pcr_client.rag.ivf import ClusterTable

logger = logging.getLogger(__name__)

FAST_TIERS = ("auto", "host", "gpu")


class DeviceClusterTier(HostClusterTier):
    def __init__(
        self, table: ClusterTable, capacity_bytes: int, device: str = "cuda", page_rows: int = DEFAULT_PAGE_ROWS
    ):
        import torch

        self._torch = torch
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("a GPU fast tier needs CUDA, and torch sees no CUDA device here (use the host tier)")
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        largest = int(np.max(np.diff(np.asarray(table.offsets)))) if table.nlist else 0
        # One cluster at a time goes through it: the copy thread waits for a cluster's
        # event before it reads the next one into the same buffer.
        self._staging = torch.empty((max(largest, 1), table.dim), dtype=torch.float32, pin_memory=self._cuda)
        super().__init__(table, capacity_bytes, page_rows)

    def _allocate_codes(self, num_pages: int):
        codes = self._torch.zeros(
            (num_pages, self.page_rows, self.table.dim), dtype=self._torch.float32, device=self.device
        )
        if self._cuda:
            # The fill runs on the current stream, the copies on the tier's own (which does
            # not wait for it): without this a first copy could land and then be zeroed.
            self._stream.wait_stream(self._torch.cuda.current_stream(self.device))
        return codes

    def _copy(self, entry: _Cluster) -> None:
        torch = self._torch
        rows = self.table.rows(entry.cluster)
        n = rows.stop - rows.start
        staged = self._staging[:n]
        staged.numpy()[:] = self.table.codes[rows.start : rows.stop]  # the read (from disk, if memory-mapped)
        spans = [(page, m * self.page_rows, min((m + 1) * self.page_rows, n)) for m, page in enumerate(entry.pages)]
        for page, start, end in spans:
            self.ids[page, : end - start] = self.table.ids[rows.start + start : rows.start + end]
        if not self._cuda:
            for page, start, end in spans:
                self.codes[page, : end - start].copy_(staged[start:end])
            return
        with torch.cuda.stream(self._stream):
            for page, start, end in spans:
                self.codes[page, : end - start].copy_(staged[start:end], non_blocking=True)
            landed = torch.cuda.Event(blocking=True)  # the copy thread sleeps on it, not spins
            landed.record(self._stream)
        landed.synchronize()  # this thread waits for its cluster; searches never wait for copies

    def _page_scores(self, pages: Sequence[int], query: np.ndarray) -> np.ndarray:
        torch = self._torch
        index = torch.as_tensor(list(pages), dtype=torch.long).to(self.device, non_blocking=True)
        q = torch.tensor(query, dtype=torch.float32, device=self.device)
        block = self.codes.index_select(0, index)  # [P, page_rows, dim]
        scores = torch.mv(block.view(-1, block.shape[-1]), q)  # a GEMV: full float32 (no TF32)
        return scores.view(len(pages), self.page_rows).cpu().numpy()


def make_fast_tier(
    table: ClusterTable, capacity_bytes: int, kind: str = "auto", page_rows: int = DEFAULT_PAGE_ROWS
) -> HostClusterTier:
    """The fast tier ``kind`` asks for: ``gpu`` (GPU memory: needs CUDA), ``host`` (a host
    buffer), or ``auto`` (the GPU where torch sees one, else the host)."""
    if kind not in FAST_TIERS:
        raise ValueError(f"fast tier must be one of {', '.join(FAST_TIERS)}, got {kind!r}")
    if kind == "auto":
        kind = "gpu" if _cuda_available() else "host"
    if kind == "gpu":
        return DeviceClusterTier(table, capacity_bytes, "cuda", page_rows)
    return HostClusterTier(table, capacity_bytes, page_rows)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
