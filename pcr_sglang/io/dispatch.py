"""Which of the I/O process's queued orders runs next, and where.

The main loop of :class:`pcr_sglang.io.process.IoProcess` keeps three queues: urgent reads
(a request waits for them), prefetch reads and deletes (in the order given, since a delete
must not overtake a read of its chunk ordered before it), and writes. These functions hand
reads to free reader threads, urgent ones first; run a delete in its place in the queue,
but only once no read of its chunk runs; let a write run only when no read waits and none
of its chunk runs; and expedite or cancel a queued read. They keep no state of their own:
the queues are the loop's.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

from pcr_sglang.core.orders import DeleteChunk, ReadChunk, Reorder, WriteChunk
from pcr_sglang.io.readers import ReaderThreads

# Deletes run on the main thread and are not acknowledged; at most this many run before
# the loop reads new orders again (a reset or a large eviction orders thousands).
DELETES_PER_TURN = 32

ReadQueue = collections.deque[ReadChunk | DeleteChunk]  # prefetch reads and deletes, in order


def dispatch_reads(
    readers: ReaderThreads,
    urgent: collections.deque[ReadChunk],
    reads: ReadQueue,
    execute: Callable[[DeleteChunk], object],
) -> None:
    """Hand queued reads to free reader threads, urgent ones first; a delete reached in
    the prefetch queue runs here (``execute``, on the main thread), in its place."""
    while urgent and readers.free:
        readers.submit(urgent.popleft())
    deletes = 0
    while reads and deletes < DELETES_PER_TURN:
        order = reads[0]
        if isinstance(order, ReadChunk):
            if not readers.free:
                return
            reads.popleft()
            readers.submit(order)
        elif readers.reading(order.key):
            return  # after the read of that key ordered before it
        else:
            reads.popleft()
            execute(order)  # DeleteChunk: not acknowledged
            deletes += 1


def write_ready(
    readers: ReaderThreads,
    urgent: collections.deque[ReadChunk],
    reads: ReadQueue,
    writes: collections.deque[WriteChunk],
) -> bool:
    """A write may run: no read waits, and none of its chunk runs."""
    return bool(writes) and not urgent and not reads and not readers.reading(writes[0].key)


def ready(
    readers: ReaderThreads,
    urgent: collections.deque[ReadChunk],
    reads: ReadQueue,
    writes: collections.deque[WriteChunk],
) -> bool:
    """Work the main thread can do without waiting for a reader thread: a write, or more
    deletes of a long run of them."""
    if reads and isinstance(reads[0], DeleteChunk):
        return not readers.reading(reads[0].key)
    return write_ready(readers, urgent, reads, writes)


def reorder(request: Reorder, urgent: collections.deque[ReadChunk], reads: ReadQueue) -> Optional[ReadChunk]:
    """Expedite a queued prefetch read, or cancel a queued read (a read that a request
    waited for is cancelled too once that request has gone). Returns the read cancelled,
    for the caller to answer, or None."""
    for pending in (reads, urgent) if request.cancel else (reads,):
        for order in pending:
            if isinstance(order, ReadChunk) and order.seq == request.target:
                pending.remove(order)
                if request.cancel:
                    return order
                urgent.append(order)
                return None
    return None
