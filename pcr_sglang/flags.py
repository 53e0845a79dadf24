"""PCR's command-line flags, declared the way SGLang declares its own.

SGLang 0.5.23 assembles ``ServerArgs`` (a msgspec Struct) from namespace classes when
``sglang.srt.server_args`` is imported, before any plugin runs; fields cannot be added
later. Our patch ``01-plugin-server-args-namespaces`` lets installed packages contribute
namespaces through the entry-point group ``sglang.srt.server_args_namespaces``; this
class is ours. Every field here becomes a ``--flag`` in ``launch_server --help`` and a
keyword of ``sglang.Engine``.

This module is imported while ``sglang.srt.server_args`` itself is being imported, so it
may import only msgspec, SGLang's argument helpers and modules that import nothing
(``reuse/selectors.py``, ``pcr_wire``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import msgspec
import msgspec.structs
from sglang.srt.arg_groups.arg_utils import A, Arg

from pcr_sglang.reuse.selectors import DEFAULT_SELECTOR, SELECTORS
from pcr_wire import DEFAULT_DOC_FORMAT


@dataclass(frozen=True)
class Range:
    """A numeric flag's allowed values, beside its ``Arg`` in the annotation: at least ``ge``
    (or more than ``gt``), at most ``le``; ``unit`` names what it counts in messages
    ("a number of GB >= 0"). ``PCRConfig.validate`` checks every flag that has one, and the
    type its annotation gives (an int flag takes no bool or float); msgspec and argparse
    ignore it."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    unit: str = ""


DEFAULT_CHUNK_SIZE = 64
# From bench/lookahead_sim.py: hit ratio grows with the window up to 16, gaining most at
# small capacities; 8 keeps the per-step cost (chunks matched by 8 queued requests) small.
DEFAULT_LOOKAHEAD_WINDOW = 8
LAYERWISE_CHOICES = ["off", "load", "offload", "both"]
DEFAULT_DRAM_GB = 0.0  # no host tier
DEFAULT_LAYERWISE = "both"  # what "auto" is without a prefill CUDA graph
# The flag's default: "both", or "offload" where a prefill CUDA graph is on (layer-wise
# loads under one are refused until a GPU run shows their waits at replay).
AUTO_LAYERWISE = "auto"
SSD_WRITE_CHOICES = ["through", "on-evict"]
DEFAULT_SSD_GB = 0.0  # no SSD tier
DEFAULT_SSD_RESERVE_GB = 1.0
DEFAULT_SSD_WRITE = "through"
SSD_DURABILITY_CHOICES = ["record", "batch", "none"]
# From bench/ssd_store_bench.py (see bench/README.md).
DEFAULT_SSD_DURABILITY = "record"
# Reads in flight at once per I/O process: an NVMe drive reaches its bandwidth only with
# several in its queue, and a slow or network disk hides its latency only so.
DEFAULT_SSD_READ_THREADS = 4
MAX_SSD_READ_THREADS = 64
# Namespaces left at weight updates kept for a rollback (pcr_sglang.tiers.kept_namespaces).
DEFAULT_SSD_KEEP_NAMESPACES = 2
# From bench/prefetch_sweep.py (see bench/README.md).
DEFAULT_PREFETCH_WINDOW = 16
DEFAULT_PREFETCH_BUDGET_MB = 256
# The shared remote tier (pcr_sglang.tiers.remote_store): off, or the store it runs on.
REMOTE_CHOICES = ["off", "mooncake"]
DEFAULT_REMOTE = "off"
# blend's probe (pcr_sglang.reuse.blend_select): scratch one selection may need at most.
DEFAULT_BLEND_PROBE_MB = 1024
# Permuted rows (pcr_sglang.reuse.rows): the Triton position mask one request may need at most.
DEFAULT_POSITION_MASK_MB = 256
# KV hints (pcr_sglang.core.hints): reads for hinted chains come after the queue's own.
DEFAULT_HINT_BUDGET_MB = 128
DEFAULT_HINT_MAX_TTL_S = 30.0
DEFAULT_HINT_RATE = 20.0
# Hinted chunks in host memory go on into free device slots: on a GPU that is meant to
# move the PCIe copy off the final request's path; on CPU it saves only a memcpy.
HINT_TO_DEVICE_CHOICES = ["auto", "on", "off"]
DEFAULT_HINT_TO_DEVICE = "off"  # until it has been measured on a GPU
# Promotion stops while fewer device slots than this share of the pool would stay free.
HINT_TO_DEVICE_FREE_SHARE = 0.5
# Documents sent as text (pcr_sglang.reuse.documents) are written into the prompt in
# pcr_wire.DEFAULT_DOC_FORMAT, where the chat template does not take documents= itself.
# Document KV reuse in any order (docs/document-reuse.md): off, or the re-placement mode.
DOC_REUSE_CHOICES = ["off", "reorder", "concat", "lego", "blend"]
DEFAULT_DOC_REUSE = "off"
# EPIC's LegoLink recomputes a few leading tokens per document; CacheBlend's default ratio.
# bench/doc_reuse_accuracy.py measures both on SmolLM2 (docs/document-reuse.md).
DEFAULT_DOC_RECOMPUTE_TOKENS = 32
DEFAULT_DOC_RECOMPUTE_RATIO = 0.15
DEFAULT_DOC_ANCHOR_TOKENS = 0  # blend's selector picks every recomputed token
# When a document's canonical KV is computed (pcr_sglang.reuse.warmup): bench/ragbench
# --unique-docs measured warming every first sighting several times slower than radix
# (bench/README.md, "When documents are warmed").
DOC_WARMUP_CHOICES = ["request", "idle"]
# What ranks blend's recomputed tokens: the one list, which a request chooses from too.
DOC_SELECTOR_CHOICES = list(SELECTORS)
DEFAULT_DOC_SELECTOR = DEFAULT_SELECTOR
DEFAULT_DOC_WARMUP = "request"
DEFAULT_DOC_WARMUP_AFTER = 2
# What one request may mark (the worst allowed request was measured by bench/doc_bounds_step.py, at commit d886199).
DEFAULT_DOC_MAX_DOCUMENTS = 64
DEFAULT_DOC_MIN_TOKENS = 16


class PcrFlags(msgspec.Struct):
    """Namespace ``pcr``: Prefetch-enhanced Cache Reuse (pcr-sglang)."""

    _NS_PATH = "pcr"

    enable_pcr: A[
        bool,
        Arg(
            help=(
                "Replace the radix cache with PCR's chunk-granular prefix cache "
                "(pcr-sglang): KV is cached and reused in chunks of --pcr-chunk-size "
                "tokens keyed by their whole prefix."
            )
        ),
    ] = False
    pcr_chunk_size: A[
        int,
        Arg(
            help=(
                "Tokens per PCR chunk. Must be a positive multiple of --page-size. "
                "Only whole chunks are cached; smaller chunks reuse more of a prompt, "
                "larger ones cost less bookkeeping per token. "
                f"Default: {DEFAULT_CHUNK_SIZE}."
            )
        ),
        Range(gt=0),
    ] = DEFAULT_CHUNK_SIZE
    pcr_lookahead_window: A[
        int,
        Arg(
            help=(
                "Look-ahead LRU: chunks that the first N requests of the waiting queue "
                "will reuse are evicted only after every other chunk. 0 is plain LRU. "
                f"Default: {DEFAULT_LOOKAHEAD_WINDOW}."
            )
        ),
        Range(ge=0),
    ] = DEFAULT_LOOKAHEAD_WINDOW
    pcr_dram_gb: A[
        float,
        Arg(
            help=(
                "Size in GB of PCR's host-memory tier (shared memory, pinned on CUDA), per "
                "TP rank: with --tp N the server takes N times this much. Chunks evicted "
                "from the GPU KV pool are kept there and copied back when a request that "
                "reuses them is admitted, instead of being recomputed. 0 disables the tier. "
                f"Default: {DEFAULT_DRAM_GB:g}."
            )
        ),
        Range(ge=0, unit="GB"),
    ] = DEFAULT_DRAM_GB
    pcr_layerwise: A[
        str,
        Arg(
            help=(
                "Which host-tier copies overlap with the forward pass, one layer at a "
                "time: 'load' (chunks coming back from host memory: layer i's attention "
                "waits only for layer i), 'offload' (a prefill's new chunks are copied to "
                "host memory right after each layer writes them, so evicting them later "
                "needs no copy), 'both', or 'off' (whole-chunk copies when a chunk is "
                "admitted or evicted). Needs --pcr-dram-gb. "
                f"Default: {AUTO_LAYERWISE}: {DEFAULT_LAYERWISE}, or offload when a prefill CUDA graph "
                "is on (--cuda-graph-backend-prefill), whose replay has not been shown to wait for "
                "layer-wise loads yet."
            ),
            choices=[AUTO_LAYERWISE, *LAYERWISE_CHOICES],
        ),
    ] = AUTO_LAYERWISE
    pcr_ssd_path: A[
        Optional[str],
        Arg(
            help=(
                "Directory of PCR's SSD tier (created 0700 if missing; an existing one is never "
                "chmod-ed and is refused if other users may write it, unless it is sticky like "
                "/tmp). Several servers may share it: each writes only its own writer slot, "
                "reads the others', and serves only records authenticated with the store's "
                "key; chunks are namespaced by model, KV dtype, layout, chunk size, TP rank and "
                "cache salt. Chunks leaving host memory persist there, come back on a hit and "
                "survive restarts. Needs --pcr-ssd-gb and --pcr-dram-gb. Inspect it with: "
                "python -m pcr_tools.store_cli usage DIR."
            )
        ),
    ] = None
    pcr_ssd_gb: A[
        float,
        Arg(
            help=(
                "Size in GB of PCR's SSD tier under --pcr-ssd-path, per TP rank (each rank "
                "stores its share of the KV); reduced (with a warning) to what the disk has "
                "free above --pcr-ssd-reserve-gb, and with --tp to the smallest rank's. 0: "
                f"no SSD tier. Default: {DEFAULT_SSD_GB:g}."
            )
        ),
        Range(ge=0, unit="GB"),
    ] = DEFAULT_SSD_GB
    pcr_ssd_reserve_gb: A[
        float,
        Arg(
            help=(
                "Free space in GB the SSD tier leaves on its disk: a write that would go below "
                f"it fails like a full disk (write-back stops, serving goes on). Default: {DEFAULT_SSD_RESERVE_GB:g}."
            )
        ),
        Range(ge=0, unit="GB"),
    ] = DEFAULT_SSD_RESERVE_GB
    pcr_prefetch_window: A[
        int,
        Arg(
            help=(
                "Queue-based prefetch: each scheduler step, SSD-resident chunks that the first N "
                "waiting requests will reuse are read into host memory by PCR's I/O process "
                "before those requests run. 0 disables prefetch: SSD chunks are then read when "
                "their request comes up for admission, and it waits in the queue for them, at "
                f"most about what recomputing them would take. Default: {DEFAULT_PREFETCH_WINDOW}."
            )
        ),
        Range(ge=0),
    ] = DEFAULT_PREFETCH_WINDOW
    pcr_prefetch_budget_mb: A[
        int,
        Arg(
            help=(
                "Most chunk bytes (MB) the prefetcher keeps in flight from SSD to host memory; "
                "reads in flight plus prefetched chunks not used yet never exceed half the "
                f"host tier. Default: {DEFAULT_PREFETCH_BUDGET_MB}."
            )
        ),
        Range(ge=0),
    ] = DEFAULT_PREFETCH_BUDGET_MB
    pcr_hint_budget_mb: A[
        int,
        Arg(
            help=(
                "KV hints: most chunk bytes (MB) in flight from SSD for hinted chains (requests "
                "carrying a 'pcr.lookahead_prefetch' kv_hints action: the chains of a prompt not "
                "sent yet). They take what the waiting queue's prefetch leaves of "
                "--pcr-prefetch-budget-mb, never more than this; 0 ignores hints (a hint-only "
                f"request still finishes at once). Default: {DEFAULT_HINT_BUDGET_MB}."
            )
        ),
        Range(ge=0),
    ] = DEFAULT_HINT_BUDGET_MB
    pcr_hint_max_ttl_s: A[
        float,
        Arg(
            help=(
                "KV hints: a hint is dropped after its payload's ttl_s, at most this many seconds; "
                "earlier when a request covering it (or another candidate of its group, in its "
                "tenant: the request's cache_salt, else its extra_key) is admitted, or when over "
                "256 hints are live on the server (the oldest of the tenant holding the most). "
                f"Default: {DEFAULT_HINT_MAX_TTL_S:g}."
            )
        ),
        Range(gt=0),
    ] = DEFAULT_HINT_MAX_TTL_S
    pcr_hint_rate: A[
        float,
        Arg(
            help=(
                "KV hints: most hints registered per second per tenant (the request's cache_salt, "
                "else its extra_key; a token bucket of twice as many each), and four times as many "
                "per caller (the HTTP connection's peer host, whatever salts it sends); hints over "
                f"either are answered and dropped. Default: {DEFAULT_HINT_RATE:g}."
            )
        ),
        Range(gt=0),
    ] = DEFAULT_HINT_RATE
    pcr_hint_to_device: A[
        str,
        Arg(
            help=(
                "KV hints: hinted chunks already in host memory are also loaded into free device "
                "slots before their request arrives, while at least half of the device KV pool "
                "stays free (they stay ordinary cached chunks, evicted like any other, so they "
                "never keep a request out; counted as hint_promoted, and again as hint_in_time "
                "or hint_wasted). 'on'; 'auto': on where the KV pool is on a GPU (where it is "
                "meant to take the host-to-device copy off the final request's path; not "
                f"measured yet); 'off'. Default: {DEFAULT_HINT_TO_DEVICE}."
            ),
            choices=HINT_TO_DEVICE_CHOICES,
        ),
    ] = DEFAULT_HINT_TO_DEVICE
    pcr_ssd_write: A[
        str,
        Arg(
            help=(
                "When chunks are written to the SSD tier: 'through' (in the background as "
                "soon as they reach host memory, so evicting them from host memory is free) "
                "or 'on-evict' (when host eviction first picks them: less disk traffic, but a "
                "chunk leaves host memory only once its write is done, and eviction never "
                "waits for it, so under bursts chunks leaving the GPU may find no host slot "
                f"and be dropped). Default: {DEFAULT_SSD_WRITE}."
            ),
            choices=SSD_WRITE_CHOICES,
        ),
    ] = DEFAULT_SSD_WRITE
    pcr_ssd_durability: A[
        str,
        Arg(
            help=(
                "When a chunk written to the SSD tier counts as stored: 'record' (its file and "
                "directory are fsynced before the write completes: a power cut loses no chunk "
                "the cache counts on), 'batch' (up to 16 queued writes share their directory "
                "fsyncs, then complete together) or 'none' (no fsync: a power cut may lose recent "
                "chunks; whatever it tore fails verification and is recomputed, never served). "
                "'record' is the default because in bench/ssd_store_bench.py 'batch' wrote no "
                "faster and 'none' gains only page-cache speed at the cost of that promise. "
                f"Default: {DEFAULT_SSD_DURABILITY}."
            ),
            choices=SSD_DURABILITY_CHOICES,
        ),
    ] = DEFAULT_SSD_DURABILITY
    pcr_ssd_read_threads: A[
        int,
        Arg(
            help=(
                "SSD tier: local reads the I/O process runs at once, up to this many (one thread "
                f"each; 1 to {MAX_SSD_READ_THREADS}). A disk serves reads in parallel: an NVMe drive reaches "
                "its bandwidth only with several queued, and a slow or network disk hides its "
                "latency only so. Each read is timed as its share of the disk's busy time, so the "
                "load-or-recompute verdict sees the parallelism reached; reads the remote tier "
                f"answers still go one at a time. Default: {DEFAULT_SSD_READ_THREADS}."
            )
        ),
        Range(ge=1, le=MAX_SSD_READ_THREADS),
    ] = DEFAULT_SSD_READ_THREADS
    pcr_ssd_keep_namespaces: A[
        int,
        Arg(
            help=(
                "SSD tier: how many namespaces this server has left at weight updates (a disk "
                "update moves the tier to the new checkpoint's directory) it keeps on disk for a "
                "rollback. Their bytes count against --pcr-ssd-gb: together they take at most half "
                "of it, and the oldest left are purged first when there are more of them, or more "
                "bytes. An in-memory update's namespace is always purged. 0: purge every namespace "
                f"left. Default: {DEFAULT_SSD_KEEP_NAMESPACES}."
            )
        ),
        Range(ge=0),
    ] = DEFAULT_SSD_KEEP_NAMESPACES
    pcr_doc_reuse: A[
        str,
        Arg(
            help=(
                "Reuse a document's KV wherever it appears in a prompt, not only behind the same "
                "preceding documents. Requests opt in by marking their documents "
                "(sampling_params.custom_params['pcr_doc_bounds'], flat token offsets); others "
                "are served exactly as without this flag. 'concat': each marked document's KV "
                "as computed right after the request's leading tokens is copied and rotated to "
                "its place (no recompute: fastest, and answers differ most from full prefill). "
                "'lego': also recompute each re-placed document's first "
                "--pcr-doc-recompute-tokens tokens in full context (EPIC). 'blend': recompute "
                "the --pcr-doc-recompute-ratio share of re-placed tokens that --pcr-doc-selector "
                "ranks first (CacheBlend: by how far their KV deviates from full prefill's). Recompute modes need the "
                "torch_native or triton attention backend. See docs/document-reuse.md for the accuracy table "
                "before turning any on. Such KV never enters the prefix cache. 'reorder' (exact): "
                "a request whose documents were served before in another order (or begin with a run "
                "of such a sequence) is served in that order, an exact prefix hit; no KV is "
                "approximated, the question stays last, and meta_info['pcr_doc_order'] gives the "
                "order served. Requests may ask for 'off', 'reorder', 'concat' or (on a lego/blend "
                f"server) either. Default: {DEFAULT_DOC_REUSE}."
            ),
            choices=DOC_REUSE_CHOICES,
        ),
    ] = DEFAULT_DOC_REUSE
    pcr_doc_recompute_tokens: A[
        int,
        Arg(
            help=(
                "--pcr-doc-reuse lego: leading tokens of each re-placed document recomputed in "
                "full context (a request may override it with "
                "custom_params['pcr_doc_recompute_tokens']). "
                f"Default: {DEFAULT_DOC_RECOMPUTE_TOKENS}."
            )
        ),
        Range(ge=0),
    ] = DEFAULT_DOC_RECOMPUTE_TOKENS
    pcr_doc_recompute_ratio: A[
        float,
        Arg(
            help=(
                "--pcr-doc-reuse blend: share (0..1) of re-placed document tokens recomputed, "
                "those --pcr-doc-selector ranks first (a request may override it with "
                "custom_params['pcr_doc_recompute_ratio']). "
                f"Default: {DEFAULT_DOC_RECOMPUTE_RATIO}."
            )
        ),
        Range(ge=0, le=1),
    ] = DEFAULT_DOC_RECOMPUTE_RATIO
    pcr_doc_anchor_tokens: A[
        int,
        Arg(
            help=(
                "--pcr-doc-reuse blend: the first N tokens of each re-placed document are "
                "always among the recomputed ones (inside the --pcr-doc-recompute-ratio budget), "
                "the rest picked by --pcr-doc-selector; 0 lets it pick all (a request may override "
                f"it with custom_params['pcr_doc_anchor_tokens']). Default: {DEFAULT_DOC_ANCHOR_TOKENS}."
            )
        ),
        Range(ge=0),
    ] = DEFAULT_DOC_ANCHOR_TOKENS
    pcr_blend_probe_mb: A[
        int,
        Arg(
            help=(
                "--pcr-doc-reuse blend: the most scratch memory (MiB) its probe may need for one "
                "request's selection (activations, gathered keys, one block of attention scores), "
                "estimated before it runs beside the forward in flight; a request that would need "
                "more is recomputed instead. On CUDA it is reserved from the KV pool (with "
                "--pcr-position-mask-mb); elsewhere it comes from free memory. "
                f"Default: {DEFAULT_BLEND_PROBE_MB}."
            )
        ),
    ] = DEFAULT_BLEND_PROBE_MB
    pcr_position_mask_mb: A[
        int,
        Arg(
            help=(
                "Document reuse with permuted rows (lego, blend, concat computing a document in "
                "place): the most memory (MiB) one request's position mask (a byte per query and "
                "key of its extend) may take in a forward; a request whose mask could need more is "
                "recomputed instead. Reserved with --pcr-blend-probe-mb from the KV pool on CUDA. "
                f"Default: {DEFAULT_POSITION_MASK_MB}."
            )
        ),
        Range(ge=1),
    ] = DEFAULT_POSITION_MASK_MB
    pcr_doc_selector: A[
        str,
        Arg(
            help=(
                "--pcr-doc-reuse blend: what picks the recomputed tokens: 'deviation' (CacheBlend: "
                "layer-1 V deviating most from full prefill's), 'gradual' (the CacheBlend paper's "
                "gradual filtering: layer 1 keeps twice the budget, layer 2's deviation picks), "
                "'query' (the tokens the question attends most at layer 1) or 'prophet' (ProphetKV: "
                "the question's attention fused over layers 1-4, the upper ones over the re-placed "
                "KV). A request may override it with custom_params['pcr_doc_selector']. "
                f"Default: {DEFAULT_DOC_SELECTOR} (the most accurate measured on SmolLM2)."
            ),
            choices=DOC_SELECTOR_CHOICES,
        ),
    ] = DEFAULT_DOC_SELECTOR
    pcr_doc_warmup: A[
        str,
        Arg(
            help=(
                "--pcr-doc-reuse: when a document's canonical KV (its KV right after the "
                "request's leading tokens, what other requests reuse) is computed once it is "
                "due (see --pcr-doc-warmup-after). 'request': before the request that marks it "
                "is sent, so that request reuses it too (it waits for about the prefill it "
                "would have done). 'idle': the request is sent at once with what is cached, and "
                "the document is warmed later, one at a time while the server has no request "
                "in flight (never delays a request; on a busy server it may never run). "
                f"Default: {DEFAULT_DOC_WARMUP}."
            ),
            choices=DOC_WARMUP_CHOICES,
        ),
    ] = DEFAULT_DOC_WARMUP
    pcr_doc_warmup_after: A[
        int,
        Arg(
            help=(
                "--pcr-doc-reuse: warm a document from its N-th sighting in marked requests "
                "(per tenant). 1 warms every document the first time a marked request has it; "
                "2 serves a first sighting by plain prefill and warms only documents that recur, "
                "so traffic whose documents never recur costs what it costs without document "
                f"reuse. Default: {DEFAULT_DOC_WARMUP_AFTER}."
            )
        ),
        Range(ge=1),
    ] = DEFAULT_DOC_WARMUP_AFTER
    pcr_doc_max_documents: A[
        int,
        Arg(
            help=(
                "The most documents one request may mark in custom_params['pcr_doc_bounds']; "
                "a request marking more gets HTTP 400 naming this flag. Each marked document "
                "costs its own canonical chain (hashed, matched every scheduler step while the "
                "request waits, stored, and warmed by a prefill of the leading tokens plus the "
                f"document). Checked with or without --pcr-doc-reuse. Default: {DEFAULT_DOC_MAX_DOCUMENTS}."
            )
        ),
        Range(ge=1),
    ] = DEFAULT_DOC_MAX_DOCUMENTS
    pcr_doc_min_tokens: A[
        int,
        Arg(
            help=(
                "The fewest tokens a marked document may have; a request marking a shorter one "
                "gets HTTP 400 naming this flag. A document's fixed costs do not shrink with it "
                "(a warm-up prefill of the leading tokens, a canonical chain padded to whole "
                "--pcr-chunk-size chunks, a match every scheduler step while the request waits), "
                "while what reusing it saves is its own length: one of a few tokens saves almost "
                f"nothing for that price. Default: {DEFAULT_DOC_MIN_TOKENS} (a short sentence; "
                "lower it for shorter documents)."
            )
        ),
        Range(ge=1),
    ] = DEFAULT_DOC_MIN_TOKENS
    pcr_doc_format: A[
        str,
        Arg(
            help=(
                "How documents sent as text (the chat API's 'documents' field, or text plus "
                "documents on /generate, /v1/completions and the Engine) are written into the "
                "prompt when the chat template does not take documents= itself: a format "
                "string with {doc} (the document's text, its title on a line before it), "
                "'\\n' for a new line. Each document is tokenized alone in this format. "
                "Default: 'Document: {doc}\\n\\n'."
            )
        ),
    ] = DEFAULT_DOC_FORMAT
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
