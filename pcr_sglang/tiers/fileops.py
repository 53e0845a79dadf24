"""FileOps: the few file-system calls that change the SSD store's durable state.

The store never calls ``os.write``/``os.fsync``/``os.rename``/... directly: it goes
through one of these objects, so a test can record every state-changing operation in
order (:class:`RecordingFileOps`) and then rebuild the states a power cut may leave
behind (``tests/unit/tiers/test_store_crash_states.py``), in the style of ALICE and
CrashMonkey. Reads are not routed here: they change nothing a crash could lose.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable


class FileOps:
    """The real calls. Every method is a thin wrapper with the POSIX call's semantics."""

    def create(self, path: str, *, exclusive: bool = True) -> int:
        """Open ``path`` for writing, created 0600 (with ``exclusive``: must not exist)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if exclusive else os.O_TRUNC)
        return os.open(path, flags, 0o600)

    def write_all(self, fd: int, data: Any) -> None:
        """Write every byte of ``data`` (``os.write`` may write fewer)."""
        view = memoryview(data).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        """Give ``src`` a second name ``dst``; fails with FileExistsError if ``dst`` exists
        (an atomic create-if-absent of a complete file)."""
        os.link(src, dst)

    def mkdir(self, path: str, mode: int = 0o700) -> bool:
        """Create directory ``path``; False if it already existed."""
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            return False
        return True

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creates, renames, unlinks, mkdirs in it) durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass
class Op:
    """One recorded operation. ``fd_id`` names the file a write/fsync/close touched (an
    increasing id per create, since fd numbers are reused)."""

    kind: str  # create, write, fsync, close, rename, link, mkdir, unlink, fsync_dir, mark
    path: str = ""
    dest: str = ""
    fd_id: int = -1
    data: bytes = b""
    label: Any = None


@dataclass
class RecordingFileOps(FileOps):
    """Performs every call for real and appends it to ``log``. ``skip`` names calls to
    leave out (a store variant with an fsync removed: the crash-state test's negative
    control); ``skip_if`` narrows a skip to the paths it accepts."""

    log: list[Op] = field(default_factory=list)
    skip: frozenset[str] = frozenset()
    skip_if: Callable[[str], bool] = lambda path: True
    _fd_ids: dict[int, int] = field(default_factory=dict)
    _fd_paths: dict[int, str] = field(default_factory=dict)
    _next_id: int = 0

    def _skipped(self, kind: str, path: str) -> bool:
        return kind in self.skip and self.skip_if(path)

    def mark(self, label: Any) -> None:
        """A point in the log the test cares about (e.g. "the scheduler was told key K is done")."""
        self.log.append(Op("mark", label=label))

    def create(self, path: str, *, exclusive: bool = True) -> int:
        fd = super().create(path, exclusive=exclusive)
        self._next_id += 1
        self._fd_ids[fd], self._fd_paths[fd] = self._next_id, str(path)
        self.log.append(Op("create", str(path), fd_id=self._next_id))
        return fd

    def write_all(self, fd: int, data: Any) -> None:
        super().write_all(fd, data)
        self.log.append(Op("write", self._fd_paths[fd], fd_id=self._fd_ids[fd], data=bytes(data)))

    def fsync(self, fd: int) -> None:
        if self._skipped("fsync", self._fd_paths[fd]):
            return
        super().fsync(fd)
        self.log.append(Op("fsync", self._fd_paths[fd], fd_id=self._fd_ids[fd]))

    def close(self, fd: int) -> None:
        super().close(fd)
        self._fd_ids.pop(fd, None)
        self._fd_paths.pop(fd, None)

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self.log.append(Op("rename", str(src), str(dst)))

    def link(self, src: str, dst: str) -> None:
        super().link(src, dst)
        self.log.append(Op("link", str(src), str(dst)))

    def mkdir(self, path: str, mode: int = 0o700) -> bool:
        made = super().mkdir(path, mode)
        if made:
            self.log.append(Op("mkdir", str(path)))
        return made

    def unlink(self, path: str) -> None:
        super().unlink(path)
        self.log.append(Op("unlink", str(path)))

    def fsync_dir(self, path: str) -> None:
        if self._skipped("fsync_dir", str(path)):
            return
        super().fsync_dir(path)
        self.log.append(Op("fsync_dir", str(path)))
