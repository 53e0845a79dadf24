"""The remote tier follows the cache namespace: under an in-memory update's namespace
nothing is written through to it, probed or read from it.

An in-memory update's namespace (weights from tensors, a process group or IPC, a
``begin_weight_update`` session, a failed update: ``weight_updates``) is a nonce that no
other server, restart or update will ever have. Its SSD directory is purged when the
server leaves it; objects written through to the fleet's remote store under it could never
be read by anyone, and would only evict the fleet's useful objects (an RL rollout server
moves to a new one every step). So while such a namespace is current or pending (its keys
in use, the tiers moving to it at the next flush), the I/O process runs without the remote
tier and the scheduler probes nothing; the remote tier comes back when the namespace moves
to a checkpoint's (a disk update). The remote tier is refused under TP (``refusals``), so
none of this needs the ranks to agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from pcr_sglang.core.keys import CacheNamespace
from pcr_sglang.io.protocol import IoProcessConfig
from pcr_sglang.sglang_adapter.fingerprint import IN_MEMORY_UPDATE_TAG
from pcr_sglang.sglang_adapter.remote_probes import NoRemoteProbes, RemoteProbes

logger = logging.getLogger(__name__)


def shared(namespace: CacheNamespace) -> bool:
    """Whether another server or a restart can have ``namespace`` (a checkpoint's)."""
    return not namespace.model_fingerprint.startswith(IN_MEMORY_UPDATE_TAG)


@dataclass
class RemoteFollower:
    """What the remote tier was at startup, to put back under a checkpoint's namespace."""

    config_json: str  # the I/O process's remote_config (--pcr-remote-config as JSON)
    probes: RemoteProbes  # the scheduler's probes of it

    @classmethod
    def of(cls, scheduler: Any) -> Optional[RemoteFollower]:
        io = scheduler.io
        if io is None or not io.config.remote_config or not isinstance(scheduler.probes, RemoteProbes):
            return None
        return cls(io.config.remote_config, scheduler.probes)


def io_config_under(cache: Any, namespace: CacheNamespace, io_config: IoProcessConfig) -> IoProcessConfig:
    """``io_config`` with the remote tier ``namespace`` may use (none under an in-memory
    update's); the scheduler's probes are set to match."""
    follower: Optional[RemoteFollower] = getattr(cache, "remote_follower", None)
    if follower is None:
        return io_config
    # mutant: remote-write-through-under-an-in-memory-namespace
    on = shared(namespace)
    cache.scheduler.use_probes(follower.probes if on else NoRemoteProbes())
    return msgspec.structs.replace(io_config, remote_config=follower.config_json if on else "")


def leave_for_pending(cache: Any, namespace: CacheNamespace) -> None:
    """An update made ``namespace`` pending (its keys are in use now; the SSD tier moves at
    the next flush). If it is an in-memory update's, the I/O process stops writing through
    to the remote tier now, not at the flush: it is restarted on the same store without it
    (its orders in flight come back cancelled, as at any restart)."""
    io = getattr(cache.scheduler, "io", None)
    if (
        getattr(cache, "remote_follower", None) is None
        or shared(namespace)
        or io is None
        or not io.config.remote_config
    ):
        return
    if not io.restart(io_config_under(cache, namespace, io.config)):
        logger.warning("PCR I/O process did not restart without the remote tier; the SSD tier waits for it")
    logger.info(
        "PCR: the remote tier is off under an in-memory update's namespace (nothing of it can be shared); "
        "it comes back when the weights move to a checkpoint's"
    )
