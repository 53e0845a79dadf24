"""The Triton copy kernel against the reference. Runs under TRITON_INTERPRET=1 on CPU
(scripts/test.sh sets it for this folder) and natively on a CUDA machine."""

from __future__ import annotations

import os

import pytest
import torch

from pcr_sglang.transfer.copy_kv import Direction, copy_layer_triton
from tests.kernels.copy_kv_cases import DTYPES, check

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("chunk_size,num_chunks", [(1, 5), (5, 3), (16, 2), (7, 0)])
def test_triton_copy_matches_reference(dtype, direction, chunk_size, num_chunks):
    check(copy_layer_triton, dtype, chunk_size, num_chunks, direction, seed=chunk_size, device=DEVICE)
