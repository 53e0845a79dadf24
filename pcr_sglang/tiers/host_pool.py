"""HostChunkPool: chunk slots in shared host memory, pinned on CUDA.

The pool is one POSIX shared-memory segment laid out as
:class:`~pcr_sglang.transfer.layout.HostChunkLayout` describes, so that a second process
(the I/O process that will read and write SSD chunks) can attach to it by name and move
bytes without copies through the scheduler. On a CUDA machine the segment is registered
with ``cudaHostRegister`` so copy kernels read it directly; on CPU it stays plain memory.

This class is bytes only: which chunk a slot holds, and whether it is free, is the cache
state's (:mod:`pcr_sglang.core.host_slots`).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import torch

from pcr_sglang.transfer.layout import HostChunkLayout

logger = logging.getLogger(__name__)

SHM_PREFIX = "pcr-host-"


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
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(shm_dir: str = "/dev/shm", *, expected: bool = False) -> list[str]:
    """Unlink host pools left behind by processes that died without closing them.

    A server killed with SIGKILL never runs its exit handlers, and a POSIX shared-memory
    segment outlives its creator: without this sweep every crash would leak a pool's
    worth of memory. Pool names carry the creator's pid, so a segment whose creator is
    gone is garbage. ``expected``: the caller has just stopped a server (SGLang kills its
    scheduler with SIGKILL), so finding its pool is no news and is logged at INFO.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        pid_text = name[len(SHM_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except OSError:
            continue
    if removed:
        logger.log(logging.INFO if expected else logging.WARNING,
                   "Removed %d host pool(s) left by dead processes: %s", len(removed), removed)
    return removed


@dataclass(frozen=True)
class HostPoolInfo:
    """What a second process needs to attach: the segment's name and its layout."""

    shm_name: str
    layout: HostChunkLayout


class HostChunkPool:
    def __init__(self, layout: HostChunkLayout, *, pin: Optional[bool] = None,
                 shm_name: Optional[str] = None, create: bool = True):
        self.layout = layout
        size = layout.total_bytes
        if create:
            remove_stale_segments()
            self._check_capacity(size)
            name = shm_name or f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            try:
                self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            except OSError as e:
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
            resource_tracker.unregister(self._shm._name, "shared_memory")
            if self._shm.size < size:
                raise HostPoolError(f"host pool {shm_name!r} is {self._shm.size} bytes, layout needs {size}")
        self.owner = create
        self.buffer = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=size)
        self.pinned = False
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and create:
            self._pin()

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def _check_capacity(size: int) -> None:
        available = available_host_memory_bytes()
        if size > available:
            raise HostPoolError(
                f"the host pool needs {size / 2**30:.2f} GiB but only {available / 2**30:.2f} GiB "
                "of memory is available"
            )
        shm_free = shm_free_bytes()
        if shm_free is not None and size > shm_free:
            raise HostPoolError(
                f"the host pool needs {size / 2**30:.2f} GiB of shared memory but /dev/shm has "
                f"{shm_free / 2**30:.2f} GiB free (raise its size, e.g. docker --shm-size)"
            )

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        rc = int(cudart.cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0))
        if rc != 0:
            raise HostPoolError(f"cudaHostRegister failed with code {rc}")
        self.pinned = True

    def info(self) -> HostPoolInfo:
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
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        del self.buffer
        self._shm.close()
        if self.owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        self._shm = None

    def __enter__(self) -> HostChunkPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ bytes
    def slot_view(self, slot: int) -> torch.Tensor:
        """All layers of one chunk: ``[layer][kv][token][row]`` bytes."""
        return self.buffer.view(self.layout.shape)[slot]
