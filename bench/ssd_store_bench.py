"""SSD store on one disk: durability modes, record MACs, and layouts, against ``dd``.

* ``file-per-chunk`` is :class:`~pcr_sglang.tiers.ssd_store.ChunkFileStore` itself, in
  each ``--pcr-ssd-durability`` mode: ``record`` (temp file, fsync, rename, directory
  fsync per record), ``batch`` (16 records written, then their fsyncs, renames and one
  fsync per directory) and ``none`` (no fsync); read = open + one read, MAC verified;
* ``slab`` is the alternative design: fixed-size records in one preallocated file,
  ``pwrite`` at the record's offset + fsync, then an index entry appended + fsync
  (the publish step); read = one ``pread`` at the offset (same checksum work);
* ``dd oflag=direct`` writes the same bytes in chunk-sized blocks with direct I/O and a
  final fsync: what the disk itself sustains, the yardstick for the store's writes;
* the hashes a record could be authenticated with: XXH3-128 (not a MAC), keyed BLAKE2b,
  HMAC-SHA256 and keyed BLAKE3 over the payload, and a keyed BLAKE2b of the header only.

Prints MiB/s for writes and reads (total bytes over total time), for chunk sizes around
those PCR produces (the bench model's chunks and a Llama-3-8B chunk), on the disk that
holds ``--dir``. Reads after writing hit the page cache unless ``--drop-caches``
(root only) empties it first.

Usage: python bench/ssd_store_bench.py [--dir /path/on/ssd] [--chunks 64]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import blake3
import xxhash

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.ssd_store import ChunkFileStore

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


def timed(fn, count: int) -> float:
    """Seconds for ``fn(0) .. fn(count - 1)``."""
    start = time.perf_counter()
    for i in range(count):
        fn(i)
    return time.perf_counter() - start


def dd_direct(path: Path, block_bytes: int, count: int) -> float | None:
    """Seconds for ``dd`` to write ``count`` blocks with O_DIRECT and fsync; None where
    the file system refuses direct I/O (tmpfs, some overlays)."""
    start = time.perf_counter()
    done = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", f"bs={block_bytes}", f"count={count}", "oflag=direct", "conv=fsync"],
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - start
    path.unlink(missing_ok=True)
    return elapsed if done.returncode == 0 else None


def hash_rates(payload: bytes, repeat: int = 20) -> dict[str, float]:
    """MiB/s of each way a record could be checked or authenticated."""
    key = os.urandom(32)
    header = os.urandom(136)
    ways = {
        "XXH3-128 (payload; not a MAC)": lambda: xxhash.xxh3_128(payload).digest(),
        "keyed BLAKE2b (payload)": lambda: hashlib.blake2b(payload, key=key, digest_size=16).digest(),
        "HMAC-SHA256 (payload)": lambda: hmac.digest(key, payload, "sha256"),
        "keyed BLAKE3 (payload)": lambda: blake3.blake3(payload, key=key).digest(16),
        "keyed BLAKE2b (header only)": lambda: hashlib.blake2b(header, key=key, digest_size=16).digest(),
    }
    mib = len(payload) / 2**20
    return {name: mib * repeat / timed(lambda _: fn(), repeat) for name, fn in ways.items()}


def run_shape(label: str, layout: HostChunkLayout, root: Path, chunks: int, cold: bool) -> None:
    payload = os.urandom(layout.slot_bytes)
    out = bytearray(layout.slot_bytes)
    mib = layout.slot_bytes / 2**20
    total = mib * chunks
    print(f"\n{label}: {mib:.2f} MiB per chunk, {chunks} chunks")
    keys = [i.to_bytes(16, "little") for i in range(chunks)]
    for durability in ("record", "batch", "none"):
        store = ChunkFileStore(
            root / f"files-{durability}",
            bytes(16),
            layout,
            "bench",
            capacity_bytes=None,
            low_watermark_bytes=0,
            durability=durability,
        )

        def write(i: int) -> None:
            store.write(keys[i], bytes(16), 1, layout.chunk_size, payload)
            if durability == "batch" and (store.pending_writes >= 16 or i == chunks - 1):
                store.flush()

        w = timed(write, chunks)
        if cold:
            drop_caches()
        r = timed(lambda i: store.read_into(keys[i], out), chunks)
        assert store.stats.read_chunks == chunks
        store.close()
        print(
            f"  file-per-chunk, durability {durability:6}  write {total / w:8.1f} MiB/s   read {total / r:8.1f} MiB/s"
        )
    slab_dir = root / "slab"
    slab_dir.mkdir()
    slab = Slab(slab_dir, layout.slot_bytes, chunks)
    w = timed(lambda i: slab.write(i, payload), chunks)
    if cold:
        drop_caches()
    r = timed(lambda i: slab.read(i, out), chunks)
    print(f"  slab (pwrite+fsync, index+fsync)  write {total / w:8.1f} MiB/s   read {total / r:8.1f} MiB/s")
    d = dd_direct(root / "dd.bin", layout.slot_bytes, chunks)
    print("  dd oflag=direct conv=fsync        write " + (f"{total / d:8.1f} MiB/s" if d else "  (no direct I/O here)"))
    for name, rate in hash_rates(payload).items():
        print(f"  hash {name:32} {rate:9.1f} MiB/s on one core")


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
