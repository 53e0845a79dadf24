"""HostChunkPool: chunk slots in shared host memory, pinned on CUDA.

The pool is one POSIX shared-memory segment laid out as
:class:`~pcr_sglang.tiers.layout.HostChunkLayout` describes, so that a second process
(the I/O process that will read and write SSD chunks) can attach to it by name and move
bytes without copies through the scheduler. On a CUDA machine the segment is registered
with ``cudaHostRegister`` so copy kernels read it directly; on CPU it stays plain memory.
Its creator holds an ``flock`` on a lock file next to it (``/dev/shm/<name>.lock``) for
the pool's life: the lock, not a pid, tells a sweep whether the owner is alive, in any pid
namespace that shares ``/dev/shm`` (:mod:`pcr_sglang.tiers.shm_owner`).

This class is bytes only: which chunk a slot holds, and whether it is free, is the cache
state's (:mod:`pcr_sglang.core.host_slots`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Optional

import torch

from pcr_sglang.tiers.layout import HostChunkLayout

# The segment's owner lock and the sweep live in shm_owner; their names stay importable here.
from pcr_sglang.tiers.shm_owner import LOCK_SUFFIX as LOCK_SUFFIX
from pcr_sglang.tiers.shm_owner import SHM_DIR as SHM_DIR
from pcr_sglang.tiers.shm_owner import SHM_PREFIX as SHM_PREFIX
from pcr_sglang.tiers.shm_owner import new_segment_token
from pcr_sglang.tiers.shm_owner import release_owner_lock as release_owner_lock
from pcr_sglang.tiers.shm_owner import remove_stale_segments as remove_stale_segments
from pcr_sglang.tiers.shm_owner import take_owner_lock as take_owner_lock

logger = logging.getLogger(__name__)

# The largest single cudaHostRegister call, in GiB: SGLang's HiCache variable, with its
# meaning and default (one registration of a pool of hundreds of GiB is slow, gives no
# progress and can fail outright; HiCache registers large host pools in such pieces).
REGISTER_CHUNK_ENV = "SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB"
REGISTER_CHUNK_GB_DEFAULT = 256
# A pool at least this large logs its pinning's progress (each piece) in the startup log.
PROGRESS_BYTES = 16 << 30


class HostPoolError(RuntimeError):
    """The host pool cannot be created or attached as asked."""


def available_host_memory_bytes() -> int:
    """Memory that can still be allocated without swapping (MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def shm_free_bytes() -> Optional[int]:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def register_piece_bytes(granularity: int) -> int:
    """The size of one ``cudaHostRegister`` call: ``$SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB``
    GiB (at least 1, default 256, HiCache's meaning) rounded down to whole ``granularity``
    units (a chunk slot), never less than one unit."""
    raw = os.environ.get(REGISTER_CHUNK_ENV, "").strip()
    try:
        gib = int(raw) if raw else REGISTER_CHUNK_GB_DEFAULT
    except ValueError as e:
        raise HostPoolError(f"${REGISTER_CHUNK_ENV} must be a whole number of GiB, got {raw!r}") from e
    limit = max(gib, 1) << 30
    if granularity <= 0:
        raise ValueError(f"granularity must be positive, got {granularity}")
    return max(limit // granularity, 1) * granularity


def register_in_pieces(cudart: Any, base: int, total: int, piece: int) -> list[tuple[int, int]]:
    """``cudaHostRegister`` ``[base, base + total)`` in pieces of ``piece`` bytes; returns
    the ``(address, bytes)`` registered. On a failure the pieces done are unregistered and
    :class:`HostPoolError` names the piece, the code and the fix."""
    done: list[tuple[int, int]] = []
    pieces = -(-total // piece) if total else 0
    progress = total >= PROGRESS_BYTES
    if progress:
        logger.info(
            "PCR host tier: pinning %.1f GiB (cudaHostRegister in %d piece(s) of up to %.1f GiB, $%s)",
            total / 2**30,
            pieces,
            piece / 2**30,
            REGISTER_CHUNK_ENV,
        )
    start = time.monotonic()
    offset = 0
    while offset < total:
        size = min(piece, total - offset)
        rc = int(cudart.cudaHostRegister(base + offset, size, 0))
        if rc != 0:
            unregister_ranges(cudart, done, "registration rollback")
            raise HostPoolError(
                f"cudaHostRegister failed with code {rc} at offset {offset / 2**30:.2f} GiB (piece of "
                f"{size / 2**30:.2f} GiB, pool {total / 2**30:.2f} GiB): check the memlock limit (ulimit -l) "
                f"and free memory, set ${REGISTER_CHUNK_ENV} lower, or lower --pcr-dram-gb"
            )
        done.append((base + offset, size))
        offset += size
        if progress:
            logger.info(
                "PCR host tier: pinned %.1f of %.1f GiB (%.1f s)",
                offset / 2**30,
                total / 2**30,
                time.monotonic() - start,
            )
    return done


def unregister_ranges(cudart: Any, ranges: list[tuple[int, int]], what: str) -> None:
    """``cudaHostUnregister`` each registered piece by its own base address, newest first."""
    for address, size in reversed(ranges):
        rc = int(cudart.cudaHostUnregister(address))
        if rc != 0:
            logger.warning("cudaHostUnregister failed in %s (code %d) for %d bytes at %#x", what, rc, size, address)


@dataclass(frozen=True)
class HostPoolInfo:
    """What a second process needs to attach: the segment's name and its layout."""

    shm_name: str
    layout: HostChunkLayout


class HostChunkPool:
    def __init__(
        self,
        layout: HostChunkLayout,
        *,
        pin: Optional[bool] = None,
        shm_name: Optional[str] = None,
        create: bool = True,
    ):
        self.layout = layout
        size = layout.total_bytes
        self._lock_fd: Optional[int] = None
        self._shm: Optional[shared_memory.SharedMemory]  # None once closed
        if create:
            remove_stale_segments()
            self._check_capacity(size)
            name, self._lock_fd = self._owner_lock(shm_name)
            try:
                self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            except OSError as e:
                release_owner_lock(SHM_DIR, name, self._lock_fd)
                raise HostPoolError(f"cannot allocate a {size / 2**30:.2f} GiB host pool in shared memory: {e}") from e
        else:
            if shm_name is None:
                raise ValueError("attaching needs the pool's shm_name")
            try:
                self._shm = shared_memory.SharedMemory(name=shm_name, create=False)
            except FileNotFoundError as e:
                raise HostPoolError(f"host pool {shm_name!r} does not exist") from e
            # Python < 3.13 registers attached segments with the resource tracker, which
            # would unlink the owner's segment when this process exits: the owner alone
            # decides the segment's lifetime.
            # _name: the name the tracker registered (with its leading slash); private, not in typeshed
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
            if self._shm.size < size:
                raise HostPoolError(f"host pool {shm_name!r} is {self._shm.size} bytes, layout needs {size}")
        self.owner = create
        self.buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=size)
        self.pinned = False
        self._registered: list[tuple[int, int]] = []  # (address, bytes) of each cudaHostRegister
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and create:
            try:
                self._pin()
            except BaseException:
                # mutant: gpu-host-pool-pin-failure-leaks-its-segment
                self.close()  # a pool that cannot be pinned leaves no segment behind
                raise

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def _owner_lock(shm_name: Optional[str]) -> tuple[str, int]:
        """The segment's name and its owner lock, taken before the segment exists (so a
        sweep never sees a segment of ours without a held lock)."""
        for _ in range(100):
            name = shm_name or f"{SHM_PREFIX}{new_segment_token()}"
            try:
                return name, take_owner_lock(SHM_DIR, name)
            except (FileExistsError, BlockingIOError) as e:
                if shm_name is not None:
                    raise HostPoolError(f"host pool {shm_name!r} exists already (or is being removed): {e}") from e
            except OSError as e:
                raise HostPoolError(f"cannot create the host pool's owner lock in {SHM_DIR}: {e}") from e
        raise HostPoolError(f"no free host pool name in {SHM_DIR} after 100 tries")

    @staticmethod
    def _check_capacity(size: int) -> None:
        available = available_host_memory_bytes()
        if size > available:
            raise HostPoolError(
                f"the host pool needs {size / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB "
                "of memory is available"
            )
        shm_free = shm_free_bytes()
        # mutant: gpu-shm-capacity-not-checked
        if shm_free is not None and size > shm_free:
            raise HostPoolError(
                f"the host pool needs {size / 2**30:.2f} GiB of shared memory but {SHM_DIR} has "
                f"{shm_free / 2**30:.2f} GiB free. A container gets a 64 MiB {SHM_DIR} by default: "
                f"start it with a larger one (docker run --shm-size={max(1, -(-size // 2**30) + 1)}g, "
                "or --ipc=host; in Kubernetes an emptyDir volume with medium: Memory mounted at "
                f"{SHM_DIR}), or lower --pcr-dram-gb"
            )

    def _pin(self) -> None:
        """``cudaHostRegister`` the pool in pieces of at most
        ``$SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB`` GiB (as SGLang's HiCache does), each a
        whole number of chunk slots so no slot spans two registrations; progress goes to the
        startup log for a large pool. A failed piece unregisters those done and raises."""
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves cudart() unannotated
        ranges = register_in_pieces(
            cudart,
            self.buffer.data_ptr(),
            self.buffer.numel(),
            # mutant: gpu-host-pool-pinned-in-one-call
            register_piece_bytes(self.layout.slot_bytes),
        )
        self._registered = ranges
        self.pinned = True

    def info(self) -> HostPoolInfo:
        assert self._shm is not None, "the host pool is closed"
        return HostPoolInfo(shm_name=self._shm.name, layout=self.layout)

    @classmethod
    def attach(cls, info: HostPoolInfo) -> HostChunkPool:
        """Open an existing pool from another process (no slot bookkeeping there)."""
        return cls(info.layout, pin=False, shm_name=info.shm_name, create=False)

    def close(self) -> None:
        """Release this process's mapping; the creating process also removes the segment."""
        if self._shm is None:
            return
        if self.pinned:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # see _pin
            unregister_ranges(cudart, self._registered, "host pool close")
            self._registered = []
            self.pinned = False
        del self.buffer
        self._shm.close()
        if self.owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:  # the segment is gone: now the lock may go
            release_owner_lock(SHM_DIR, self._shm.name, self._lock_fd)
            self._lock_fd = None
        self._shm = None

    def __enter__(self) -> HostChunkPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ bytes
    def slot_view(self, slot: int) -> torch.Tensor:
        """All layers of one chunk: ``[layer][kv][token][row]`` bytes."""
        return self.buffer.view(self.layout.shape)[slot]
