"""KeptNamespaces: the SSD namespaces a server has left, kept for a rollback, within bounds.

A disk weight update moves the SSD tier to the new checkpoint's namespace directory and
keeps the previous one, so a rollback to weights served before finds its records again.
Kept without a bound, an RL run that saves and loads a checkpoint every step would fill
the disk: each new store is fitted to the space left, and once none is, the SSD tier
stops writing. So a server keeps at most ``keep`` namespaces it left
(``--pcr-ssd-keep-namespaces``), and their bytes are charged to its ``--pcr-ssd-gb``:
together they may take at most half of it (the namespace served gets the rest), and the
oldest left are purged first when there are more, or more bytes. A namespace served again
(a rollback) leaves the list; one another server writes in is not ours to purge or charge
(it is dropped from the list). Namespaces of earlier runs of the server are not tracked:
``python -m pcr_tools.store_cli purge`` removes them.

This module knows nothing of SGLang or the tree: the factory calls it at a namespace move.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from pcr_sglang.tiers.store_dir import SUFFIX, SSDStoreError, namespace_dir, purge_namespace, subdirs

logger = logging.getLogger(__name__)

KEPT_SHARE = 0.5  # of --pcr-ssd-gb: what kept namespaces may take together


def namespace_bytes(root: str | os.PathLike[str], digest_hex: str) -> int:
    """Bytes of a namespace's chunk records, in every writer slot (what a purge frees)."""
    ns_dir = namespace_dir(root, digest_hex)
    total = 0
    try:
        slots = [p for p in ns_dir.iterdir() if p.is_dir() and not p.is_symlink()]
    except FileNotFoundError:
        return 0
    for slot_dir in slots:
        for sub in subdirs(slot_dir):
            for path in sub.iterdir():
                if path.suffix == SUFFIX:
                    try:
                        total += path.stat().st_size
                    except FileNotFoundError:
                        pass
    return total


@dataclass
class Room:
    """What :meth:`KeptNamespaces.make_room` decided for a move."""

    charged_bytes: int  # the kept namespaces' bytes once the move is done (the one left included)
    purge_leaving: bool  # the namespace being left goes too (once its I/O process has let go)
    purged: list[str] = field(default_factory=list)  # namespaces purged now


@dataclass
class KeptNamespace:
    digest_hex: str
    bytes: int


class KeptNamespaces:
    """The namespaces this server left, oldest first, under one store root."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.kept: list[str] = []
        self._bytes: dict[str, int] = {}  # each kept namespace's bytes, as measured at the last move
        self.purged = 0  # namespaces purged to stay within the bounds, since the start
        self.writes_off_reason: str | None = None  # why the SSD tier stopped writing at a move

    def make_room(self, leaving: str | None, entering: str, *, keep: int, budget_bytes: int) -> Room:
        """The server leaves namespace ``leaving`` (None: nothing to keep, an in-memory
        update's, which is purged anyway) for ``entering``: purge the oldest kept ones
        until at most ``keep`` remain, the one left included, and they take at most
        ``KEPT_SHARE`` of ``budget_bytes``. ``leaving`` is still in use (its I/O process
        holds its lease): when it must go too, the caller purges it once that process is
        gone (``purge_leaving``). Call :meth:`left` once the move succeeded."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        if entering in self.kept:
            self.kept.remove(entering)  # served again (a rollback): its records are the new store's
        if leaving == entering:
            leaving = None
        candidates = [KeptNamespace(h, namespace_bytes(self.root, h)) for h in self.kept]
        if leaving is not None:
            candidates.append(KeptNamespace(leaving, namespace_bytes(self.root, leaving)))
        room = Room(charged_bytes=0, purge_leaving=False)
        share = int(budget_bytes * KEPT_SHARE)
        # mutant: ssd-kept-namespaces-unbounded
        while candidates and (len(candidates) > keep or sum(c.bytes for c in candidates) > share):
            oldest = candidates.pop(0)
            if oldest.digest_hex == leaving:
                room.purge_leaving = True
                continue
            self.kept.remove(oldest.digest_hex)
            if self._purge(oldest.digest_hex, "to stay within --pcr-ssd-keep-namespaces and --pcr-ssd-gb"):
                room.purged.append(oldest.digest_hex)
        room.charged_bytes = sum(c.bytes for c in candidates)
        self._bytes = {c.digest_hex: c.bytes for c in candidates}
        return room

    def left(self, digest_hex: str) -> None:
        """The move away from ``digest_hex`` is done and it is kept (newest)."""
        if digest_hex not in self.kept:
            self.kept.append(digest_hex)

    def purge_left(self, digest_hex: str, why: str) -> bool:
        """Purge a namespace the server has just left (its I/O process is gone)."""
        self._bytes.pop(digest_hex, None)
        return self._purge(digest_hex, why)

    def _purge(self, digest_hex: str, why: str) -> bool:
        try:
            chunks = purge_namespace(self.root, digest_hex)
        except SSDStoreError as e:  # another server writes in it: not ours to purge, nor to charge
            logger.warning("PCR SSD tier: namespace %s is left on disk, no longer counted as kept: %s", digest_hex, e)
            return False
        except FileNotFoundError:
            return False
        self.purged += 1
        logger.info("PCR SSD tier: purged namespace %s (%d chunks) %s", digest_hex, chunks, why)
        return True

    def report(self) -> dict[str, object]:
        """For ``/server_info``: the kept namespaces (oldest first) with their bytes as
        measured at the last move, and how many were purged to stay within the bounds."""
        sizes = [self._bytes.get(h, 0) for h in self.kept]
        return {
            "kept": [{"namespace": h, "bytes": b} for h, b in zip(self.kept, sizes)],
            "kept_bytes": sum(sizes),
            "purged": self.purged,
        }
