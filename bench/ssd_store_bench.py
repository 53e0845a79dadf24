"""SSD store layouts side by side: one file per chunk (what PCR uses) against a slab.

Both are crash-consistent in the same sense (a chunk is readable only once complete and
durable):

* ``file-per-chunk`` is :class:`~pcr_sglang.tiers.ssd_store.ChunkFileStore` itself:
  write a temporary file, fsync, rename, fsync the directory; read = open + one read
  (checksum verified);
* ``slab`` is the alternative design: fixed-size records in one preallocated file,
  ``pwrite`` at the record's offset + fsync, then an index entry appended + fsync
  (the publish step); read = one ``pread`` at the offset (same checksum work).

Prints MiB/s and microseconds per chunk for writes and reads, for chunk sizes around
those PCR produces (the bench model's chunks and a Llama-3-8B chunk), on the disk that
holds ``--dir``. Reads after writing hit the page cache unless ``--drop-caches``
(root only) empties it first.

Usage: python bench/ssd_store_bench.py [--dir /path/on/ssd] [--chunks 64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import xxhash

from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_sglang.transfer.layout import HostChunkLayout

# (label, layout of one chunk): SmolLM2-135M fp32 with 32-token chunks; Llama-3-8B bf16, 256.
SHAPES = [
    ("SmolLM2 fp32, 32 tokens", HostChunkLayout(1, 30, 32, 3 * 64 * 4)),
    ("Llama-3-8B bf16, 256 tokens", HostChunkLayout(1, 32, 256, 8 * 128 * 2)),
]


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class Slab:
    def __init__(self, path: Path, record_bytes: int, records: int):
        self.record_bytes = record_bytes
        self.fd = os.open(path / "slab", os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(self.fd, 0, record_bytes * records)
        self.index = open(path / "index", "ab")

    def write(self, i: int, payload: bytes) -> None:
        digest = xxhash.xxh3_128(payload).digest()
        os.pwrite(self.fd, payload, i * self.record_bytes)
        os.fsync(self.fd)
        self.index.write(i.to_bytes(8, "little") + digest)
        self.index.flush()
        os.fsync(self.index.fileno())

    def read(self, i: int, out: bytearray) -> None:
        n = os.preadv(self.fd, [out], i * self.record_bytes)
        assert n == len(out)
        xxhash.xxh3_128(out).digest()


def timed(fn, count: int) -> list[float]:
    samples = []
    for i in range(count):
        start = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - start)
    return samples


def run_shape(label: str, layout: HostChunkLayout, root: Path, chunks: int, cold: bool) -> None:
    payload = os.urandom(layout.slot_bytes)
    out = bytearray(layout.slot_bytes)
    mib = layout.slot_bytes / 2**20
    print(f"\n{label}: {mib:.2f} MiB per chunk, {chunks} chunks")
    results = {}
    store = ChunkFileStore(root / "files", bytes(16), layout, "bench", capacity_bytes=1 << 40,
                           low_watermark_bytes=0)
    keys = [i.to_bytes(16, "little") for i in range(chunks)]
    w = timed(lambda i: store.write(keys[i], bytes(16), 1, layout.chunk_size, payload), chunks)
    if cold:
        drop_caches()
    r = timed(lambda i: store.read_into(keys[i], out), chunks)
    results["file-per-chunk"] = (w, r)
    slab_dir = root / "slab"
    slab_dir.mkdir()
    slab = Slab(slab_dir, layout.slot_bytes, chunks)
    w = timed(lambda i: slab.write(i, payload), chunks)
    if cold:
        drop_caches()
    r = timed(lambda i: slab.read(i, out), chunks)
    results["slab"] = (w, r)
    for name, (w, r) in results.items():
        print(f"  {name:15} write {mib / statistics.median(w):8.1f} MiB/s ({statistics.median(w) * 1e6:8.0f} us/chunk)"
              f"   read {mib / statistics.median(r):8.1f} MiB/s ({statistics.median(r) * 1e6:8.0f} us/chunk)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--drop-caches", action="store_true", help="read cold (needs root)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="pcr-store-bench-", dir=args.dir))
    try:
        for index, (label, layout) in enumerate(SHAPES):
            root = base / str(index)
            root.mkdir()
            chunks = args.chunks if layout.slot_bytes < 8 << 20 else max(args.chunks // 8, 4)
            run_shape(label, layout, root, chunks, args.drop_caches)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
