"""The I/O process's test faults: the only home of test knobs.

Kept apart from :mod:`pcr_sglang.io.process` so that its production path reads as
production code, and every way a test can make the I/O process slow or fail is read in one
place (the remote thread is handed its part as a
:class:`~pcr_sglang.io.remote_calls.RemoteFaults`).

Test knob: ``PCR_IO_TEST_FAULTS`` (JSON, e.g. ``{"tp_ranks": [1], "read_delay_s": 2}``,
``{"fail_reads": true}``, ``{"fail_writes": true}``, ``{"write_delay_s": 0.2}``,
``{"read_rendezvous": 4}`` (each read waits until that many are running at once, and
fails if they never are: a test that reads overlap; once broken the barrier stays
broken, so a test sends reads in multiples of it),
``{"remote_delay_s": 0.5}``, ``{"remote_read_delay_s": 2}`` or ``{"remote_fail": true}``)
makes the processes of the listed TP ranks (all ranks when absent) delay or fail their
reads, fail their writes as a full disk would, hold each record in its temp file before
the rename, or delay every remote call (or read), or fail every one, so tests can make one
rank's reads arrive late or fail, kill mid-write, or make the remote store slow or
unreachable. It is read once at start and logged; never set it in production.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

from pcr_sglang.tiers.fileops import FileOps

logger = logging.getLogger(__name__)

FAULTS_ENV = "PCR_IO_TEST_FAULTS"


@dataclass(frozen=True)
class TestFaults:
    read_delay_s: float = 0.0
    fail_reads: bool = False
    fail_writes: bool = False
    # Each record waits this long, complete in its temp file, before its rename, so that a
    # kill is likely to land mid-write (the kill -9 test discards what it catches).
    write_delay_s: float = 0.0
    remote_delay_s: float = 0.0  # every remote call waits this long first
    remote_fail: bool = False  # every remote call fails, as with an unreachable master
    remote_read_delay_s: float = 0.0  # every remote read waits this long first
    read_rendezvous: int = 0  # reads wait for this many to run at once (0: they do not)

    @classmethod
    def from_env(cls, tp_rank: int) -> Optional[TestFaults]:
        text = os.environ.get(FAULTS_ENV)
        if not text:
            return None
        spec = json.loads(text)
        ranks = spec.get("tp_ranks")
        if ranks is not None and tp_rank not in ranks:
            return None
        faults = cls(
            float(spec.get("read_delay_s", 0.0)),
            bool(spec.get("fail_reads", False)),
            bool(spec.get("fail_writes", False)),
            float(spec.get("write_delay_s", 0.0)),
            float(spec.get("remote_delay_s", 0.0)),
            bool(spec.get("remote_fail", False)),
            float(spec.get("remote_read_delay_s", 0.0)),
            int(spec.get("read_rendezvous", 0)),
        )
        logger.warning("PCR I/O process of TP rank %d: test faults %s (%s)", tp_rank, faults, FAULTS_ENV)
        return faults


class DelayedRenames(FileOps):
    """The store's file operations with a pause before each rename (``write_delay_s``)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def rename(self, src: str, dst: str) -> None:
        time.sleep(self.delay_s)
        super().rename(src, dst)
