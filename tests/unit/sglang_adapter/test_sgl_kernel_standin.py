from __future__ import annotations

import pytest
import sgl_kernel
import torch
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


# ---------------------------------------------------------------- kvcacheio
LAYERS, TOKENS, HEADS, DIM = 3, 40, 2, 8


def _device_layers(dtype):
    torch.manual_seed(1)
    k = [torch.randn(TOKENS, HEADS, DIM).to(dtype) for _ in range(LAYERS)]
    v = [torch.randn(TOKENS, HEADS, DIM).to(dtype) for _ in range(LAYERS)]
    return k, v


def _ptrs(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


# Odd lengths and non-contiguous, unsorted index sets.
SRC = torch.tensor([5, 1, 33, 17, 18, 39, 0])
DST = torch.tensor([2, 30, 11, 12, 7, 0, 25])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
def test_layer_first_round_trip_matches_reference(dtype):
    from sgl_kernel.kvcacheio import transfer_kv_all_layer, transfer_kv_per_layer

    dev_k, dev_v = _device_layers(dtype)
    host_k = torch.zeros(LAYERS, TOKENS, HEADS, DIM, dtype=dtype)
    host_v = torch.zeros_like(host_k)
    item = HEADS * DIM * dtype.itemsize
    # device -> host, all layers (backup)
    transfer_kv_all_layer(_ptrs(dev_k), _ptrs(list(host_k)), _ptrs(dev_v), _ptrs(list(host_v)), SRC, DST, item, LAYERS)
    for layer in range(LAYERS):
        assert torch.equal(host_k[layer][DST], dev_k[layer][SRC])
        assert torch.equal(host_v[layer][DST], dev_v[layer][SRC])
    # host -> device, one layer (load back) into fresh slots
    back_k, back_v = torch.zeros_like(dev_k[1]), torch.zeros_like(dev_v[1])
    transfer_kv_per_layer(host_k[1], back_k, host_v[1], back_v, DST, SRC, item)
    assert torch.equal(back_k[SRC], dev_k[1][SRC]) and torch.equal(back_v[SRC], dev_v[1][SRC])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_page_first_round_trip_matches_reference(dtype):
    from sgl_kernel.kvcacheio import transfer_kv_all_layer_lf_pf, transfer_kv_per_layer_pf_lf

    dev_k, dev_v = _device_layers(dtype)
    host_k = torch.zeros(TOKENS, LAYERS, HEADS, DIM, dtype=dtype)  # page-first: token major
    host_v = torch.zeros_like(host_k)
    item = HEADS * DIM * dtype.itemsize
    layout_dim = item * LAYERS
    transfer_kv_all_layer_lf_pf(_ptrs(dev_k), host_k, _ptrs(dev_v), host_v, SRC, DST, item, layout_dim, LAYERS)
    for layer in range(LAYERS):
        assert torch.equal(host_k[DST, layer], dev_k[layer][SRC])
        assert torch.equal(host_v[DST, layer], dev_v[layer][SRC])
    for layer in range(LAYERS):
        back_k, back_v = torch.zeros_like(dev_k[0]), torch.zeros_like(dev_v[0])
        transfer_kv_per_layer_pf_lf(host_k, back_k, host_v, back_v, DST, SRC, layer, item, layout_dim)
        assert torch.equal(back_k[SRC], dev_k[layer][SRC])
        assert torch.equal(back_v[SRC], dev_v[layer][SRC])


def test_direct_copy_and_unsupported_layouts():
    from sgl_kernel import kvcacheio

    src = [torch.arange(40.0).view(20, 2), torch.arange(40.0, 80.0).view(20, 2)]
    dst = [torch.zeros(20, 2), torch.zeros(20, 2)]
    kvcacheio.transfer_kv_direct(src, dst, SRC[SRC < 20], DST[SRC < 20] % 20, page_size=1)
    for s, d in zip(src, dst):
        assert torch.equal(d[DST[SRC < 20] % 20], s[SRC[SRC < 20]])
    with pytest.raises(sgl_kernel.SglKernelUnavailableError, match="transfer_kv_per_layer_ph_lf"):
        kvcacheio.transfer_kv_per_layer_ph_lf()
    with pytest.raises(ValueError, match="differ in length"):
        kvcacheio.transfer_kv_direct(src, dst, SRC, DST[:2], page_size=1)
