"""HostChunkPool: chunk slots in shared host memory, pinned on CUDA.

The pool is one POSIX shared-memory segment laid out as
:class:`~pcr_sglang.tiers.layout.HostChunkLayout` describes, so that a second process
(the I/O process that will read and write SSD chunks) can attach to it by name and move
bytes without copies through the scheduler. On a CUDA machine the segment is registered
with ``cudaHostRegister`` so copy kernels read it directly; on CPU it stays plain memory.
Its creator holds an ``flock`` on a lock file next to it (``/dev/shm/<name>.lock``) for
the pool's life: the lock, not a pid, tells a sweep whether the owner is alive, in any pid
namespace that shares ``/dev/shm`` (:func:`remove_stale_segments`).

This class is bytes only: which chunk a slot holds, and whether it is free, is the cache
state's (:mod:`pcr_sglang.core.host_slots`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Optional

import torch

from pcr_sglang.tiers.layout import HostChunkLayout

logger = logging.getLogger(__name__)

SHM_PREFIX = "pcr-host-"
LOCK_SUFFIX = ".lock"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments (and our owner locks)
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


def _new_token() -> str:
    """A segment's owner token: random, and never all digits, so that the pid-based sweep
    of older versions (which read the first field of the name as a pid) leaves it alone."""
    while True:
        token = secrets.token_hex(8)
        if not token.isdigit():
            return token


def _lock_path(shm_dir: str, name: str) -> str:
    return os.path.join(shm_dir, name + LOCK_SUFFIX)


def _same_file(fd: int, path: str) -> bool:
    """``fd`` is still the file at ``path`` (it was not unlinked or replaced meanwhile)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def take_owner_lock(shm_dir: str, name: str) -> int:
    """Create ``<name>.lock`` next to the segment-to-be and hold an exclusive ``flock``
    on it; returns the descriptor, which the pool keeps open for its whole life.

    The kernel releases the lock when the owner process dies, however it dies (kill -9
    included), and a ``flock`` is the same lock seen from every pid namespace sharing the
    file system: unlike a pid, it cannot be mistaken for someone else's or read as dead
    by a container that cannot see the owner. The descriptor is close-on-exec, so the
    I/O process (started with exec) does not hold it. Raises ``FileExistsError`` if the
    name is taken and ``BlockingIOError`` if a sweep took the new file before us."""
    path = _lock_path(shm_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _same_file(fd, path):  # a sweep removed it between open and flock
            raise BlockingIOError(f"{path} was removed while it was being locked")
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_owner_lock(shm_dir: str, name: str, fd: int) -> None:
    """The owner removed its segment: remove the lock file, then let go of the lock."""
    try:
        if _same_file(fd, _lock_path(shm_dir, name)):
            os.unlink(_lock_path(shm_dir, name))
    except OSError:
        pass
    os.close(fd)


_reported_unowned: set[str] = set()


def remove_stale_segments(shm_dir: str = SHM_DIR, *, expected: bool = False) -> list[str]:
    """Unlink host pools whose owner is gone; returns the names of the segments removed.

    A server killed with SIGKILL never runs its exit handlers, and a POSIX shared-memory
    segment outlives its creator: without this sweep every crash would leak a pool's
    worth of memory. Each pool's owner holds an ``flock`` on ``<segment>.lock`` for the
    pool's life (:func:`take_owner_lock`): a segment is removed only if this sweep can
    take that lock, which no live owner in any pid namespace sharing ``/dev/shm`` allows
    (containers with ``--ipc=host`` or a shared volume see each other's segments, not
    each other's pids). A lock file left without its segment, and free, is removed too.

    A segment with no lock file (named by its creator's pid, by versions before the
    lock) is never removed: whether its pid is alive here says nothing about a creator in
    another pid namespace. It is logged once, for its owner to remove by hand.

    ``expected``: the caller has just stopped a server (SGLang kills its scheduler with
    SIGKILL), so finding its pool is no news and is logged at INFO.
    """
    removed: list[str] = []
    try:
        names = set(os.listdir(shm_dir))
    except OSError:
        return removed
    unowned = []
    for name in sorted(names):
        if not name.startswith(SHM_PREFIX):
            continue
        if name.endswith(LOCK_SUFFIX):
            segment = name[: -len(LOCK_SUFFIX)]
            if segment not in names and _remove_if_unlocked(shm_dir, segment, segment_too=False):
                logger.debug("Removed %s, a host pool lock left without its segment", name)
            continue
        if name + LOCK_SUFFIX not in names:
            unowned.append(name)
            continue
        if _remove_if_unlocked(shm_dir, name, segment_too=True):
            removed.append(name)
    if removed:
        logger.log(
            logging.INFO if expected else logging.WARNING,
            "Removed %d host pool(s) left by dead processes: %s",
            len(removed),
            removed,
        )
    new_unowned = [n for n in unowned if n not in _reported_unowned]
    if new_unowned:
        _reported_unowned.update(new_unowned)
        logger.warning(
            "Host pool segment(s) in %s with no owner lock (left by an older version, or a live server "
            "of one): %s; not removed, since their owner cannot be told dead from another pid "
            "namespace. Remove them by hand once no server of an older version runs.",
            shm_dir,
            new_unowned,
        )
    return removed


def _remove_if_unlocked(shm_dir: str, name: str, *, segment_too: bool) -> bool:
    """Take ``name``'s owner lock without waiting; if it is free (its owner is dead),
    unlink the segment (when ``segment_too``) and then the lock file, holding the lock."""
    path = _lock_path(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its owner is alive (in some pid namespace)
        if not _same_file(fd, path):
            return False  # removed and perhaps recreated meanwhile: not the file we locked
        if segment_too:
            try:
                os.unlink(os.path.join(shm_dir, name))
            except FileNotFoundError:
                pass
            except OSError:
                return False
        try:
            os.unlink(path)
        except OSError:
            pass
        return True
    finally:
        os.close(fd)


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
            name = shm_name or f"{SHM_PREFIX}{_new_token()}"
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
