"""PCR's command-line flags, declared the way SGLang declares its own.

SGLang 0.5.23 assembles ``ServerArgs`` (a msgspec Struct) from namespace classes when
``sglang.srt.server_args`` is imported, before any plugin runs; fields cannot be added
later. Our patch ``01-plugin-server-args-namespaces`` lets installed packages contribute
namespaces through the entry-point group ``sglang.srt.server_args_namespaces``; this
module's ``PcrFlags`` is ours. Every field of it becomes a ``--flag`` in
``launch_server --help`` and a keyword of ``sglang.Engine``.

The declarations are split by feature into a chain of base classes, in ``--help`` order:
``flags_cache.CacheFlags`` (the cache, its tiers, prefetch, KV hints), then
``flags_documents.DocumentFlags`` (document reuse), then ``PcrFlags`` here (the remote
tier, document reuse's calibration, the debug checks: the flags declared last). Each
numeric flag's allowed values are a ``flags_range.Range``. The names other modules read
(``flag_value``, the defaults they share) are importable from here.

This module is imported while ``sglang.srt.server_args`` itself is being imported, so it
may import only msgspec, SGLang's argument helpers and modules that import nothing
(``reuse/selectors.py``, ``pcr_wire``).
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec.structs
from sglang.srt.arg_groups.arg_utils import A, Arg

# Re-exported (``X as X``): the config, the adapter, tools, benchmarks and tests name them from here.
from pcr_sglang.flags_cache import AUTO_LAYERWISE as AUTO_LAYERWISE
from pcr_sglang.flags_cache import DEFAULT_LAYERWISE as DEFAULT_LAYERWISE
from pcr_sglang.flags_cache import HINT_TO_DEVICE_FREE_SHARE as HINT_TO_DEVICE_FREE_SHARE
from pcr_sglang.flags_cache import LAYERWISE_CHOICES as LAYERWISE_CHOICES
from pcr_sglang.flags_documents import DEFAULT_DOC_MAX_DOCUMENTS as DEFAULT_DOC_MAX_DOCUMENTS
from pcr_sglang.flags_documents import DEFAULT_DOC_MIN_TOKENS as DEFAULT_DOC_MIN_TOKENS
from pcr_sglang.flags_documents import DEFAULT_DOC_RECOMPUTE_RATIO as DEFAULT_DOC_RECOMPUTE_RATIO
from pcr_sglang.flags_documents import DEFAULT_DOC_RECOMPUTE_TOKENS as DEFAULT_DOC_RECOMPUTE_TOKENS
from pcr_sglang.flags_documents import DocumentFlags
from pcr_sglang.flags_range import Range as Range
from pcr_wire import DEFAULT_DOC_FORMAT as DEFAULT_DOC_FORMAT

# The shared remote tier (pcr_sglang.tiers.remote_store): off, or the store it runs on.
REMOTE_CHOICES = ["off", "mooncake"]
DEFAULT_REMOTE = "off"


class PcrFlags(DocumentFlags):
    """Namespace ``pcr``: Prefetch-enhanced Cache Reuse (pcr-sglang). Its fields are
    ``CacheFlags``'s, then ``DocumentFlags``'s, then the ones declared here."""

    _NS_PATH = "pcr"

    pcr_remote: A[
        str,
        Arg(
            help=(
                "A remote tier shared by several servers, below device, host memory and the "
                "SSD tier (which it needs): 'mooncake' keeps chunk records as objects in a "
                "Mooncake Store (its master and store processes started apart; see "
                "docs/scale-out.md). A request whose chunks are in none of the local "
                "tiers has the rest of its prefix probed there (one round trip) and read from "
                "there; new chunks are written through in the background. Only with TP size 1. "
                f"Default: {DEFAULT_REMOTE}."
            ),
            choices=REMOTE_CHOICES,
        ),
    ] = DEFAULT_REMOTE
    pcr_doc_reuse_calibration: A[
        Optional[str],
        Arg(
            help=(
                "--pcr-doc-reuse: a calibration file written by `python -m pcr_tools.calibrate` for "
                "this model. The server uses its K or R for the mode, refuses to start when the "
                "file was measured on other weights, and refuses a mode that missed the file's "
                "accuracy target (see --pcr-doc-reuse-calibration-warn). A marked request that asks "
                "for another mode, selector or anchor count, or a K or R below the calibrated one, "
                "gets HTTP 400 naming the file; after a weight update in place to other weights "
                "document reuse stops (/server_info says why). Without it the startup log says the "
                "mode's accuracy on this model is unmeasured."
            )
        ),
    ] = None
    pcr_doc_reuse_calibration_warn: A[
        bool,
        Arg(
            help=(
                "With --pcr-doc-reuse-calibration: serve a mode that missed the calibration's "
                "target anyway, with a warning in the startup log and /server_info, and serve "
                "requests that ask for settings outside the calibration instead of refusing them, "
                "counted in sglang:pcr_doc_reuse_calibration_overrides_total by what they changed."
            )
        ),
    ] = False
    pcr_debug_checks: A[
        bool,
        Arg(
            help=(
                "Let any client ask /server_info?pcr_check_invariants=1 for PCR's full bookkeeping "
                "check, a walk of the whole chunk tree in the scheduler thread (tests and "
                "debugging). Without this flag only a caller with SGLang's --admin-api-key (as a "
                "Bearer token) may ask; others get HTTP 403. On CUDA it also checks every host-tier "
                "copy's and document re-placement's slots on the device (asserts queued without a "
                "host wait; a slip fails the server instead of corrupting KV): for first GPU runs."
            )
        ),
    ] = False
    pcr_remote_config: A[
        Optional[str],
        Arg(
            help=(
                "--pcr-remote mooncake: a JSON object, or @path to a JSON file, with "
                "master_server_address (host:port of mooncake_master) and key_file (32 bytes, "
                "mode 0600, the same file on every server: records are authenticated with it), "
                "and optionally Mooncake's metadata_server (default P2PHANDSHAKE), protocol "
                "(tcp or rdma), local_hostname, device_name, global_segment_size (memory this "
                "server lends the store; default 0: store processes hold the data), "
                "local_buffer_size, and PCR's probe_timeout_ms (how long a request waits for "
                "its probe, default 100) and write_queue_records (write-through records queued, "
                "default 16)."
            )
        ),
    ] = None


def flag_default(name: str) -> Any:
    """The declared default of the flag field ``name`` (``pcr_chunk_size``)."""
    return _defaults()[name]


def flag_value(args: Any, name: str) -> Any:
    """Flag ``name`` of ``args`` (SGLang's ``ServerArgs``, or any object, or None: tests,
    benchmarks, a process without PCR's namespace), its declared default where it has none."""
    return getattr(args, name, flag_default(name))


_DEFAULTS: dict[str, Any] = {}


def _defaults() -> dict[str, Any]:
    if not _DEFAULTS:
        _DEFAULTS.update((f.name, f.default) for f in msgspec.structs.fields(PcrFlags))
    return _DEFAULTS
