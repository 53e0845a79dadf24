"""tests/gpu/gpu_retrieval_check.py runs on the CPU (so it is ready when a GPU is lent) and its
search part checks what it claims: the merged search through the device tier equals
faiss's IVF search."""

from __future__ import annotations

import json

import numpy as np

from tests.gpu import gpu_retrieval_check


def test_the_gpu_retrieval_check_runs_on_the_cpu_and_finds_the_searches_identical(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert (
        gpu_retrieval_check.main(
            [
                "--device",
                "cpu",
                "--vectors",
                "3000",
                "--dim",
                "32",
                "--centres",
                "50",
                "--nlist",
                "16",
                "--nprobe",
                "4",
                "--queries",
                "8",
                "--copy-gb",
                "0.001",
                "--hidden",
                "64",
                "--layers",
                "2",
                "--steps",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [s["identical"] for s in report["search"]] == [8, 8]
    assert report["search"][0]["cluster_hit_rate"] == 1.0 > report["search"][1]["cluster_hit_rate"] > 0
    assert report["copy"]["clusters"] > 0 and report["copy"]["tier_gb_s"] > 0
    assert "not GPU figures" in capsys.readouterr().out


def test_same_results_allows_only_ties_at_the_kth_score():
    ref_d, ref_i = np.array([0.9, 0.5, 0.4], np.float32), np.array([1, 2, 3])
    assert gpu_retrieval_check.same_results(ref_d, ref_i, ref_d, ref_i)
    tie = np.array([0.9, 0.5, 0.4], np.float32), np.array([1, 2, 7])  # 7 scored as 3 did
    assert gpu_retrieval_check.same_results(*tie, ref_d, ref_i)
    worse = np.array([0.9, 0.5, 0.3], np.float32), np.array([1, 2, 7])
    assert not gpu_retrieval_check.same_results(*worse, ref_d, ref_i)
