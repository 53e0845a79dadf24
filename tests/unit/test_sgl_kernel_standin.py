from __future__ import annotations

import pytest
import torch

import sgl_kernel
from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu

pytestmark = pytest.mark.skipif(
    not getattr(sgl_kernel, "IS_PCR_CPU_STANDIN", False), reason="real sgl_kernel installed"
)


def test_copy_all_layer_kv_cache_matches_reference():
    torch.manual_seed(0)
    buffers = [torch.randn(64, 3, 5, dtype=dt) for dt in (torch.float16, torch.float32, torch.bfloat16)]
    reference = [b.clone() for b in buffers]
    src = torch.tensor([3, 17, 17, 40, 5])
    tgt = torch.tensor([60, 2, 41, 9, 63])
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for buf, ref in zip(buffers, reference):
        ref[tgt] = ref[src].clone()
        assert torch.equal(buf, ref)


def test_copy_with_overlapping_sources_and_targets_reads_before_writing():
    buf = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)
    ref = buf.clone()
    src, tgt = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3])
    ptrs = torch.tensor([buf.data_ptr()], dtype=torch.uint64)
    copy_all_layer_kv_cache_cpu(ptrs, torch.tensor([16]), tgt, src)
    ref[tgt] = ref[src].clone()
    assert torch.equal(buf, ref)


def test_assign_req_to_token_pool_matches_reference():
    req_to_token = torch.zeros(4, 16, dtype=torch.int32)
    rows = torch.tensor([2, 0, 3])
    start = torch.tensor([0, 5, 7])
    end = torch.tensor([3, 5, 10])  # the middle request adds nothing
    out = torch.tensor([11, 12, 13, 21, 22, 23], dtype=torch.int64)
    assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out, 16)
    expected = torch.zeros(4, 16, dtype=torch.int32)
    expected[2, 0:3] = torch.tensor([11, 12, 13])
    expected[3, 7:10] = torch.tensor([21, 22, 23])
    assert torch.equal(req_to_token, expected)


def test_cuda_only_kernels_raise_naming_themselves():
    with pytest.raises(sgl_kernel.SglKernelUnavailableError, match="sgl_kernel.verify_tree_greedy_cpu"):
        sgl_kernel.verify_tree_greedy_cpu()
    # Probes for names we do not provide keep answering truthfully.
    assert not hasattr(sgl_kernel, "flash_attn_with_kvcache")
