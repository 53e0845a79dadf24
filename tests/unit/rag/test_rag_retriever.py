"""The retriever (``pcr_client.rag``): the IVF datastore, the host fast tier, the budget
fill and the merged search, on random vectors (no embedder)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pcr_client.rag.budget import BudgetModel, fill_budget
from pcr_client.rag.fast_device import DeviceClusterTier, make_fast_tier
from pcr_client.rag.fast_host import HostClusterTier, top_k
from pcr_client.rag.ivf import ClusterTable, DatastoreError, IVFDatastore, normalized
from pcr_client.rag.lookahead import LookaheadRetriever, merge_top_k

DIM, NLIST, NPROBE, K = 24, 32, 4, 5


@pytest.fixture(scope="module")
def vectors():
    rng = np.random.default_rng(7)
    # Loosely clustered data: clusters differ in size, and IVF at NPROBE misses true
    # neighbours for about half the queries (so searching other clusters changes results).
    centres = rng.standard_normal((40, DIM))
    return (centres[rng.integers(0, 40, 4000)] + 1.5 * rng.standard_normal((4000, DIM))).astype(np.float32)


@pytest.fixture(scope="module")
def datastore(vectors):
    return IVFDatastore.build(vectors, NLIST, seed=3, ids=np.arange(len(vectors)) * 10 + 1)


@pytest.fixture(scope="module")
def queries(vectors):
    rng = np.random.default_rng(11)
    picks = vectors[rng.integers(0, len(vectors), 200)]
    return normalized(picks + 0.5 * rng.standard_normal(picks.shape).astype(np.float32))


def _flat_truth(vectors, queries):
    exact = normalized(vectors) @ queries.T
    return [set((np.argsort(-exact[:, q])[:K] * 10 + 1).tolist()) for q in range(len(queries))]


def test_ivf_at_nprobe_is_approximate_on_this_data(datastore, vectors, queries):
    """What makes the identity tests below able to fail: searching clusters IVF does not
    probe changes the results of many queries."""
    _, ids = datastore.search(queries, K, NPROBE)
    truth = _flat_truth(vectors, queries)
    assert sum(set(ids[q]) != truth[q] for q in range(len(queries))) > len(queries) // 4


def _assert_same_as_ivf(result_d, result_i, ref_d, ref_i):
    """Id sets equal faiss's; a tie at the k-th score is the one legal difference."""
    for row in range(len(ref_i)):
        if set(result_i[row]) != set(ref_i[row]):
            extra = set(result_i[row]) ^ set(ref_i[row])
            kth = ref_d[row][-1]
            tied = [d for d, i in zip(np.r_[result_d[row], ref_d[row]], np.r_[result_i[row], ref_i[row]]) if i in extra]
            assert all(abs(d - kth) < 1e-6 for d in tied), (row, result_i[row], ref_i[row])
        np.testing.assert_allclose(np.sort(result_d[row]), np.sort(ref_d[row]), atol=1e-5)


def test_the_table_holds_each_cluster_as_the_index_does(datastore):
    table = datastore.table
    assert table.offsets[-1] == datastore.index.ntotal
    for cluster in range(NLIST):
        size = table.size(cluster)
        probe = np.full((1, 1), cluster, np.int64)
        # Searching one cluster with k = its size returns exactly its ids.
        _, ids = datastore.search_preassigned(table.codes[table.rows(cluster)][:1], max(size, 1), probe)
        assert set(ids[0][ids[0] >= 0]) == set(table.ids[table.rows(cluster)]), cluster


def test_saved_and_memory_mapped_the_datastore_searches_the_same(datastore, queries, tmp_path):
    datastore.save(tmp_path)
    mapped = IVFDatastore.load(tmp_path, mmap=True)
    assert isinstance(mapped.table.codes, np.memmap)
    ref = datastore.search(queries, K, NPROBE)
    got = mapped.search(queries, K, NPROBE)
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_array_equal(np.asarray(mapped.table.ids), datastore.table.ids)


def test_a_broken_datastore_directory_is_a_clear_error(datastore, tmp_path):
    with pytest.raises(DatastoreError, match="is not a datastore"):
        IVFDatastore.load(tmp_path / "nowhere")
    datastore.save(tmp_path)
    (tmp_path / "meta.json").write_text('{"version": 99}')
    with pytest.raises(DatastoreError, match="format 99"):
        IVFDatastore.load(tmp_path)
    datastore.save(tmp_path)
    np.save(tmp_path / "ids.npy", np.zeros(3, np.int64))
    with pytest.raises(DatastoreError, match="the table holds"):
        IVFDatastore.load(tmp_path)


# ------------------------------------------------------------------ the fast tier
class GatedCodes:
    """A table's codes whose reads of some rows block until released: clusters in flight."""

    def __init__(self, codes: np.ndarray, gated_rows: range):
        self.codes = codes
        self.shape = codes.shape
        self.gated = gated_rows
        self.release = threading.Event()

    def __getitem__(self, key):
        if isinstance(key, slice) and key.start in self.gated:
            self.release.wait(10)
        return self.codes[key]

    def __len__(self):
        return len(self.codes)


@pytest.fixture(params=["host", "device"])
def tier_kind(request) -> str:
    """Every fast-tier test runs on the host tier and on the device tier (a torch buffer on
    the CPU here; the same class with a CUDA stream and events on a GPU)."""
    return request.param


def _make_tier(kind, table, capacity_bytes, page_rows) -> HostClusterTier:
    if kind == "device":
        return DeviceClusterTier(table, capacity_bytes, device="cpu", page_rows=page_rows)
    return HostClusterTier(table, capacity_bytes, page_rows=page_rows)


def _tier(datastore, kind, capacity_bytes=None, codes=None, page_rows=64) -> HostClusterTier:
    table = datastore.table if codes is None else ClusterTable(codes, datastore.table.ids, datastore.table.offsets)
    return _make_tier(kind, table, capacity_bytes or 64 << 20, page_rows)


@pytest.mark.parametrize("contents", ["empty", "full", "partial", "outside-probes"])
def test_merged_search_equals_faiss_ivf_whatever_the_fast_tier_holds(datastore, queries, contents, tier_kind):
    rng = np.random.default_rng(hash(contents) % 1000)
    _, probes = datastore.probe(queries, NPROBE)
    probed = sorted({int(c) for c in probes.ravel()})
    held = {
        "empty": [],
        "full": list(range(NLIST)),
        "partial": sorted(rng.choice(NLIST, NLIST // 3, replace=False).tolist()),
        "outside-probes": [c for c in range(NLIST) if c not in probed[: len(probed) // 2]],
    }[contents]
    tier = _tier(datastore, tier_kind)
    try:
        tier.submit(held)
        assert tier.wait_landed(held, timeout_s=10)
        retriever = LookaheadRetriever(datastore, embed=None, nprobe=NPROBE, k=K, tier=tier)
        got = retriever.search_vectors(queries)
        ref = datastore.search(queries, K, NPROBE)
        _assert_same_as_ivf(got.distances, got.ids, *ref)
        expected_hits = sum(int(c) in held for c in probes.ravel())
        assert got.stats.hits == expected_hits and got.stats.probed == probes.size
    finally:
        tier.close()


def test_a_cluster_still_copying_is_a_miss_searched_by_faiss(datastore, queries, tier_kind):
    table = datastore.table
    gated = 5
    codes = GatedCodes(np.asarray(table.codes), range(int(table.offsets[gated]), int(table.offsets[gated + 1])))
    tier = _tier(datastore, tier_kind, codes=codes, page_rows=10_000)  # one page per cluster: one gated read
    try:
        others = [c for c in range(NLIST) if c != gated]
        tier.submit(others)
        assert tier.wait_landed(others, timeout_s=10)
        tier.submit([gated])  # landed and in flight together
        assert tier.is_resident(gated) and not tier.is_landed(gated)
        retriever = LookaheadRetriever(datastore, embed=None, nprobe=NPROBE, k=K, tier=tier)
        _, probes = datastore.probe(queries, NPROBE)
        got = retriever.search_vectors(queries)
        _assert_same_as_ivf(got.distances, got.ids, *datastore.search(queries, K, NPROBE))
        assert got.stats.in_flight == int((probes == gated).sum()) > 0
        assert got.stats.hits == probes.size - got.stats.in_flight  # everything else came from the tier
    finally:
        codes.release.set()
        tier.close()


def test_superset_mode_never_recalls_less_than_ivf(datastore, queries, vectors, tier_kind):
    tier = _tier(datastore, tier_kind)
    try:
        held = list(range(0, NLIST, 2))
        tier.submit(held)
        assert tier.wait_landed(held, timeout_s=10)
        retriever = LookaheadRetriever(datastore, embed=None, nprobe=NPROBE, k=K, tier=tier, mode="superset")
        got = retriever.search_vectors(queries)
        ref_d, ref_i = datastore.search(queries, K, NPROBE)
        truth = _flat_truth(vectors, queries)
        assert sum(len(truth[q] & set(got.ids[q])) for q in range(len(queries))) > sum(
            len(truth[q] & set(ref_i[q])) for q in range(len(queries))
        )  # it searched more
        for row in range(len(queries)):
            assert np.all(got.distances[row] >= ref_d[row] - 1e-5)  # rank by rank, never worse
            assert len(truth[row] & set(got.ids[row])) >= len(truth[row] & set(ref_i[row]))
    finally:
        tier.close()


def test_eviction_is_lru_and_spares_pinned_protected_and_copying_clusters(datastore, tier_kind):
    table = datastore.table
    sizes = [table.size(c) for c in range(NLIST)]
    page_rows = max(sizes)  # every cluster takes one page
    tier = _make_tier(tier_kind, table, 3 * page_rows * (DIM * 4 + 8), page_rows)
    try:
        assert tier.submit([0, 1, 2]) == [0, 1, 2]
        assert tier.wait_landed([0, 1, 2], timeout_s=10)
        with tier.pinned([0]) as pinned:
            assert set(pinned) == {0}
            assert tier.submit([3], protect=[1]) == [3]  # 0 pinned, 1 protected: 2 goes
            assert not tier.is_resident(2) and tier.is_resident(0) and tier.is_resident(1)
            assert tier.submit([4], protect=[1, 3]) == []  # nothing left that may go
            assert tier.stats.skipped_full == 1
        assert tier.wait_landed([3], timeout_s=10)
        # Reading 0 made it recent: 1 (protected before, never read) is the least recent.
        assert tier.submit([4], protect=[3]) == [4]
        assert not tier.is_resident(1) and tier.is_resident(0)
        assert tier.stats.evicted == 2
    finally:
        tier.close()


def test_the_tier_copies_from_a_memory_mapped_table(datastore, tmp_path, tier_kind):
    datastore.save(tmp_path)
    mapped = IVFDatastore.load(tmp_path, mmap=True)
    tier = _make_tier(tier_kind, mapped.table, 8 << 20, 32)
    try:
        tier.submit([2, 9])
        assert tier.wait_landed([2, 9], timeout_s=10)
        with tier.pinned([2, 9]) as pinned:
            q = np.asarray(mapped.table.codes[mapped.table.rows(9)][:1])
            d, i = tier.search(q, [[2, 9]], 3, pinned)
        assert i[0][0] == mapped.table.ids[mapped.table.rows(9)][0]
        assert tier.stats.bytes_copied == mapped.table.nbytes(2) + mapped.table.nbytes(9)
        assert tier.stats.bandwidth_bytes_s > 0
    finally:
        tier.close()


def test_the_fast_tier_kind_is_chosen_or_refused_clearly(datastore):
    import torch

    tier = make_fast_tier(datastore.table, 1 << 20, "auto", page_rows=64)
    try:
        assert isinstance(tier, DeviceClusterTier) == torch.cuda.is_available()
    finally:
        tier.close()
    with pytest.raises(ValueError, match="fast tier must be one of"):
        make_fast_tier(datastore.table, 1 << 20, "disk")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            make_fast_tier(datastore.table, 1 << 20, "gpu")


# ------------------------------------------------------------------ budget and look-ahead
def test_budget_fill_follows_teleRAGs_rules():
    sizes = {1: 40, 2: 30, 3: 100, 4: 20, 5: 10, 6: 10}
    ranked = [[1, 3, 5], [2, 4, 6]]
    resident = {2}
    chosen = fill_budget(ranked, sizes.__getitem__, 75, resident.__contains__)
    # Rank 0 of every query first (2 is resident: free), then rank 1: 3 does not fit and is
    # skipped, 4 does; rank 2: 5 fits, 6 no longer does.
    assert chosen == [1, 4, 5]
    assert sum(sizes[c] for c in chosen) <= 75
    assert fill_budget(ranked, sizes.__getitem__, 75, resident.__contains__) == chosen  # deterministic
    assert fill_budget(ranked, sizes.__getitem__, 0, resident.__contains__) == []


def test_the_budget_is_bandwidth_times_the_stage_time_unless_overridden():
    model = BudgetModel(default_stage_s=2.0)
    assert model.budget_bytes("hyde") == 0  # nothing measured yet
    model.observe_bandwidth(1000.0)
    assert model.budget_bytes("hyde") == 2000
    model.observe_stage("hyde", 4.0)
    assert model.budget_bytes("hyde") == 4000
    model.observe_stage("hyde", 1.0)
    assert 1000 < model.budget_bytes("hyde") < 4000  # a moving average
    assert BudgetModel(bandwidth_bytes_s=10.0, stage_bytes={"subq": 77}).budget_bytes("subq") == 77


def test_lookahead_fills_the_tier_within_its_budget_and_the_search_then_hits(datastore, queries, tier_kind):
    table = datastore.table
    tier = _tier(datastore, tier_kind)
    try:
        budget_bytes = sum(tier.cost(c) for c in range(NLIST)) // 4
        retriever = LookaheadRetriever(
            datastore, embed=None, nprobe=NPROBE, k=K, tier=tier, budget=BudgetModel(stage_bytes={"hyde": budget_bytes})
        )
        ticket = retriever.lookahead_vectors(queries[:1], stage="hyde")
        assert ticket.submitted and sum(tier.cost(c) for c in ticket.submitted) <= budget_bytes
        assert ticket.submitted[0] == ticket.ranked[0][0]  # the best-ranked cluster goes first
        # The prediction is what the input itself retrieves.
        np.testing.assert_array_equal(ticket.predicted_ids, datastore.search(queries[:1], 2 * K, NPROBE)[1])
        assert tier.wait_landed(ticket.submitted, timeout_s=10)
        got = retriever.search_vectors(queries[:1], ticket)
        assert got.stats.hits == got.stats.from_ticket == NPROBE  # the query is its own look-ahead input
        _assert_same_as_ivf(got.distances, got.ids, *datastore.search(queries[:1], K, NPROBE))
        # A second look-ahead for the same input orders none of those again (resident
        # clusters cost nothing: its budget goes further down the ranking).
        again = retriever.lookahead_vectors(queries[:1], stage="hyde")
        assert not set(again.submitted) & set(ticket.submitted)
        assert sum(tier.cost(c) for c in again.submitted) <= budget_bytes
        assert table.nbytes(ticket.submitted[0]) > 0
    finally:
        tier.close()


def test_merge_keeps_the_best_of_both_lists_and_drops_empty_slots():
    d, i = merge_top_k(
        (np.array([[0.9, 0.5, -np.inf]], np.float32), np.array([[0.7, 0.5, 0.1]], np.float32)),
        (np.array([[3, 8, -1]]), np.array([[4, 2, 6]])),
        4,
    )
    assert i.tolist() == [[3, 4, 2, 8]]  # the tie at 0.5 goes to the smaller id
    d, i = merge_top_k((np.full((1, 2), -np.inf, np.float32),), (np.full((1, 2), -1),), 2)
    assert i.tolist() == [[-1, -1]]
    scores, ids = top_k(np.array([1.0, 2.0, 2.0, 0.5], np.float32), np.array([9, 7, 3, 1]), 2)
    assert ids.tolist() == [3, 7]


def test_a_lookahead_without_prefetch_still_predicts_and_copies_nothing(datastore, queries, tier_kind):
    tier = _tier(datastore, tier_kind)
    try:
        retriever = LookaheadRetriever(
            datastore, embed=None, nprobe=NPROBE, k=K, tier=tier, budget=BudgetModel(stage_bytes={"hyde": 1 << 30})
        )
        ticket = retriever.lookahead_vectors(queries[:1], stage="hyde", prefetch=False)
        assert ticket.submitted == [] and tier.stats.submitted == 0
        np.testing.assert_array_equal(ticket.predicted_ids, datastore.search(queries[:1], 2 * K, NPROBE)[1])
    finally:
        tier.close()


def test_a_lookahead_without_prediction_searches_nothing(datastore, queries, monkeypatch):
    """Without KV hints nothing uses the predicted documents: the look-ahead must not run
    the prediction's faiss search (on a memory-mapped datastore, disk reads beside the
    LLM's generation for nothing)."""

    def no_search(*args, **kwargs):
        raise AssertionError("the prediction searched the datastore")

    retriever = LookaheadRetriever(datastore, embed=None, nprobe=NPROBE, k=K)
    try:
        monkeypatch.setattr(datastore, "search", no_search)
        ticket = retriever.lookahead_vectors(queries[:2], stage="hyde", predict=False)
        assert ticket.predicted_ids.shape == (2, retriever.predict_k) and (ticket.predicted_ids == -1).all()
    finally:
        retriever.close()


@pytest.mark.parametrize("hints", [True, False])
def test_a_pipeline_predicts_documents_only_when_it_sends_hints(hints):
    from types import SimpleNamespace

    from pcr_client.rag.pipelines import PipelineConfig, Pipelines

    calls = []
    retriever = SimpleNamespace(lookahead=lambda query, **kwargs: calls.append(kwargs))
    hinter = SimpleNamespace(tokenizer=None)
    pipelines = Pipelines(
        retriever, ["doc"], backend=None, hinter=hinter, config=PipelineConfig(lookahead=True, hints=hints)
    )
    pipelines._lookahead("question", "hyde")
    assert calls == [{"stage": "hyde", "prefetch": True, "predict": hints}]


def test_similar_questions_are_grouped_together():
    from pcr_client.rag.pipelines import group_queries

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(16), rng.standard_normal(16)
    vectors = np.stack([a, b + 0.01, a + 0.01, b, a - 0.01, b - 0.01]).astype(np.float32)
    groups = group_queries(vectors, 3)
    assert sorted(map(sorted, groups)) == [[0, 2, 4], [1, 3, 5]]
    assert group_queries(vectors, 3) == groups  # deterministic
    assert sorted(i for g in group_queries(vectors, 4) for i in g) == list(range(6))
    with pytest.raises(ValueError, match="group_size"):
        group_queries(vectors, 0)


def test_the_final_prompt_keeps_retrieval_order():
    from pcr_client.rag.pipelines import render_rag_prompt

    prompt = render_rag_prompt(["first doc ", "second doc"], "Why?")
    assert prompt.index("first doc") < prompt.index("second doc") < prompt.index("Question: Why?")
    assert prompt.endswith("\nAnswer:")


def test_a_marked_prompt_is_hinted_as_the_final_request_sends_it(tokenizer):
    """With marked documents the hint goes as token ids with the documents' bounds, the
    same ones the DSL endpoint sends for the final prompt (so the hinted chains, the
    prompt's and each document's canonical one, are the final request's); without a
    tokenizer a marked prompt cannot be hinted, and the markers strip to the plain prompt."""
    from pcr_client.frontend import marked_input, strip_markers
    from pcr_client.rag.pipelines import KVHinter, render_rag_prompt
    from pcr_sglang.reuse.bounds import DOC_BOUNDS_PARAM

    docs = ["The Nile is a river in Africa.", "Mount Fuji is a volcano in Japan."]
    marked = render_rag_prompt(docs, "Which is older?", mark_documents=True)
    assert strip_markers(marked) == render_rag_prompt(docs, "Which is older?")
    hinter = KVHinter("http://127.0.0.1:1", tokenizer=tokenizer)
    try:
        fields = hinter._prompt_fields(marked)
        ids, bounds = marked_input(tokenizer, marked)
        assert fields["input_ids"] == ids and fields["sampling_params"]["custom_params"] == {DOC_BOUNDS_PARAM: bounds}
        assert len(bounds) == 4 and fields["sampling_params"]["max_new_tokens"] == 0
        assert tokenizer.decode(ids[bounds[2] : bounds[3]]).startswith("Document: Mount Fuji")
        assert hinter._prompt_fields(strip_markers(marked))["text"] == strip_markers(marked)
    finally:
        hinter.close()
    plain = KVHinter("http://127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match="tokenizer"):
            plain._prompt_fields(marked)
    finally:
        plain.close()
