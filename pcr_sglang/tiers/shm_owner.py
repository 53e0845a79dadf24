"""Owner locks of host pool segments, and the sweep of segments whose owner is gone.

A POSIX shared-memory segment outlives the process that created it, so a crashed server
would leak its pool's memory. Each pool's creator holds an ``flock`` on a lock file next
to its segment (``/dev/shm/<name>.lock``) for the pool's life; the kernel drops that lock
when the owner dies, however it dies. The sweep (:func:`remove_stale_segments`) removes a
segment only when it can take that lock: the lock, not a pid, tells whether the owner is
alive, in any pid namespace that shares ``/dev/shm``. The pool itself
(:mod:`pcr_sglang.tiers.host_pool`) takes and releases the lock around its segment.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets

logger = logging.getLogger(__name__)

SHM_PREFIX = "pcr-host-"
LOCK_SUFFIX = ".lock"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments (and our owner locks)


def new_segment_token() -> str:
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
