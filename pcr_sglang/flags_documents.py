"""PCR's flags for document reuse: the re-placement mode, what it recomputes, its scratch
budgets, the warm-up of a document's canonical KV, the limits on marked documents, and
the format documents sent as text are written in.

The second group of the ``pcr`` namespace: ``DocumentFlags`` derives from
``flags_cache.CacheFlags`` so that its fields follow the cache's in ``--help``, in the
order declared here; ``pcr_sglang.flags.PcrFlags`` derives from it. Document reuse's
calibration flags (``--pcr-doc-reuse-calibration``, ``-warn``) are declared there, after
``--pcr-remote``, where ``--help`` lists them.

Imported while ``sglang.srt.server_args`` itself is being imported: it may import only
msgspec, SGLang's argument helpers and modules that import nothing (``reuse/selectors.py``,
``pcr_wire``).
"""

from __future__ import annotations

from sglang.srt.arg_groups.arg_utils import A, Arg

from pcr_sglang.flags_cache import CacheFlags
from pcr_sglang.flags_range import Range
from pcr_sglang.reuse.selectors import DEFAULT_SELECTOR, SELECTORS
from pcr_wire import DEFAULT_DOC_FORMAT

# blend's probe (pcr_sglang.reuse.blend_select): scratch one selection may need at most.
DEFAULT_BLEND_PROBE_MB = 1024
# Permuted rows (pcr_sglang.reuse.rows): the Triton position mask one request may need at most.
DEFAULT_POSITION_MASK_MB = 256
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
# (bench/results/2026-12-01/ragbench-warmup.md at commit d886199); at 90% load, requests
# waiting for warm-ups made 'request' slower than radix ('auto' waits only when alone).
DOC_WARMUP_CHOICES = ["auto", "request", "idle"]
# What ranks blend's recomputed tokens: the one list, which a request chooses from too.
DOC_SELECTOR_CHOICES = list(SELECTORS)
DEFAULT_DOC_SELECTOR = DEFAULT_SELECTOR
DEFAULT_DOC_WARMUP = "auto"
DEFAULT_DOC_WARMUP_AFTER = 2
# What one request may mark (the worst allowed request was measured by bench/doc_bounds_step.py, at commit d886199).
DEFAULT_DOC_MAX_DOCUMENTS = 64
DEFAULT_DOC_MIN_TOKENS = 16


class DocumentFlags(CacheFlags):
    """Document reuse: the flags ``--help`` lists after the cache's."""

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
                "place): the most memory (MiB) a forward's position mask (a byte per query and key "
                "of each batched request's extend) may take. A request whose own part could need "
                "more is recomputed instead; one that could take its batch's mask past it waits for "
                "a later batch. Reserved with --pcr-blend-probe-mb from the KV pool on CUDA. "
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
                "'auto': 'request' when nothing else is in flight (its warm-ups delay no one "
                "else), 'idle' when other requests are (a busy server never waits for warm-ups). "
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
