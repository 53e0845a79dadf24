"""The cache namespace follows the weights when SGLang changes them in place.

SGLang's ``/update_weights_from_disk``, ``_from_tensor``, ``_from_distributed`` and
``_from_ipc`` load new weights into a running server (RL rollout servers do it every
step) and then flush the tree cache. A PCR namespace fixed at startup would keep every
chunk key, so the SSD records and the fleet's remote objects computed with the old
weights would be served after the update. Instead every update call moves the server to
a new namespace:

* a disk update to the new checkpoint's fingerprint (the same one a fresh server on that
  checkpoint has, so a rollback to weights served before finds their records again);
* an in-memory update (tensor, distributed, IPC, or a ``begin_weight_update`` session whose
  weights were written into device memory directly: every session end moves too) to a
  fingerprint made of a nonce the TP ranks agree on: nothing can ever be shared with it,
  its SSD directory is purged when the server leaves it, and nothing is written through to
  the remote tier under it (``remote_follow``);
* the opening of a session (``begin_weight_update``), a ``check_weights`` that resets the
  tensors, and a ``resume_memory_occupation`` of weights kept without a CPU backup, to a
  nonce namespace too, before SGLang's call: requests served while weights are being
  written (an in-flight update without ``pause_generation``) compute KV that must not be
  kept under the checkpoint's namespace, whose SSD directory is kept for a rollback and
  whose remote objects the fleet reads;
* a disk update to a path that is not a local file or folder (a hub id SGLang downloads
  during the call) to a nonce namespace as well, never to one made of the name alone (two
  revisions under one name would share it).

``WRAPPED_METHODS`` are hooked by the plugin; every other public method of SGLang's
``SchedulerWeightUpdaterManager`` is in ``WEIGHTS_UNCHANGED`` with the reason it changes no
served weight (a test holds the two lists against SGLang's class).

The new chunk keys apply as soon as the update call starts (nothing derived after it
matches anything derived before); the tiers move at the cache's reset, which SGLang's
flush after the update runs (``factory.move_namespace``). An update that fails, or whose
outcome is unknown, moves to a nonce namespace too: the weights may be partly new. An
update with ``flush_cache: false`` keeps the old weights' KV on the device, as SGLang's
own radix cache does, and none of what is cached matches a new request's keys; a request
already running across such an update inserts nothing when it finishes (its KV is partly
the old weights'): it was admitted under an older generation of keys
(``SchedulerSide.computed_before_an_update``).
A flushing update (the default) needs an idle server, where that cannot happen. The SSD
tier moves at the next ``/flush_cache``.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from pcr_sglang.core.keys import CacheNamespace
from pcr_sglang.reuse.setup import recheck_calibration
from pcr_sglang.sglang_adapter.fingerprint import WeightsNotLocal, in_memory_update_fingerprint, model_fingerprint
from pcr_sglang.sglang_adapter.remote_follow import leave_for_pending
from pcr_sglang.sglang_adapter.tp_group import TpGroup, min_max

logger = logging.getLogger(__name__)

# SGLang's SchedulerWeightUpdaterManager methods that change the served weights.
UPDATE_METHODS = (
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "update_weights_from_ipc",
)
# These two run only inside a begin_weight_update()/end_weight_update() session: outside
# one SGLang refuses them before touching any weight.
SESSION_METHODS = ("update_weights_from_tensor", "update_weights_from_distributed")
SESSION_BEGIN = "begin_weight_update"
SESSION_END = "end_weight_update"
CHECK_WEIGHTS = "check_weights"  # its action "reset_tensors" overwrites every tensor
MEMORY_RESUME = "resume_memory_occupation"  # weights released without a CPU backup come back unwritten
# mutant: weight-update-session-begin-not-hooked
WRAPPED_METHODS = (*UPDATE_METHODS, SESSION_BEGIN, SESSION_END, CHECK_WEIGHTS, MEMORY_RESUME)
# The manager's other public methods, and why none changes the served weights.
WEIGHTS_UNCHANGED = {
    "flush_cache_after_weight_update": "the flush inside the update calls above (wrapped), after their load",
    "record_weight_version_after_update": "records the version label an update call passed",
    "init_weights_update_group": "creates the process group a later update_weights_from_distributed reads from",
    "destroy_weights_update_group": "destroys that process group",
    "get_weights_by_name": "reads a parameter",
    "release_memory_occupation": "frees the memory (the server is idle and serves nothing until the resume, "
    "which is wrapped)",
    "save_remote_model": "writes the weights out",
    "save_sharded_model": "writes the weights out",
}


@dataclass(frozen=True)
class WeightsIdentity:
    """What a checkpoint's fingerprint is computed from, besides its files (kept from the
    server's startup: a disk update keeps the model's config)."""

    model_config: Any
    model_path: str
    revision: Optional[str] = None
    download_dir: Optional[str] = None
    adapters: str = ""

    def of_checkpoint(self, path: str) -> str:
        """The fingerprint of the checkpoint at ``path``. Raises :class:`WeightsNotLocal`
        for a path that is not a local file or folder: SGLang downloads a hub id during the
        update call (into its default cache, and perhaps a newer revision than any snapshot
        here), so no fingerprint taken before the call can name what it loads, and one made
        of the name alone would be shared by every revision under that name."""
        # mutant: weight-update-hub-id-gets-a-name-only-namespace
        if not Path(path).exists():
            raise WeightsNotLocal(f"{path} is not a local file or folder")
        return model_fingerprint(
            self.model_config,
            self.model_path,
            self.revision,
            self.download_dir,
            weights_path=path,
            adapters=self.adapters,
            require_files=True,
        )


def _agreed_nonce(tp: Optional[TpGroup]) -> int:
    nonce = secrets.randbits(62)
    return tp.reduce_min([nonce])[0] if tp is not None else nonce


def _agreed(tp: Optional[TpGroup], fingerprint: str) -> bool:
    """Whether every TP rank computed this fingerprint (each reads the files itself)."""
    if tp is None:
        return True
    low, high = min_max(tp, int(fingerprint[:14], 16))  # a hex digest's first 56 bits
    return low == high


def in_memory_namespace(cache: Any) -> CacheNamespace:
    """A namespace no server, restart or other update will ever have."""
    current: CacheNamespace = cache.pending_namespace or cache.namespace
    nonce = _agreed_nonce(cache.scheduler.tp)
    return replace(current, model_fingerprint=in_memory_update_fingerprint(current.model_fingerprint, nonce))


UNREADABLE = "0" * 32  # the fingerprint of a checkpoint that could not be read (never used as one)


def next_namespace(cache: Any, method: str, recv_req: Any) -> CacheNamespace:
    """The namespace of the weights ``recv_req`` loads (collective under TP: every rank
    takes part in the same collectives whatever it found).

    A disk update gets the new checkpoint's fingerprint, unless that equals the current
    one: the fingerprint samples each tensor (``fingerprint.py``), so an update that edits
    a few rows in place could not be told from a reload of the same files, and reusing the
    current namespace would serve the old weights' KV; such an update gets a namespace of
    its own, like one whose files cannot be read (SGLang then reports the load's error)."""
    identity: Optional[WeightsIdentity] = getattr(cache, "weights_identity", None)
    path = getattr(recv_req, "model_path", None) if method == "update_weights_from_disk" else None
    if path and identity is not None:
        try:
            fingerprint = identity.of_checkpoint(str(path))
        except WeightsNotLocal as e:
            logger.warning(
                "PCR: cannot fingerprint the weights of %s before SGLang loads them (%s); their KV gets "
                "a namespace of its own (pass a local folder to keep it across restarts and rollbacks)",
                path,
                e,
            )
            fingerprint = UNREADABLE
        except Exception as e:  # a path SGLang will refuse too: never an error in the scheduler loop
            logger.warning("PCR: cannot fingerprint %s (%s); its KV gets a namespace of its own", path, e)
            fingerprint = UNREADABLE
        agreed = _agreed(cache.scheduler.tp, fingerprint)
        current = (cache.pending_namespace or cache.namespace).model_fingerprint
        if agreed and fingerprint not in (UNREADABLE, current):
            namespace: CacheNamespace = cache.namespace
            return replace(namespace, model_fingerprint=fingerprint)
        if not agreed:
            logger.warning("PCR: the TP ranks fingerprint %s differently; its KV gets a namespace of its own", path)
    return in_memory_namespace(cache)


def around_weight_update(
    method: str, original: Callable[..., Any], manager: Any, recv_req: Any, *args: Any, **kwargs: Any
) -> Any:
    """SGLang's update call, with the PCR cache's namespace moved to the new weights'."""
    cache: Any = getattr(getattr(manager, "scheduler", None), "tree_cache", None)  # SGLang ships no types
    # mutant: weight-update-hook-does-nothing
    if getattr(cache, "namespace_mover", None) is None or getattr(cache, "namespace", None) is None:
        return original(manager, recv_req, *args, **kwargs)
    if method in SESSION_METHODS and getattr(manager, "_session", True) is None:
        return original(manager, recv_req, *args, **kwargs)  # refused by SGLang: no weight changes
    if method == SESSION_END:
        return _around_session_end(cache, original, manager, recv_req, *args, **kwargs)
    if method in (SESSION_BEGIN, CHECK_WEIGHTS, MEMORY_RESUME):
        if _writes_weights(method, manager, recv_req):
            # Before the call (SGLang's session begin restores packed weights; a reset
            # overwrites them), agreed on every rank (all run the same call, and the
            # session state SGLang checks is replicated on every rank).
            begin(cache, in_memory_namespace(cache))
            logger.info(
                "PCR: %s: chunk keys follow a namespace of their own from now on; the SSD tier moves "
                "to it at the next /flush_cache",
                method,
            )
        return original(manager, recv_req, *args, **kwargs)
    target = next_namespace(cache, method, recv_req)
    # Agreed before the call: what follows it must not be a collective, since whether an
    # update failed need not be the same on every rank.
    fallback = in_memory_namespace(cache)
    begin(cache, target)
    try:
        out = original(manager, recv_req, *args, **kwargs)
    except BaseException:
        unknown_weights(cache, fallback)
        raise
    if cache.pending_namespace is not None:  # no flush ran inside the call
        if not getattr(out, "success", False):
            unknown_weights(cache, fallback)
        else:
            logger.warning(
                "PCR: %s without a cache flush: new requests' chunk keys follow the new weights now; "
                "the SSD tier moves to them at the next /flush_cache",
                method,
            )
    return out


def _around_session_end(
    cache: Any, original: Callable[..., Any], manager: Any, recv_req: Any, *args: Any, **kwargs: Any
) -> Any:
    """``end_weight_update``: a session may have changed the weights without any of the
    update calls (written into device memory directly, over P2P or RDMA, between
    ``begin_weight_update`` and this). So every session that ends moves the cache to a
    namespace of its own; the tiers follow at the next flush. (Agreed before the call, which
    ends in a barrier of SGLang's on every rank.)"""
    session = getattr(manager, "_session", None)
    namespace = in_memory_namespace(cache) if session is not None else None
    out = original(manager, recv_req, *args, **kwargs)
    # mutant: weight-update-session-end-keeps-the-namespace
    if namespace is not None:
        begin(cache, namespace)
        logger.info(
            "PCR: a weight-update session ended; chunk keys now follow its weights, and the SSD tier "
            "moves to them at the next /flush_cache"
        )
    return out


def _writes_weights(method: str, manager: Any, recv_req: Any) -> bool:
    """Whether this call of ``method`` may leave other weights served than before it."""
    if method == SESSION_BEGIN:
        # mutant: weight-update-session-begin-keeps-the-namespace
        # mutant: weight-update-session-begin-keeps-the-namespace-on-a-server
        return getattr(manager, "_session", None) is None  # SGLang refuses a second open session
    if method == CHECK_WEIGHTS:
        return getattr(recv_req, "action", None) == "reset_tensors"
    from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS

    tags = getattr(recv_req, "tags", None)
    server_args = getattr(getattr(manager, "scheduler", None), "server_args", None)
    return (not tags or GPU_MEMORY_TYPE_WEIGHTS in tags) and not getattr(
        server_args, "enable_weights_cpu_backup", False
    )


def begin(cache: Any, namespace: CacheNamespace) -> None:
    """From now on no key matches one derived under the old weights; the tiers follow at
    the next reset."""
    cache.pending_namespace = namespace
    cache.scheduler.rekey(namespace.chain_digest())
    # mutant: remote-write-through-while-a-nonce-namespace-is-pending
    leave_for_pending(cache, namespace)  # an in-memory update's keys: nothing more to the remote tier
    # A document-reuse calibration holds for the weights it was measured on only.
    if cache.scheduler.doc_status is not None:
        recheck_calibration(cache.scheduler.doc_status, namespace.model_fingerprint)


def unknown_weights(cache: Any, namespace: CacheNamespace) -> None:
    """The update failed without a flush: the served weights may be partly new, so they
    get ``namespace``, one of their own."""
    begin(cache, namespace)
    logger.warning(
        "PCR: a weight update did not complete; the cache moves to a namespace of its own "
        "(nothing computed before or after it is shared with any other weights)"
    )
