"""The remote thread's work on the store: what each order does (a probe, a read, a
write-through record), what it counts, and the test faults that slow or fail its calls.

Each call goes through the thread's circuit breaker (``_call``) and each answer through
its ``_answer`` (counts, the host-slot copy and the reply, dropped once the thread has been
replaced), so what is here decides only what to ask and what the answer says. Kept apart
from :mod:`.remote_thread`, which owns the queues, the breaker, the watchdog and the
replies; a Protocol, so this module never imports the thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, TypeVar

from pcr_sglang.core.orders import IoOutcome, ProbeRemote, ReadChunk
from pcr_sglang.io.protocol import SOURCE_REMOTE, Done, Probed, Reply
from pcr_sglang.tiers.records import ChunkRecord
from pcr_sglang.tiers.remote_store import ReadResult, RemoteChunkStore, RemoteError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class RemoteCounters:
    probes: int = 0
    probed_chunks: int = 0
    found_chunks: int = 0
    reads: int = 0
    read_ok: int = 0
    read_missing: int = 0
    read_corrupt: int = 0
    read_failed: int = 0  # the store could not be asked (down, or the call failed)
    read_bytes: int = 0
    read_seconds: float = 0.0
    writes: int = 0  # records sent
    writes_present: int = 0  # not sent: the store held the key already
    writes_dropped: int = 0  # not sent: the queue was full
    writes_failed: int = 0  # not sent: the call failed, or the tier was down
    write_bytes: int = 0
    errors: int = 0  # calls that failed (each one trips the breaker)
    outages: int = 0  # times the tier went down
    calls_timed_out: int = 0  # calls given up on past their deadline (each restarts the client)


@dataclass(frozen=True)
class RemoteFaults:
    """Test knob (``PCR_IO_TEST_FAULTS``: ``remote_delay_s``, ``remote_read_delay_s``,
    ``remote_fail``): every remote call (or every read sent to the store) waits, or every
    call fails as an unreachable master would. A read the breaker refuses is not sent, so
    it fails at once, as it would against a store that hangs."""

    delay_s: float = 0.0
    fail: bool = False
    read_delay_s: float = 0.0


class CallingThread(Protocol):
    """What the orders use of a :class:`~pcr_sglang.io.remote_thread.RemoteThread`."""

    store: RemoteChunkStore
    counters: RemoteCounters
    faults: Optional[RemoteFaults]
    on_read: Optional[Callable[[bytes, ChunkRecord, bytes], None]]
    _scratch: bytearray

    def _call(self, fn: Callable[[], _T]) -> _T: ...

    def _answer(
        self,
        reply: Reply,
        final: bool = False,
        into_slot: Optional[int] = None,
        counts: Optional[dict[str, float]] = None,
    ) -> bool: ...


def probe(thread: CallingThread, order: ProbeRemote) -> None:
    """A probe: which of the order's chains' chunks the store holds (none while it is down)."""
    start = time.perf_counter()
    thread.counters.probes += 1
    thread.counters.probed_chunks += sum(len(c) for c in order.chains)
    try:
        present = thread._call(lambda: thread.store.probe(order.chains))
        error = ""
    except RemoteError as e:
        present, error = [0] * len(order.chains), str(e)
    thread._answer(
        Probed(order.seq, present, error, time.perf_counter() - start),
        final=True,
        counts={"found_chunks": sum(present)},
    )


def read(thread: CallingThread, order: ReadChunk) -> None:
    """A read the local SSD missed: into the thread's buffer, copied into the host slot
    as it is answered; a missing or corrupt chunk, or a down tier, is answered BAD."""
    start = time.perf_counter()
    thread.counters.reads += 1
    delay_s = thread.faults.read_delay_s if thread.faults is not None else 0.0

    def read_into_scratch() -> ReadResult:
        time.sleep(delay_s)  # the test fault: in the call, so a read the breaker refuses is not slowed
        # Into the thread's own buffer: copied into the host slot only by _answer.
        return thread.store.read_into(order.key, memoryview(thread._scratch))

    try:
        result = thread._call(read_into_scratch)
    except RemoteError as e:
        thread._answer(
            Done(
                order.seq,
                IoOutcome.BAD,
                f"not on the local SSD; remote tier: {e}",
                seconds=time.perf_counter() - start,
                source=SOURCE_REMOTE,
            ),
            final=True,
            counts={"read_failed": 1},
        )
        return
    seconds = time.perf_counter() - start
    if result is ReadResult.OK:
        record = thread.store.last_record
        counts = {"read_ok": 1, "read_bytes": thread.store.codec.record_bytes, "read_seconds": seconds}
        if not thread._answer(
            Done(order.seq, IoOutcome.OK, seconds=seconds, source=SOURCE_REMOTE),
            final=True,
            into_slot=order.host_slot,
            counts=counts,
        ):
            return  # replaced meanwhile: its order was answered as failed, the slot is not ours
        on_read = thread.on_read
        if on_read is not None and record is not None:
            on_read(order.key, record, bytes(thread._scratch))
        return
    if result is ReadResult.CORRUPT:
        logger.warning("PCR remote tier: chunk %s failed verification; removed, it will be recomputed", order.key.hex())
    thread._answer(
        Done(order.seq, IoOutcome.BAD, f"remote tier: {result.value}", seconds=seconds, source=SOURCE_REMOTE),
        final=True,
        counts={"read_corrupt" if result is ReadResult.CORRUPT else "read_missing": 1},
    )


def write(thread: CallingThread, key: bytes, record: bytes | bytearray) -> None:
    """A write-through record, sent unless the store holds the key already."""
    try:
        sent = thread._call(lambda: thread.store.write(key, record))
    except RemoteError:
        thread.counters.writes_failed += 1
        return
    if sent:
        thread.counters.writes += 1
        thread.counters.write_bytes += len(record)
    else:
        thread.counters.writes_present += 1
