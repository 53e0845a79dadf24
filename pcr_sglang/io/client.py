"""The scheduler's end of the I/O process's two ZMQ IPC sockets: send orders, take replies.

The sockets live in a private runtime directory (0700) and are bound here, so a
restarted process reconnects to the same endpoints. Nothing here blocks: a send that
cannot be queued at once fails (the caller treats the order as cancelled), and replies
are taken only as far as they have arrived. Supervision (start, health, restart) is
:mod:`pcr_sglang.io.supervisor`'s job.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import zmq

from pcr_sglang.core.orders import Order
from pcr_sglang.io.protocol import Reply, order_encoder, reply_decoder

logger = logging.getLogger(__name__)


class IOChannel:
    def __init__(self) -> None:
        self.runtime_dir = tempfile.mkdtemp(prefix="pcr-io-")
        os.chmod(self.runtime_dir, 0o700)
        self.orders_endpoint = f"ipc://{self.runtime_dir}/orders"
        self.replies_endpoint = f"ipc://{self.runtime_dir}/replies"
        self._ctx = zmq.Context()
        self._orders = self._ctx.socket(zmq.PUSH)
        self._orders.setsockopt(zmq.LINGER, 0)
        self._orders.bind(self.orders_endpoint)
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        self._replies.bind(self.replies_endpoint)

    def send(self, order: Order) -> bool:
        """Queue ``order`` for the process; False when it cannot be queued now."""
        try:
            self._orders.send(order_encoder.encode(order), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def receive(self, timeout_ms: int = 0) -> list[Reply]:
        """Replies that have arrived (waiting up to ``timeout_ms`` for the first)."""
        if not self._replies.poll(timeout_ms):
            return []
        replies = []
        while True:
            try:
                replies.append(reply_decoder.decode(self._replies.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return replies

    def close(self) -> None:
        self._orders.close()
        self._replies.close()
        self._ctx.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
