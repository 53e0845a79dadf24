"""The Triton copy kernel on the host pool the server uses: a POSIX shared-memory segment
(:class:`~pcr_sglang.tiers.host_pool.HostChunkPool`), registered with ``cudaHostRegister``
on a CUDA machine, i.e. a CPU tensor over memory CUDA did not allocate, handed to Triton.
``copy_kv_cases.check`` runs the kernel on a ``pin_memory()`` buffer, which the caching
host allocator owns: a kernel that only works there would pass it and fail in production.

Runs under TRITON_INTERPRET=1 on CPU (the same segment, not registered) and natively on a
CUDA machine."""

from __future__ import annotations

import os

import pytest
import torch

from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.transfer.copy_kv import Direction, copy_layer, copy_layer_triton
from tests.kernels.copy_kv_cases import make_case, reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.mark.parametrize("copy_fn", [copy_layer_triton, copy_layer], ids=["triton", "dispatch"])
@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("chunk_size,num_chunks", [(5, 3), (16, 2)])
def test_copy_on_the_shared_memory_host_pool_matches_reference(copy_fn, direction, dtype, chunk_size, num_chunks):
    layout, k, v, host, token_slots, host_slots = make_case(dtype, chunk_size, num_chunks, seed=chunk_size)
    layer = 2
    want_k, want_v, want_host = reference(direction, k, v, host, token_slots, host_slots, layer, layout)
    with HostChunkPool(layout) as pool:  # pinned (cudaHostRegister) exactly when CUDA is there
        assert pool.pinned == (DEVICE == "cuda")
        pool.buffer.copy_(host)
        if DEVICE != "cpu":
            k, v, token_slots, host_slots = (t.to(DEVICE) for t in (k, v, token_slots, host_slots))
        copy_fn(direction, k, v, pool.buffer, token_slots, host_slots, layer, layout)
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        assert torch.equal(pool.buffer, want_host)
    assert torch.equal(k.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v.cpu().view(torch.uint8), want_v.view(torch.uint8))
