"""What every accuracy and TTFT run of document reuse shares about its servers and its
requests: the server flags (one context length, the warm-up policy that makes a warm-up
send compute canonical KV), the document-reuse mode that serves every measured
configuration, running a measurement over prompts with failures kept as rows, and the
machine line the reports carry."""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from pcr_eval.modes import ModeSpec

logger = logging.getLogger(__name__)

COMMON_SERVER_ARGS = ("--context-length", "4096", "--log-level", "warning", "--sleep-on-idle")


def server_mode(specs: Sequence[ModeSpec]) -> str:
    """The ``--pcr-doc-reuse`` that serves every spec (a recompute server serves concat
    too; any server serves reorder, chosen in its tokenizer process)."""
    from pcr_sglang.reuse.bounds import RECOMPUTE_MODES

    return "blend" if any(s.mode in RECOMPUTE_MODES for s in specs) else "concat"


def doc_reuse_server_flags(reuse: str, chunk_size: int) -> tuple[str, ...]:
    """The doc-reuse server: documents warmed at their first sighting, so each prompt's
    warm-up send computes its documents' canonical KV and reuses it (with the default,
    warm when a document recurs, the warm-up would be a plain prefill, cached exactly, and
    the measured send would hit that exact prefix)."""
    return (
        "--enable-pcr",
        "--pcr-chunk-size",
        str(chunk_size),
        "--pcr-doc-reuse",
        reuse,
        "--pcr-doc-warmup",
        "request",
        "--pcr-doc-warmup-after",
        "1",
    )


def run_all(
    prompts: Sequence[Any], work: Callable[[Any], dict[str, Any]], concurrency: int, label: str
) -> list[dict[str, Any]]:
    """``work`` on every prompt, ``concurrency`` at a time; a failure is recorded as the
    row's ``error``. Progress goes to stderr."""
    done, lock, started = [0], threading.Lock(), time.monotonic()

    def one(prompt: Any) -> dict[str, Any]:
        try:
            row = work(prompt)
        except Exception as e:  # noqa: BLE001 - one bad request must not lose the run
            logger.error("[%s] request %s failed: %s", label, prompt.rid, e)
            row = {"error": f"{type(e).__name__}: {e}"}
        with lock:
            done[0] += 1
            print(
                f"[{label}] {done[0]}/{len(prompts)} done ({time.monotonic() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        return row

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, prompts))


def machine() -> str:
    """The run's machine as the reports name it: its usable CPU cores, and no GPU where
    there is none."""
    from pcr_tools.launcher import cpu_only

    return f"{len(_affinity())} CPU cores" + (", no GPU" if cpu_only() else "")


def _affinity() -> set[int]:
    import os

    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))
