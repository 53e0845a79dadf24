"""The negative controls the docs claim (mostly docs/testing.md), as mutants anyone can rerun.

Each entry breaks, in a copy of the tree, the code a claimed test guards (one exact text
replaced by another) and names the tests that must then fail. ``python -m tests.mutations``
applies them one at a time and reports which were killed. An entry whose original text no
longer occurs exactly once is reported as stale (an error), never skipped: when the guarded
code changes, update the entry with it.

Adding a control: append a :class:`Mutant` to the section of the claim it backs (or a new
section), with the smallest replacement that breaks the behaviour the claim names, and the
narrowest tests that should catch it (a node id, or a file with ``k``). ``kind`` decides how
it runs: ``unit`` (fast, no server), ``kernel`` (Triton, under ``TRITON_INTERPRET=1`` unless
set otherwise) or ``e2e`` (starts real servers: minutes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KINDS = ("unit", "kernel", "e2e")


@dataclass(frozen=True)
class Mutant:
    name: str
    kind: str  # one of KINDS
    file: str  # relative to the repository root
    original: str  # must occur exactly once in ``file``
    replacement: str
    tests: tuple[str, ...]  # pytest node ids or paths, relative to the repository root
    k: Optional[str] = None  # a pytest -k expression narrowing ``tests``
    claim: str = ""  # where the control is claimed (a docs/ page and section, or commit)
    breaks: str = ""  # what the mutant breaks, in words


UNIT = "tests/unit/"
E2E = "tests/e2e/"

MUTANTS: tuple[Mutant, ...] = (
    # ---------------------------------------------------------------- README: "What the tests prove", the main oracle
    Mutant(
        name="oracle-host-load-shifts-tokens",
        kind="e2e",
        file="pcr_sglang/transfer/copy_kv.py",
        original="dev_rows[rows] = words[slots, layer, kv].reshape(chunks * chunk, -1).to(device.device)",
        replacement="dev_rows[rows] = words[slots, layer, kv].roll(1, dims=1).reshape(chunks * chunk, -1)"
                    ".to(device.device)",
        tests=(E2E + "test_http_server.py::test_every_layerwise_setting_serves_host_hits_token_for_token",
               E2E + "test_http_server.py::test_host_tier_serves_evicted_chunks_back_without_recomputing"),
        claim="docs/testing.md, What the tests prove: token-for-token equality with --disable-radix-cache",
        breaks="every chunk loaded from host memory lands one token off (the CPU copy path)",
    ),
    # ---------------------------------------------------------------- README: "Watched go red" (retrieval, hints, warm-up)
    Mutant(
        name="rag-exact-mode-searches-every-landed-cluster",
        kind="unit",
        file="pcr_sglang/rag/lookahead.py",
        original='if self.mode == "exact":\n                mine = [[int(c) for c in row[h]] for row, h in zip(probe, hit)]',
        replacement='if False:\n                mine = [[int(c) for c in row[h]] for row, h in zip(probe, hit)]',
        tests=(UNIT + "rag/test_rag_retriever.py::test_merged_search_equals_faiss_ivf_whatever_the_fast_tier_holds",),
        claim="docs/testing.md, Watched go red: the merged search's identity with faiss",
        breaks="exact mode searches every landed cluster, not only each query's probed ones",
    ),
    Mutant(
        name="rag-unlanded-clusters-searched",
        kind="unit",
        file="pcr_sglang/rag/fast_host.py",
        original='if c in self._clusters and self._clusters[c].state == "landed"]',
        replacement="if c in self._clusters]",
        tests=(UNIT + "rag/test_rag_retriever.py::test_a_cluster_still_copying_is_a_miss_searched_by_faiss",),
        claim="docs/testing.md, Watched go red: a cluster still copying counted as a miss",
        breaks="a search reads clusters still being copied into the fast tier",
    ),
    Mutant(
        name="hint-budget-counts-only-reads-in-flight",
        kind="unit",
        file="pcr_sglang/core/ssd_residency.py",
        original="hinted_held = len(self.unused.hinted)",
        replacement="hinted_held = sum(1 for n in self.unused.hinted if n in self._reading)",
        tests=(UNIT + "sglang_adapter/test_kv_hints.py::test_landed_hinted_chunks_count_against_the_hint_budget_and_never_take_the_queues",),
        claim="docs/testing.md, Watched go red: the hint budget holding landed hinted chunks too",
        breaks="landed hinted chunks no longer count against the hint budget",
    ),
    Mutant(
        name="warmup-ignores-the-sighting-count",
        kind="unit",
        file="pcr_sglang/reuse/warmup.py",
        original="if count < self.policy.after and not now:",
        replacement="if count < 1 and not now:",
        tests=(UNIT + "reuse/test_doc_warmup.py::test_a_document_is_due_from_its_after_th_sighting",
               UNIT + "reuse/test_doc_warmup.py::test_request_mode_after_two_warms_only_recurring_documents_and_waits_for_them"),
        claim="docs/testing.md, Watched go red: the warm-up policy's sighting count",
        breaks="every document is warmed at its first sighting, whatever --pcr-doc-warmup-after says",
    ),
    Mutant(
        name="warmup-idle-drain-ignores-requests-in-flight",
        kind="unit",
        file="pcr_sglang/reuse/tokenizer.py",
        original='if getattr(manager, "rid_to_state", None):',
        replacement="if False:",
        tests=(UNIT + "reuse/test_doc_warmup.py::"
               "test_idle_mode_sends_the_request_at_once_and_warms_one_at_a_time_when_nothing_is_in_flight",),
        claim="docs/testing.md, Watched go red: the idle drain waiting for an empty server",
        breaks="idle warm-ups run while requests are in flight",
    ),
    # ---------------------------------------------------------------- README: Look-ahead retrieval and KV hints
    Mutant(
        name="hint-only-request-skips-document-chains",
        kind="e2e",
        file="pcr_sglang/sglang_adapter/hints.py",
        original="self.docs.canonical_chain_keys(req), doc_payload",
        replacement="[], doc_payload",
        tests=(E2E + "test_doc_reuse.py::test_precomputed_documents_are_served_from_ssd_after_a_restart",),
        claim="docs/lookahead-retrieval.md, KV hints: a hint-only request marking documents reads their canonical chains (red without it)",
        breaks="a hint marking documents reads only the prompt's own chain",
    ),
    Mutant(
        name="flush-keeps-live-hints",
        kind="unit",
        file="pcr_sglang/sglang_adapter/scheduler_side.py",
        original="        self.requests.clear()\n        self.hints.clear()\n",
        replacement="        self.requests.clear()\n",
        tests=(UNIT + "sglang_adapter/test_prefix_cache_adapter.py::test_a_flush_ends_the_live_hints_so_nothing_is_read_back",),
        claim="docs/lookahead-retrieval.md, KV hints: /flush_cache ends every live hint (commit f033188: test seen red)",
        breaks="a hint registered before /flush_cache reads its chain back into the emptied cache",
    ),
    Mutant(
        name="hint-clock-is-each-ranks-own",
        kind="unit",
        file="pcr_sglang/core/agreement.py",
        original="agreed = Agreed(bool(header[4]), bool(header[5]), digests_match=digests_match, hint_clock_ms=header[8])",
        replacement="agreed = Agreed(bool(header[4]), bool(header[5]), digests_match=digests_match, "
                    "hint_clock_ms=view.hint_clock_ms)",
        tests=(UNIT + "core/test_agreement.py::test_a_kv_hint_lives_by_the_clock_the_ranks_agree_on",),
        claim="docs/architecture.md, Tensor parallelism: hints live by the earliest rank's clock (commit c169870: red with "
              "each rank's own clock)",
        breaks="each TP rank expires hints by its own clock",
    ),
    # ---------------------------------------------------------------- README: Document reuse (negative controls)
    Mutant(
        name="doc-reuse-concat-without-rotation",
        kind="e2e",
        file="pcr_sglang/reuse/placement.py",
        original="deltas.append(torch.full((source.numel(),), segment.delta, dtype=torch.int64))",
        replacement="deltas.append(torch.full((source.numel(),), 0, dtype=torch.int64))",
        tests=(E2E + "test_doc_reuse.py::test_concat_outputs_equal_an_independent_reference",),
        claim="docs/document-reuse.md, Document reuse: against an independent transformers implementation (negative controls)",
        breaks="re-placed documents keep the RoPE phase of their canonical position",
    ),
    Mutant(
        name="doc-reuse-recompute-without-position-mask",
        kind="e2e",
        file="pcr_sglang/reuse/rows.py",
        original='rows = current.for_attention(a["req_pool_indices"])',
        replacement="rows = {}",
        tests=(E2E + "test_doc_reuse.py::test_recompute_outputs_equal_an_independent_reference",),
        k="lego",
        claim="docs/document-reuse.md, Document reuse: lego/blend against transformers ('Without the mask applied in the "
              "server, lego failed here')",
        breaks="torch_native's extend runs plain causal attention over a permuted row",
    ),
    Mutant(
        name="doc-reuse-replacement-after-the-forwards-read",
        kind="unit",
        file="pcr_sglang/transfer/engine.py",
        original="self._run_replacements(layer)\n            return",
        replacement="self._run_replacements(layer - 1)\n            return",
        tests=(UNIT + "transfer/test_transfer_engine.py::test_a_replacement_runs_layer_by_layer_after_that_layer_of_the_loads_it_reads",),
        claim="commit a3673a4: engine tests red with the rotation after the forward's read",
        breaks="layer i is re-placed only after the forward has read layer i",
    ),
    Mutant(
        name="queue-prefetch-skips-document-chains",
        kind="unit",
        file="pcr_sglang/sglang_adapter/request_keys.py",
        original="return [own, *self.docs.canonical_chain_nodes(req)]",
        replacement="return [own]",
        tests=(UNIT + "sglang_adapter/test_prefix_cache_adapter.py::test_prefetch_reads_a_waiting_requests_document_chains_from_ssd",),
        claim="commit 39f4168: the queue prefetcher reads a waiting request's documents' chains (fails without it)",
        breaks="the queue prefetch reads only a waiting request's own prefix",
    ),
    Mutant(
        name="accuracy-bench-warm-up-without-the-modes-key",
        kind="unit",
        file="bench/doc_reuse_accuracy.py",
        original="warm = server.generate(mode_request(prompt, spec, **greedy(1)))",
        replacement="warm = server.generate(mode_request(prompt, None, **greedy(1)))",
        tests=(UNIT + "tools/test_doc_reuse_accuracy.py::test_every_request_of_a_mode_measurement_carries_the_modes_key",),
        claim="commit c3b5251: every request of a measurement carries the mode's key (red with a raw body)",
        breaks="the accuracy bench's warm-up request goes without the mode's key",
    ),
    # ---------------------------------------------------------------- README: the Triton position mask
    Mutant(
        name="position-mask-excludes-the-query-itself",
        kind="kernel",
        file="pcr_sglang/reuse/rows.py",
        original="mask = positions.unsqueeze(0) <= positions[prefix:seq_len].unsqueeze(1)\n        masks.append(",
        replacement="mask = positions.unsqueeze(0) < positions[prefix:seq_len].unsqueeze(1)\n        masks.append(",
        tests=("tests/kernels/test_position_mask_triton.py",),
        claim="docs/document-reuse.md, Document reuse: the Triton mask under TRITON_INTERPRET=1 against the torch path",
        breaks="the Triton custom mask hides each query's own key",
    ),
    # ---------------------------------------------------------------- README: Several servers (remote tier)
    Mutant(
        name="remote-idle-thread-never-asks-the-store",
        kind="unit",
        file="pcr_sglang/io/remote_thread.py",
        original="if not self.healthy and time.monotonic() >= self._retry_at:",
        replacement="if False:",
        tests=(UNIT + "tiers/test_remote_store.py::test_an_idle_thread_notices_the_store_coming_back",),
        claim="docs/scale-out.md, Several servers: watched go red, the recovery of an idle server (without the health query)",
        breaks="a down remote tier is retried only when work arrives",
    ),
    Mutant(
        name="remote-adopted-chunks-not-made-recent",
        kind="unit",
        file="pcr_sglang/core/ssd_residency.py",
        original="self.tree.match(iter(keys[:end]))  # the most recent now",
        replacement="pass  # mutant: adopted chunks left least recent",
        tests=(UNIT + "core/test_cache_state.py::test_chunks_a_remote_probe_found_enter_the_ssd_level_past_the_match_only",),
        claim="docs/scale-out.md, Several servers: watched go red, the adopted chunks' recency (without it they evicted "
              "themselves)",
        breaks="chunks adopted from a remote probe are the first the SSD level evicts",
    ),
    # ---------------------------------------------------------------- README: KV cache events
    Mutant(
        name="kv-events-host-removal-left-out",
        kind="unit",
        file="pcr_sglang/core/chunk_tree.py",
        original="self._log(TierEventKind.REMOVED, node, Tier.HOST)",
        replacement="pass  # mutant: no host removal logged",
        tests=(UNIT + "sglang_adapter/test_kv_events.py::test_a_subscriber_mirrors_every_tier_through_500_requests",),
        claim="docs/scale-out.md, KV cache events: watched go red with a host removal left out",
        breaks="a chunk leaving host memory publishes no BlockRemoved",
    ),
    Mutant(
        name="kv-events-reset-remembers-what-it-announced",
        kind="unit",
        file="pcr_sglang/sglang_adapter/kv_events.py",
        original="chunk.held = chunk.announced = Tier(0)",
        replacement="chunk.held = Tier(0)",
        tests=(UNIT + "sglang_adapter/test_kv_events.py::test_a_reset_clears_then_stores_the_persisted_chunks_again",),
        claim="docs/scale-out.md, KV cache events: watched go red with a reset that forgot what it had announced",
        breaks="after AllBlocksCleared the persisted chunks are not stored again",
    ),
    Mutant(
        name="kv-events-parent-removed-before-children",
        kind="unit",
        file="pcr_sglang/core/chunk_tree.py",
        original="for n in reversed(order):  # children before parents",
        replacement="for n in order:  # mutant: parents first",
        tests=(UNIT + "sglang_adapter/test_kv_events.py::test_a_subscriber_mirrors_every_tier_through_500_requests",),
        claim="docs/scale-out.md, KV cache events: watched go red with a parent removed before its children",
        breaks="a dropped subtree is removed parent first",
    ),
    # ---------------------------------------------------------------- README: fault table (crash states)
    Mutant(
        name="store-record-write-without-fsync",
        kind="unit",
        file="pcr_sglang/tiers/ssd_store.py",
        original='            if self.durability == "record":\n                self.ops.fsync(fd)\n            self.ops.close(fd)',
        replacement="            self.ops.close(fd)",
        tests=(UNIT + "tiers/test_store_crash_states.py::"
               "test_every_crash_state_recovers_without_serving_bad_records_or_losing_completed_ones",),
        k="record",
        claim="docs/testing.md, faults: a power cut after any operation of the store's writes (commit d8b78bf: "
              "fsync-removal negative controls)",
        breaks="--pcr-ssd-durability record renames a record into place before its data is durable",
    ),
    # ---------------------------------------------------------------- README: "Weight updates in place" (issue 26, item 1)
    Mutant(
        name="weight-update-flush-restores-the-old-weights-records",
        kind="unit",
        file="pcr_sglang/sglang_adapter/prefix_cache.py",
        original="if pending is not None and self.namespace_mover is not None:",
        replacement="if False:",
        tests=(UNIT + "sglang_adapter/test_weight_updates.py::test_a_flush_after_a_weight_update_restores_nothing_of_the_old_weights",
               UNIT + "sglang_adapter/test_weight_updates.py::test_leaving_an_in_memory_namespace_purges_its_directory"),
        claim="docs/architecture.md, Weight updates in place: the flush after an update restores no SSD record",
        breaks="the flush after a weight update restores every SSD record of the old weights",
    ),
    Mutant(
        name="weight-update-session-end-keeps-the-namespace",
        kind="unit",
        file="pcr_sglang/sglang_adapter/weight_updates.py",
        original="    if namespace is not None:\n        begin(cache, namespace)",
        replacement="    if False:\n        begin(cache, namespace)",
        tests=(UNIT + "sglang_adapter/test_weight_updates.py::test_a_session_that_wrote_the_weights_directly_moves_the_namespace",),
        claim="docs/architecture.md, Weight updates in place: the end of a begin_weight_update session moves too",
        breaks="weights written over P2P/RDMA in a session leave the old weights' SSD records servable",
    ),
    Mutant(
        name="weight-update-rekey-keeps-live-hints",
        kind="unit",
        file="pcr_sglang/sglang_adapter/scheduler_side.py",
        original="        self.keys.forget()\n        self.hints.clear()\n        self.probes.clear()",
        replacement="        self.keys.forget()\n        self.probes.clear()",
        tests=(UNIT + "sglang_adapter/test_weight_updates.py::test_a_rekey_drops_what_was_derived_under_the_old_namespace",),
        claim="docs/architecture.md, Weight updates in place: the keys PCR kept are dropped",
        breaks="a hint registered before an update reads the old weights' chain back from the SSD",
    ),
    Mutant(
        name="weight-update-hook-does-nothing",
        kind="e2e",
        file="pcr_sglang/sglang_adapter/weight_updates.py",
        original='if getattr(cache, "namespace_mover", None) is None or getattr(cache, "namespace", None) is None:',
        replacement="if True:",
        tests=(E2E + "test_fingerprint.py::test_a_weight_update_in_place_never_serves_the_old_weights_kv",),
        claim="docs/architecture.md, Weight updates in place: /update_weights_from_disk to B gets no hit of any tier",
        breaks="the namespace stays the startup one after an update (seen red: cached tokens [704, 464, 704, "
               "736, 592, 720] from A's SSD records where a fresh server on B has none)",
    ),
    Mutant(
        name="lora-adapter-files-not-in-the-namespace",
        kind="unit",
        file="pcr_sglang/sglang_adapter/fingerprint.py",
        original="                                            adapters=adapters_text(server_args)),",
        replacement="                                            adapters=\"\"),",
        tests=(UNIT + "sglang_adapter/test_fingerprint.py::test_a_retrained_adapter_at_the_same_path_changes_the_server_namespace",),
        claim="docs/architecture.md, cache namespace: the files of every startup LoRA adapter",
        breaks="a retrained adapter saved at the same path keeps the old adapter's namespace",
    ),
    Mutant(
        name="pipeline-parallelism-accepted",
        kind="unit",
        file="pcr_sglang/sglang_adapter/refusals.py",
        original='    if int(getattr(x.cfg, "pp_size", 1) or 1) > 1:',
        replacement="    if False:",
        tests=(UNIT + "sglang_adapter/test_refusals.py::test_pipeline_parallelism_is_refused",),
        claim="docs/flags.md, What --enable-pcr refuses: --pp-size > 1",
        breaks="--pp-size 2 is served with one namespace for every stage",
    ),
    # ---------------------------------------------------------------- README: "Trust model of the remote tier" (item 7)
    Mutant(
        name="remote-bad-object-blocks-good-writes",
        kind="unit",
        file="pcr_sglang/tiers/remote_store.py",
        original="        if self.exists(key) and not self._replace_if_bad(key):",
        replacement="        if self.exists(key):",
        tests=(UNIT + "tiers/test_remote_store.py::test_a_bad_object_under_a_good_name_does_not_block_a_good_write",),
        claim="docs/scale-out.md, Trust model of the remote tier: a garbage object cannot block good writes",
        breaks="an object put first under a chunk's name keeps every good write out",
    ),
    # ---------------------------------------------------------------- README: the CUDA ordering model (issue 26, item 9)
    Mutant(
        name="ordering-side-stream-skips-the-compute-streams",
        kind="unit",
        file="pcr_sglang/transfer/engine.py",
        original="            self._streams.wait_stream(self._stream, stream)",
        replacement="            pass",
        tests=(UNIT + "transfer/test_transfer_ordering.py",),
        k="a_load_into_slots_the_last_forward_read",
        claim="docs/architecture.md, CUDA path: every wait of the engine's CUDA branch is checked by the ordering model",
        breaks="the copy stream writes slots the forward may still be reading",
    ),
    Mutant(
        name="ordering-replacement-before-its-layers-load",
        kind="unit",
        file="pcr_sglang/transfer/engine.py",
        original="                    streams.wait_event(stream, load_event)",
        replacement="                    pass",
        tests=(UNIT + "transfer/test_transfer_ordering.py",),
        k="a_replacement_reads_a_loaded_chain",
        claim="docs/architecture.md, CUDA path: every wait of the engine's CUDA branch is checked by the ordering model",
        breaks="a document's layer is re-placed before that layer's load wrote it",
    ),
    Mutant(
        name="ordering-offload-before-the-forward-wrote-the-layer",
        kind="unit",
        file="pcr_sglang/transfer/engine.py",
        original="            self._streams.wait_stream(self._stream, self._streams.current_stream())",
        replacement="            pass",
        tests=(UNIT + "transfer/test_transfer_ordering.py",),
        k="an_offload_reads_each_layer",
        claim="docs/architecture.md, CUDA path: every wait of the engine's CUDA branch is checked by the ordering model",
        breaks="layer i's offload may run before the forward wrote layer i",
    ),
    Mutant(
        name="ordering-slots-reused-before-the-replacement-read-them",
        kind="unit",
        file="pcr_sglang/transfer/engine.py",
        original="                self._streams.wait_stream(stream, self._replace_stream)",
        replacement="                pass",
        tests=(UNIT + "transfer/test_transfer_ordering.py",),
        k="a_replacement_no_forward_read_is_finished",
        claim="docs/architecture.md, CUDA path: every wait of the engine's CUDA branch is checked by the ordering model",
        breaks="freed slots are rewritten while a re-placement still reads them",
    ),
    # ---------------------------------------------------------------- README: KV hints per tenant (issue 26, item 5)
    Mutant(
        name="hint-groups-shared-by-all-tenants",
        kind="unit",
        file="pcr_sglang/core/hints.py",
        original="    return (hint.tenant, 0, hint.group) if hint.group is not None else (hint.tenant, 1, hint.hint_id)",
        replacement="    return (None, 0, hint.group) if hint.group is not None else (None, 1, hint.hint_id)",
        tests=(UNIT + "sglang_adapter/test_hint_tenants.py::"
               "test_a_tenants_group_consumed_leaves_another_tenants_group_of_the_same_name_alive",),
        claim="docs/lookahead-retrieval.md, KV hints: limits and groups per tenant",
        breaks="tenant A's group 'g' consumed drops tenant B's group 'g'",
    ),
    # ---------------------------------------------------------------- README: a hung remote call (issue 26, item 6)
    Mutant(
        name="remote-watchdog-never-gives-up-on-a-hung-call",
        kind="unit",
        file="pcr_sglang/io/process.py",
        original="        hung_s = self.remote.overdue_s(now) if self.remote is not None else 0.0",
        replacement="        hung_s = 0.0",
        tests=(UNIT + "io/test_remote_watchdog.py::test_a_hung_remote_read_is_failed_while_local_reads_keep_completing",),
        claim="docs/scale-out.md, remote tier: a call past its deadline fails its orders and the client is restarted",
        breaks="a remote read that never returns keeps its host slot filling forever",
    ),
    # ---------------------------------------------------------------- README: Fine-tuning for reuse, selectors
    Mutant(
        name="tune-forward-without-rotation",
        kind="unit",
        file="pcr_tools/tune/served_pattern.py",
        original="return keys * cos + rotated_half * sin",
        replacement="return keys",
        tests=(UNIT + "tools/test_tune.py::test_rotating_keys_composes_with_the_models_rope",),
        claim="docs/document-reuse.md, Fine-tuning for reuse: the training forward re-places keys with the model's RoPE",
        breaks="the training forward leaves documents at their canonical positions",
    ),
    Mutant(
        name="blend-anchors-overrun-the-budget",
        kind="unit",
        file="pcr_sglang/reuse/plan.py",
        original="anchors = leading(recompute.anchor_tokens)[:count] if recompute.anchor_tokens else ()",
        replacement="anchors = leading(recompute.anchor_tokens) if recompute.anchor_tokens else ()",
        tests=(UNIT + "reuse/test_doc_reuse_plan.py::test_blend_anchors_fill_its_budget_in_document_order_and_never_grow_it",),
        claim="docs/flags.md, Flags: anchors are inside the R budget",
        breaks="anchors recompute more than R",
    ),
    Mutant(
        name="blend-anchors-ignored-at-admission",
        kind="e2e",
        file="pcr_sglang/reuse/blend_select.py",
        original='top = torch.topk(scores.float().masked_fill(anchored, float("inf")), count).indices',
        replacement="top = torch.topk(scores.float(), count).indices",
        tests=(E2E + "test_doc_reuse.py::test_blend_on_four_layers_equals_an_independent_reference",),
        k="anchors",
        claim="docs/document-reuse.md, Choosing the recomputed tokens: anchors checked against transformers",
        breaks="the anchors are planned but the pick ranks every token by deviation",
    ),
    Mutant(
        name="blend-gradual-keeps-re-placed-layer-2",
        kind="e2e",
        file="pcr_sglang/reuse/blend_select.py",
        original="            exact.append(second)\n",
        replacement="",
        tests=(E2E + "test_doc_reuse.py::test_blend_on_four_layers_equals_an_independent_reference",),
        k="gradual",
        claim="docs/document-reuse.md, Choosing the recomputed tokens: gradual and prophet checked against transformers",
        breaks="gradual's finalists keep their re-placed layer-2 KV although the probe computed full prefill's",
    ),
    Mutant(
        name="blend-prophet-fuses-layer-1-only",
        kind="e2e",
        file="pcr_sglang/reuse/blend_select.py",
        original="QUERY_LAYERS = 4",
        replacement="QUERY_LAYERS = 1",
        tests=(E2E + "test_doc_reuse.py::test_blend_on_four_layers_equals_an_independent_reference",),
        k="prophet",
        claim="docs/document-reuse.md, Choosing the recomputed tokens: gradual and prophet checked against transformers",
        breaks="prophet ranks by layer 1's attention alone (the query selector)",
    ),
    Mutant(
        name="blend-prophet-reads-gap-slots",
        kind="unit",
        file="pcr_sglang/reuse/blend_select.py",
        original="                               filled if layer > 1 else None)",
        replacement="                               None)",
        tests=(UNIT + "reuse/test_doc_reuse_setup.py::test_prophet_does_not_read_what_gap_slots_hold_above_layer_1",),
        claim="docs/document-reuse.md, Choosing the recomputed tokens: prophet hides gaps above layer 1",
        breaks="the question attends a gap's slots above layer 1 before the forward has written them",
    ),
    # ---------------------------------------------------------------- issue 39, item 4: review N6, N8, N13(a), N14
    Mutant(
        name="io-restart-cancels-orders-of-a-live-process",
        kind="unit",
        file="pcr_sglang/io/supervisor.py",
        original="if self._phase is not _Phase.DOWN and not self._kill_and_wait():",
        replacement="if self._phase is not _Phase.DOWN and not (self._kill_and_wait() or True):",
        tests=(UNIT + "io/test_io_supervisor.py::"
               "test_a_restart_keeps_the_orders_of_a_process_that_does_not_exit_until_it_has",),
        claim="docs/ssd-store.md, The I/O process: a restart onto a new namespace keeps a live process's orders",
        breaks="a restart hands back the orders (and host slots) of an I/O process the kernel has not confirmed dead",
    ),
    Mutant(
        name="ssd-kept-namespaces-unbounded",
        kind="unit",
        file="pcr_sglang/tiers/kept_namespaces.py",
        original="while candidates and (len(candidates) > keep or",
        replacement="while candidates and (len(candidates) > keep + 100 or",
        tests=(UNIT + "sglang_adapter/test_ssd_namespaces.py::"
               "test_at_most_the_kept_namespaces_stay_on_disk_oldest_purged_first",),
        claim="docs/ssd-store.md, Namespaces kept for a rollback: at most --pcr-ssd-keep-namespaces (review N8)",
        breaks="every namespace left at a disk weight update stays on disk (an RL run fills the disk)",
    ),
    Mutant(
        name="ssd-kept-namespaces-not-charged",
        kind="unit",
        file="pcr_sglang/sglang_adapter/factory.py",
        original="max(config.ssd_bytes - kept_bytes, 0)",
        replacement="config.ssd_bytes",
        tests=(UNIT + "sglang_adapter/test_ssd_namespaces.py::test_kept_namespaces_are_charged_to_the_ssd_budget",),
        claim="docs/ssd-store.md, Namespaces kept for a rollback: their bytes are charged to --pcr-ssd-gb (review N8)",
        breaks="the new namespace's store gets all of --pcr-ssd-gb on top of the namespaces kept",
    ),
    Mutant(
        name="ssd-tier-off-only-a-log-line",
        kind="unit",
        file="pcr_sglang/sglang_adapter/metrics.py",
        original="set(1 if state.writes_enabled else 0)",
        replacement="set(1)",
        tests=(UNIT + "sglang_adapter/test_ssd_namespaces.py::"
               "test_the_ssd_tier_switching_its_writes_off_is_a_gauge_and_a_server_info_state",),
        claim="docs/ssd-store.md: the SSD tier switching its writes off is sglang:pcr_ssd_tier_up (review N8)",
        breaks="the gauge says the SSD tier writes after it switched its writes off",
    ),
    Mutant(
        name="remote-record-key-never-rotates",
        kind="unit",
        file="pcr_sglang/tiers/sealed_records.py",
        original="if sealed[0] >= self.seals_per_epoch:",
        replacement="if False:",
        tests=(UNIT + "tiers/test_sealed_records.py::"
               "test_no_key_seals_more_than_its_bound_and_every_epoch_stays_readable",),
        claim="docs/scale-out.md, The remote tier: keys rotate by epoch (review N13)",
        breaks="one AES-GCM key seals records under random nonces without bound",
    ),
    Mutant(
        name="remote-record-opened-under-the-readers-epoch",
        kind="unit",
        file="pcr_sglang/tiers/sealed_records.py",
        original="            self._opening_key(epoch).decrypt_into(",
        replacement="            self._sealing[1].decrypt_into(",
        tests=(UNIT + "tiers/test_sealed_records.py",),
        claim="docs/scale-out.md, The remote tier: records of every epoch stay readable (review N13)",
        breaks="records sealed under another writer's or an earlier epoch are misses",
    ),
    # ---------------------------------------------------------------- issue 39, item 4: review N3, N10, N7, N12, N13(b)
    Mutant(
        name="weight-update-session-begin-keeps-the-namespace",
        kind="unit",
        file="pcr_sglang/sglang_adapter/weight_updates.py",
        original='        return getattr(manager, "_session", None) is None  # SGLang refuses a second open session',
        replacement="        return False",
        tests=(UNIT + "sglang_adapter/test_weight_updates.py::"
               "test_kv_computed_while_a_session_writes_the_weights_is_not_kept_under_the_checkpoints_namespace",),
        claim="docs/architecture.md, Weight updates in place: the opening of a session moves the namespace (review N3)",
        breaks="KV computed while a session writes the weights is kept under the checkpoint's namespace and served "
               "after a rollback",
    ),
    Mutant(
        name="weight-update-session-begin-not-hooked",
        kind="unit",
        file="pcr_sglang/sglang_adapter/weight_updates.py",
        original="WRAPPED_METHODS = (*UPDATE_METHODS, SESSION_BEGIN, SESSION_END, CHECK_WEIGHTS, MEMORY_RESUME)",
        replacement="WRAPPED_METHODS = (*UPDATE_METHODS, SESSION_END, CHECK_WEIGHTS, MEMORY_RESUME)",
        tests=(UNIT + "sglang_adapter/test_weight_updates.py::test_the_plugin_wraps_every_call_that_can_change_the_weights",),
        claim="docs/architecture.md, Weight updates in place: every updater method is wrapped or listed (review N10)",
        breaks="the plugin no longer hooks begin_weight_update",
    ),
    Mutant(
        name="weight-update-hub-id-gets-a-name-only-namespace",
        kind="unit",
        file="pcr_sglang/sglang_adapter/weight_updates.py",
        original="""        if not Path(path).exists():
            raise WeightsNotLocal(f"{path} is not a local file or folder")
        return model_fingerprint(self.model_config, self.model_path, self.revision, self.download_dir,
                                 weights_path=path, adapters=self.adapters, require_files=True)""",
        replacement="""        return model_fingerprint(self.model_config, self.model_path, self.revision, self.download_dir,
                                 weights_path=path, adapters=self.adapters)""",
        tests=(UNIT + "sglang_adapter/test_weight_updates.py::"
               "test_a_disk_update_to_weights_not_on_this_machine_gets_a_namespace_of_its_own",),
        claim="docs/architecture.md, Weight updates in place: a disk update to a hub id gets a namespace of its own "
              "(review N7)",
        breaks="every revision pushed under one hub id shares one name-only namespace after a disk update",
    ),
    Mutant(
        name="name-only-fingerprint-accepted-with-persistent-tiers",
        kind="unit",
        file="pcr_sglang/sglang_adapter/refusals.py",
        original="    if not x.weights_loaded or x.model_config is None or",
        replacement="    if True or x.model_config is None or",
        tests=(UNIT + "sglang_adapter/test_refusals.py::test_weights_not_found_locally_are_refused_with_persistent_tiers",),
        claim="docs/architecture.md, Cache namespace: weights not found locally are refused with the SSD or remote tier "
              "(review N7)",
        breaks="a model PCR cannot find locally gets a name-only namespace on the SSD and remote tiers",
    ),
    Mutant(
        name="merged-model-ignores-the-adapter-config",
        kind="unit",
        file="pcr_tools/models/merged.py",
        original='_CHECKED_FILES = ((ADAPTER_FILE, "adapter_sha256"), (CONFIG_FILE, "adapter_config_sha256"))',
        replacement='_CHECKED_FILES = ((ADAPTER_FILE, "adapter_sha256"),)',
        tests=(UNIT + "tools/test_merged.py::"
               "test_an_edited_adapter_config_is_refused_and_a_merged_folder_never_returned_stale",),
        claim="pcr_tools/models/merged.py: adapter_config.json is checked and stamped like the weights (review N12)",
        breaks="an edited adapter_config.json is merged without notice and a merged folder is returned stale",
    ),
    Mutant(
        name="remote-write-through-under-an-in-memory-namespace",
        kind="unit",
        file="pcr_sglang/sglang_adapter/remote_follow.py",
        original="    on = shared(namespace)\n",
        replacement="    on = True\n",
        tests=(UNIT + "sglang_adapter/test_remote_follow.py",),
        claim="docs/scale-out.md: nothing is written through under an in-memory update's namespace (review N13b)",
        breaks="every RL step's nonce namespace writes objects no server can read into the fleet's remote store",
    ),
    Mutant(
        name="remote-write-through-while-a-nonce-namespace-is-pending",
        kind="unit",
        file="pcr_sglang/sglang_adapter/weight_updates.py",
        original="    leave_for_pending(cache, namespace)  # an in-memory update's keys: nothing more to the remote tier",
        replacement="    pass",
        tests=(UNIT + "sglang_adapter/test_remote_follow.py",),
        claim="docs/scale-out.md: nothing is written through under an in-memory update's namespace (review N13b)",
        breaks="KV computed between begin_weight_update and the next flush is written through under nonce keys",
    ),
    # ---------------------------------------------------------------- issue 40, item 4: review N4, N5, N11
    Mutant(
        name="calibration-gate-judges-the-server-mode-only",
        kind="unit",
        file="pcr_sglang/reuse/bounds.py",
        original="    if server.gate is not None:\n        server.gate.check(asked)\n",
        replacement="",
        tests=(UNIT + "reuse/test_doc_calibration.py",
               UNIT + "reuse/test_doc_calibration_serving.py::"
               "test_a_refused_request_that_reaches_the_scheduler_is_served_without_reuse"),
        k="refused or tokenizer_answers or reaches_the_scheduler",
        claim="docs/document-reuse.md, A per-model gate: a request outside the calibration gets a 400 (review N4)",
        breaks="a request asking for concat, R=0 or another selector is served in it on a calibrated server",
    ),
    Mutant(
        name="calibration-file-verdicts-trusted-as-written",
        kind="unit",
        file="pcr_sglang/reuse/calibration.py",
        original="                modes[name] = _consistent(written, target)",
        replacement="                modes[name] = written",
        tests=(UNIT + "reuse/test_doc_calibration.py",),
        k="disagree",
        claim="docs/document-reuse.md, A per-model gate: meets and value are recomputed when read (review N11)",
        breaks="a file saying a mode meets the target, or naming a setting that was not measured to meet it, opens "
               "the gate",
    ),
    Mutant(
        name="calibration-not-rechecked-after-a-weight-update",
        kind="unit",
        file="pcr_sglang/reuse/setup.py",
        original="    if model_fingerprint != gate.fingerprint:",
        replacement="    if False:",
        tests=(UNIT + "reuse/test_doc_calibration_serving.py::"
               "test_a_weight_update_to_other_weights_stops_document_reuse_and_says_why",),
        claim="docs/document-reuse.md, A per-model gate: reuse stops on weights the file was not measured on (review N5)",
        breaks="after a weight update to other weights, documents are reused at the old weights' K or R",
    ),
    # ---------------------------------------------------------------- docs/document-reuse.md: "Entry points" (documents as text)
    Mutant(
        name="documents-as-text-bounds-off-by-one",
        kind="unit",
        file="pcr_sglang/reuse/documents.py",
        original="            bounds += [len(ids), len(ids) + len(tokens)]",
        replacement="            bounds += [len(ids) + 1, len(ids) + len(tokens)]",
        tests=(UNIT + "reuse/test_documents.py",),
        k="client_builder or placeholder",
        claim="docs/document-reuse.md, Entry points: documents sent as text become the marked-token-id request",
        breaks="each document's marked span starts one token late",
    ),
    Mutant(
        name="documents-as-text-min-tokens-unchecked",
        kind="unit",
        file="pcr_sglang/reuse/documents.py",
        original="            if limits is not None and len(tokens) < limits.min_tokens:",
        replacement="            if False:",
        tests=(UNIT + "reuse/test_documents.py",),
        k="limits",
        claim="docs/document-reuse.md, Entry points: the limits of marked token prompts, naming the document",
        breaks="a document shorter than --pcr-doc-min-tokens is marked",
    ),
    Mutant(
        name="documents-as-text-template-index-marked",
        kind="unit",
        file="pcr_sglang/reuse/documents.py",
        original="        start, end = rendered.index(marks[0]), rendered.index(text_mark) + len(text_mark)",
        replacement="        start, end = (cursor if i else rendered.index(marks[0])), rendered.index(text_mark) + len(text_mark)",
        tests=(UNIT + "reuse/test_documents.py",),
        k="takes_documents",
        claim="docs/document-reuse.md, Entry points: a documents= template's running index is not marked",
        breaks="what a RAG template writes before each document (its index) is marked with it: no reuse in "
               "another order",
    ),
    Mutant(
        name="chat-documents-bounds-dropped",
        kind="e2e",
        file="pcr_sglang/reuse/chat.py",
        original="    sampling[\"custom_params\"] = {**(custom or {}), DOC_BOUNDS_PARAM: list(job.marked.doc_bounds)}",
        replacement="    sampling[\"custom_params\"] = custom",
        tests=(E2E + "test_doc_reuse.py",),
        k="openai_chat_documents",
        claim="docs/document-reuse.md: the chat example reuses every document in another order",
        breaks="chat documents are rendered into the prompt but not marked: nothing is reused",
    ),
    Mutant(
        name="reused-documents-reported-as-exact-hits",
        kind="e2e",
        file="pcr_sglang/reuse/usage.py",
        original="    return split_details(result, getattr(req, _ATTR, 0))",
        replacement="    return result",
        tests=(E2E + "test_doc_reuse.py",),
        k="report_reuse_apart",
        claim="docs/document-reuse.md, Entry points: How much was reused (a composed hit is never an exact one)",
        breaks="reused document tokens count as host-tier exact hits in meta_info and sglang:cached_tokens_total",
    ),
)


def by_name() -> dict[str, Mutant]:
    return {m.name: m for m in MUTANTS}
