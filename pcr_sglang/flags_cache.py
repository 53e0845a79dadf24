"""PCR's flags for the cache itself, its host and SSD tiers, prefetch and KV hints.

The first group of the ``pcr`` namespace (``pcr_sglang.flags.PcrFlags`` derives from it,
through ``flags_documents.DocumentFlags``): its fields come first in ``--help``, in the
order declared here. A group is a base class rather than a struct of its own because
SGLang reads one flat namespace of fields (``ServerArgs`` collects ``PcrFlags``'s fields,
inherited ones first).

Imported while ``sglang.srt.server_args`` itself is being imported: it may import only
msgspec, SGLang's argument helpers and modules that import nothing.
"""

from __future__ import annotations

from typing import Optional

import msgspec
from sglang.srt.arg_groups.arg_utils import A, Arg

from pcr_sglang.flags_range import Range

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


class CacheFlags(msgspec.Struct):
    """The cache, its tiers, prefetch and KV hints: the flags ``--help`` lists first."""

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
