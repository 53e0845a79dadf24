"""The remote tier's record path on one core: today's sealed records against the MAC-ed
plaintext records the tier stored before, side by side.

* ``mac`` (plaintext): the SSD record the remote tier used to store; encode = header with
  keyed BLAKE3 MACs of header and payload, concatenated with the payload; open = header
  MAC, payload MAC, copy of the payload into the host slot;
* ``aead`` (sealed, :mod:`pcr_sglang.tiers.sealed_records`): encode = AES-256-GCM over the
  inner header and payload under a random nonce, the keyed object name as associated data;
  open = decrypt and verify into the private buffer, copy of the payload into the slot;
* the two AEADs the ``cryptography`` library offers, over the payload alone (no record, no
  copy): AES-256-GCM and ChaCha20-Poly1305, what chose the first.

Prints MB/s of payload (1 MB = 10^6 bytes), the median of ``--repeats`` passes over
about ``--mib`` MiB of records each (the paths' passes interleaved), and the median over
passes of the sealed path's speed as a share of the plaintext one,
for chunk sizes around those PCR produces. Mooncake itself is not involved: this is the
CPU work each put and get adds on the remote thread (or, for encode, the I/O process's
main loop).

Usage: python bench/remote_record_bench.py [--mib 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import HEADER_BYTES, RecordCodec
from pcr_sglang.tiers.sealed_records import SealedRecordCodec

# (label, layout of one chunk): SmolLM2-135M fp32 with 32-token chunks; Llama-3-8B bf16
# with 64- and 256-token chunks.
SHAPES = [
    ("SmolLM2 fp32, 32 tokens", HostChunkLayout(1, 30, 32, 3 * 64 * 4)),
    ("Llama-3-8B bf16, 64 tokens", HostChunkLayout(1, 32, 64, 8 * 128 * 2)),
    ("Llama-3-8B bf16, 256 tokens", HostChunkLayout(1, 32, 256, 8 * 128 * 2)),
]
NAMESPACE = bytes(range(16))


def chunk_key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def mac_path(codec: RecordCodec, payloads: list[bytes]) -> tuple[Callable[[int], None], Callable[[int], None]]:
    """(encode, open) of the plaintext record for payload ``i``."""
    records = [codec.header(chunk_key(i), bytes(16), 1, 32, p) + p for i, p in enumerate(payloads)]
    out = memoryview(bytearray(codec.layout.slot_bytes))

    def encode(i: int) -> None:
        payload = memoryview(payloads[i])
        codec.header(chunk_key(i), bytes(16), 1, 32, payload) + bytes(payload)

    def open_(i: int) -> None:
        raw = memoryview(records[i])
        record = codec.parse_header(raw[:HEADER_BYTES].tobytes())
        assert record is not None and codec.payload_ok(record, raw[HEADER_BYTES:])
        out[:] = raw[HEADER_BYTES:]

    return encode, open_


def sealed_path(codec: RecordCodec, payloads: list[bytes]) -> tuple[Callable[[int], None], Callable[[int], None]]:
    sealed = SealedRecordCodec(codec)
    records = [sealed.seal(chunk_key(i), bytes(16), 1, 32, p) for i, p in enumerate(payloads)]
    out = memoryview(bytearray(codec.layout.slot_bytes))

    def encode(i: int) -> None:
        sealed.seal(chunk_key(i), bytes(16), 1, 32, payloads[i])

    def open_(i: int) -> None:
        assert sealed.open_into(chunk_key(i), memoryview(records[i]), out) is not None

    return encode, open_


def cipher_path(cipher, payloads: list[bytes]) -> tuple[Callable[[int], None], Callable[[int], None]]:
    nonce = os.urandom(12)
    sealed = [cipher.encrypt(nonce, p, b"") for p in payloads]
    return (lambda i: cipher.encrypt(nonce, payloads[i], b"")), (lambda i: cipher.decrypt(nonce, sealed[i], b""))


def rate(fn: Callable[[int], None], count: int, nbytes: int) -> float:
    """MB/s of ``nbytes`` per call over one pass ``fn(0) .. fn(count - 1)``."""
    start = time.perf_counter()
    for i in range(count):
        fn(i)
    return count * nbytes / (time.perf_counter() - start) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of records per pass, at least 2 records (default 64)")
    parser.add_argument("--repeats", type=int, default=7, help="passes; the median is printed (default 7)")
    args = parser.parse_args()
    key = os.urandom(32)
    print(f"{'chunk':<40} {'path':<24} {'encode MB/s':>12} {'open MB/s':>10}")
    for label, layout in SHAPES:
        codec = RecordCodec(key, NAMESPACE, layout, "torch.bfloat16")
        payloads = [os.urandom(layout.slot_bytes) for _ in range(max(2, (args.mib << 20) // layout.slot_bytes))]
        paths = {
            "mac (plaintext)": mac_path(codec, payloads),
            "aead (sealed)": sealed_path(codec, payloads),
            "AES-256-GCM alone": cipher_path(AESGCM(key), payloads),
            "ChaCha20-Poly1305 alone": cipher_path(ChaCha20Poly1305(key), payloads),
        }
        # Passes interleaved (each repeat runs every path once): the machine's load drifts,
        # and a drift should not land on one path only.
        rates: dict[tuple[str, int], list[float]] = {(p, k): [] for p in paths for k in (0, 1)}
        for _ in range(args.repeats):
            for path, fns in paths.items():
                for k, fn in enumerate(fns):
                    rates[path, k].append(rate(fn, len(payloads), layout.slot_bytes))
        median = {pk: statistics.median(r) for pk, r in rates.items()}
        ratio = [
            statistics.median(a / b for a, b in zip(rates["aead (sealed)", k], rates["mac (plaintext)", k]))
            for k in (0, 1)
        ]
        name = f"{label} ({layout.slot_bytes / 2**20:.1f} MiB)"
        for path in paths:
            print(f"{name:<40} {path:<24} {median[path, 0]:>12.0f} {median[path, 1]:>10.0f}")
            name = ""
        print(f"{'':<40} {'aead / mac (per pass)':<24} {ratio[0]:>11.2f}x {ratio[1]:>9.2f}x")


if __name__ == "__main__":
    main()
