"""The remote thread's replies never block the I/O process's main loop: when the scheduler
takes no replies (ZMQ's high-water mark reached), the thread used to block in its send
while holding the lock the main loop takes to hand over every probe, read and write, and
to run the watchdog; the whole I/O process stopped with it, local SSD work included. Real
ZMQ sockets (inproc, where the high-water mark is exact) and a real store client; every
call fails at once (``RemoteFaults.fail``), so no Mooncake is needed."""

from __future__ import annotations

import json
import threading
import time

import zmq

from pcr_sglang.core.orders import IoOutcome, ReadChunk
from pcr_sglang.io.protocol import Done, reply_decoder
from pcr_sglang.io.remote_calls import RemoteFaults
from pcr_sglang.io.remote_thread import RemoteThread
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.records import RecordCodec
from pcr_sglang.tiers.remote_store import RemoteChunkStore, RemoteConfig, load_fleet_key
from pcr_tools.mooncake_services import keygen

LAYOUT = HostChunkLayout(num_slots=4, num_layers=2, chunk_size=4, row_bytes=32)


def returns_within(fn, seconds: float) -> bool:
    """Whether ``fn()`` returns within ``seconds`` (run on a helper thread: a blocked call
    must fail the test, not hang it)."""
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done.wait(seconds)


def test_a_scheduler_that_takes_no_replies_never_blocks_the_main_loop(tmp_path):
    key_file = keygen(tmp_path / "fleet.key")
    config = RemoteConfig.parse(json.dumps({"master_server_address": "127.0.0.1:1", "key_file": str(key_file)}))
    store = RemoteChunkStore(config, RecordCodec(load_fleet_key(str(key_file)), bytes(16), LAYOUT, "torch.float32"))
    ctx = zmq.Context()
    ctx.setsockopt(zmq.SNDHWM, 1)  # the thread's socket: one reply queued, then sends would block
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.bind("inproc://replies")
    slots = [bytearray(LAYOUT.slot_bytes) for _ in range(LAYOUT.num_slots)]
    thread = RemoteThread(
        store, ctx, "inproc://replies", lambda i: memoryview(slots[i]), RemoteFaults(fail=True), new_store=lambda: store
    )
    thread.start()
    orders = 20
    for seq in range(orders):
        thread.read(ReadChunk(seq, seq.to_bytes(16, "little"), seq % LAYOUT.num_slots))
    time.sleep(0.5)  # the thread answers what it can, then waits for the scheduler
    for seq in range(orders, orders + 5):  # the main loop still hands work over, and the watchdog runs
        assert returns_within(lambda: thread.read(ReadChunk(seq, bytes(16), 0)), 2.0), "the main loop blocked"
    assert returns_within(thread.overdue_s, 2.0) and returns_within(thread.has_room, 2.0)
    done: set[int] = set()
    deadline = time.monotonic() + 30
    while len(done) < orders + 5:  # the scheduler reads again: every order is answered, once
        assert time.monotonic() < deadline, f"answered {sorted(done)}"
        if pull.poll(100):
            reply = reply_decoder.decode(pull.recv())
            if isinstance(reply, Done):
                assert reply.seq not in done and reply.outcome == IoOutcome.BAD
                done.add(reply.seq)
    thread.replace("the test is over")  # the thread stops at its next reply or wait; the successor never starts
    thread._thread.join(timeout=10)
    # Every socket closed here: a context left to the garbage collector with a socket still
    # open (the successor's, never started) blocks the next collection in this worker
    # forever (``Context.__del__`` terminates it).
    ctx.destroy(linger=0)
