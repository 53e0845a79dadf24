"""The host pool's layout: chunk slots, each holding every layer's K and V of one chunk.

``host[slot][layer][kv][token][row]`` with ``row`` the bytes of one token's K (or V) in
one layer (heads x head_dim x itemsize). Why this order:

* one layer of one chunk (K then V) is one contiguous block of ``2 * chunk * row``
  bytes, so a layer-wise load or offload of a chunk is a single contiguous host access
  per layer, which is what a copy engine or kernel streams fastest;
* a whole chunk (all layers) is contiguous too, so writing a chunk to SSD or reading it
  back is one sequential I/O of ``layers * 2 * chunk * row`` bytes;
* bytes, not a dtype: the same pool and kernel serve bf16, fp16, fp32 and fp8 KV.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostChunkLayout:
    num_slots: int
    num_layers: int
    chunk_size: int
    row_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_layers", "chunk_size", "row_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def layer_bytes(self) -> int:
        """One layer of one chunk: K rows then V rows."""
        return 2 * self.chunk_size * self.row_bytes

    @property
    def slot_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_slots, self.num_layers, 2, self.chunk_size, self.row_bytes)
