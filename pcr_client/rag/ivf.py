"""An IVF datastore: faiss ``IndexIVFFlat`` (inner product) plus its cluster-ordered table.

The index answers the searches (``probe``, ``search``, ``search_preassigned``); the table
is the same vectors laid out cluster by cluster (``codes[offsets[c]:offsets[c + 1]]`` are
cluster ``c``'s vectors, ``ids`` their document ids), which is what a look-ahead copies into
a fast tier one cluster at a time (TeleRAG's flattened inverted lists). Saved, both are
plain files: ``index.faiss`` and ``codes.npy``/``ids.npy``/``offsets.npy``; loaded with
``mmap=True`` neither is read into memory (faiss's ``IO_FLAG_MMAP``, numpy's ``mmap_mode``),
so the datastore lives on SSD and what a search touches is read from there.

The table is built from the coarse assignment (a stable sort of ``quantizer.search(X, 1)``)
and checked against the index's inverted-list sizes, not read through faiss's id pointers
(``rev_swig_ptr`` rejects faiss-cpu 1.15.1's ``long *`` ids).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
META_FILE = "meta.json"
FORMAT_VERSION = 1


class DatastoreError(ValueError):
    """A datastore directory that is missing, incomplete or inconsistent."""


def _faiss():
    try:
        import faiss
    except ImportError as e:  # pragma: no cover - installed by scripts/install.sh
        raise ImportError(
            "pcr_client.rag needs faiss-cpu: pip install faiss-cpu==1.15.1 (scripts/install.sh installs it)"
        ) from e
    return faiss


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Float32 rows of unit length (inner product = cosine similarity)."""
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


@dataclass(frozen=True)
class ClusterTable:
    """The vectors in cluster order: cluster ``c`` is rows ``offsets[c]:offsets[c + 1]``."""

    codes: np.ndarray  # [N, d] float32 (in memory or memory-mapped)
    ids: np.ndarray  # [N] int64 document ids
    offsets: np.ndarray  # [nlist + 1] int64

    @property
    def nlist(self) -> int:
        return len(self.offsets) - 1

    @property
    def dim(self) -> int:
        return int(self.codes.shape[1])

    def size(self, cluster: int) -> int:
        return int(self.offsets[cluster + 1] - self.offsets[cluster])

    def nbytes(self, cluster: int) -> int:
        """What copying the cluster moves: its vectors and its ids."""
        return self.size(cluster) * (self.dim * 4 + 8)

    def rows(self, cluster: int) -> slice:
        return slice(int(self.offsets[cluster]), int(self.offsets[cluster + 1]))


class IVFDatastore:
    def __init__(self, index, table: ClusterTable, directory: Optional[Path] = None):
        self.index = index
        self.table = table
        self.directory = directory
        if table.nlist != index.nlist or table.dim != index.d:
            raise DatastoreError(
                f"the cluster table ({table.nlist} clusters, {table.dim} dims) does not "
                f"match the index ({index.nlist} clusters, {index.d} dims)"
            )

    # ------------------------------------------------------------------ build
    @classmethod
    def build(
        cls,
        vectors: np.ndarray,
        nlist: int,
        seed: int = 0,
        ids: Optional[np.ndarray] = None,
        max_points_per_centroid: int = 64,
    ) -> IVFDatastore:
        """Train k-means on ``vectors`` (normalised here) and index them; document ``i`` is
        ``ids[i]`` (default ``i``)."""
        faiss = _faiss()
        x = normalized(vectors)
        n, d = x.shape
        if not 1 <= nlist <= n:
            raise ValueError(f"nlist must be in [1, {n}] for {n} vectors, got {nlist}")
        doc_ids = np.arange(n, dtype=np.int64) if ids is None else np.ascontiguousarray(ids, dtype=np.int64)
        if doc_ids.shape != (n,):
            raise ValueError(f"ids must be one per vector ({n}), got shape {doc_ids.shape}")
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = seed
        index.cp.max_points_per_centroid = max_points_per_centroid
        index.train(x)
        index.add_with_ids(x, doc_ids)
        return cls(index, cls._table(index, x, doc_ids))

    @staticmethod
    def _table(index, x: np.ndarray, doc_ids: np.ndarray) -> ClusterTable:
        _, assign = index.quantizer.search(x, 1)
        order = np.argsort(assign[:, 0], kind="stable")
        counts = np.bincount(assign[:, 0], minlength=index.nlist)
        for cluster in range(index.nlist):
            if index.invlists.list_size(cluster) != counts[cluster]:
                raise DatastoreError(
                    f"cluster {cluster}: the index holds {index.invlists.list_size(cluster)} "
                    f"vectors, the assignment {counts[cluster]}"
                )
        offsets = np.zeros(index.nlist + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return ClusterTable(np.ascontiguousarray(x[order]), doc_ids[order].copy(), offsets)

    # ------------------------------------------------------------------ files
    def save(self, directory: Path) -> None:
        faiss = _faiss()
        directory.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(directory / INDEX_FILE))
        np.save(directory / "codes.npy", np.asarray(self.table.codes))
        np.save(directory / "ids.npy", np.asarray(self.table.ids))
        np.save(directory / "offsets.npy", np.asarray(self.table.offsets))
        meta = {
            "version": FORMAT_VERSION,
            "vectors": int(self.index.ntotal),
            "dim": int(self.index.d),
            "nlist": int(self.index.nlist),
        }
        (directory / META_FILE).write_text(json.dumps(meta))
        self.directory = directory

    @classmethod
    def load(cls, directory: Path, mmap: bool = False) -> IVFDatastore:
        """``mmap=True``: the index's lists and the table stay on disk, read as touched."""
        faiss = _faiss()
        try:
            meta = json.loads((directory / META_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DatastoreError(f"{directory} is not a datastore ({META_FILE}: {e})") from None
        if meta.get("version") != FORMAT_VERSION:
            raise DatastoreError(
                f"{directory}: datastore format {meta.get('version')!r}, this version reads {FORMAT_VERSION}"
            )
        flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
        try:
            index = faiss.read_index(str(directory / INDEX_FILE), flags)
            if not isinstance(index, faiss.IndexIVFFlat) or index.metric_type != faiss.METRIC_INNER_PRODUCT:
                raise DatastoreError(
                    f"{directory / INDEX_FILE} is a {type(index).__name__}, not an inner-product IndexIVFFlat"
                )
            mode = "r" if mmap else None
            table = ClusterTable(
                np.load(directory / "codes.npy", mmap_mode=mode),
                np.load(directory / "ids.npy", mmap_mode=mode),
                np.load(directory / "offsets.npy"),
            )
        except (OSError, RuntimeError, ValueError) as e:
            raise DatastoreError(f"{directory}: cannot read the datastore: {e}") from None
        if int(table.offsets[-1]) != index.ntotal or len(table.ids) != index.ntotal:
            raise DatastoreError(
                f"{directory}: the table holds {int(table.offsets[-1])} vectors, the index {index.ntotal}"
            )
        return cls(index, table, directory)

    # ------------------------------------------------------------------ search
    @property
    def nlist(self) -> int:
        return int(self.index.nlist)

    def probe(self, queries: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``nprobe`` clusters nearest each query, nearest first: (scores, clusters)."""
        return self.index.quantizer.search(normalized(queries), min(nprobe, self.nlist))

    def search(self, queries: np.ndarray, k: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """faiss's IVF search at ``nprobe``: the reference every merged search equals."""
        params = _faiss().SearchParametersIVF(nprobe=min(nprobe, self.nlist))
        return self.index.search(normalized(queries), k, params=params)

    def search_preassigned(
        self, queries: np.ndarray, k: int, clusters: np.ndarray, scores: Optional[np.ndarray] = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Search only ``clusters`` (one row per query, ``-1`` entries skipped)."""
        clusters = np.ascontiguousarray(clusters, dtype=np.int64)
        if clusters.shape[1] == 0:
            n = len(queries)
            return np.full((n, k), -np.inf, np.float32), np.full((n, k), -1, np.int64)
        faiss = _faiss()
        x = normalized(queries)
        n = len(x)
        dq = np.zeros(clusters.shape, np.float32) if scores is None else np.ascontiguousarray(scores, dtype=np.float32)
        distances = np.empty((n, k), np.float32)
        labels = np.empty((n, k), np.int64)
        # The C++ call with per-search parameters: faiss's Python wrapper reads the index's
        # shared ``nprobe`` instead, which concurrent searches with other widths would race on.
        params = faiss.SearchParametersIVF(nprobe=clusters.shape[1])
        self.index.search_preassigned_c(
            n,
            faiss.swig_ptr(x),
            k,
            faiss.swig_ptr(clusters),
            faiss.swig_ptr(dq),
            faiss.swig_ptr(distances),
            faiss.swig_ptr(labels),
            False,
            params,
        )
        return distances, labels
