"""The copy kernel's host argument on CUDA: a device address obtained explicitly for the
registered host pool (as HiCache's ``make_kernel_ptr_table``), never a CPU tensor left to
Triton's launcher. Checked on CPU by what the code calls: the resolver, the pinned check
and the kernel launch are recording stand-ins; nothing here ran on a GPU."""

from __future__ import annotations

import pytest
import torch

from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer import copy_kv
from pcr_sglang.transfer.copy_kv import Direction, copy_layer_triton, kernel_host_arg
from pcr_sglang.transfer.host_pointer import HostPointer, HostPointerError, resolve

CUDA0 = torch.device("cuda", 0)  # a device object only: no GPU is touched


class RecordingResolver:
    def __init__(self, address: int = 0x7F00_0000_1000):
        self.calls: list[tuple[int, int]] = []
        self.address = address

    def __call__(self, tensor: torch.Tensor, index: int) -> int:
        self.calls.append((tensor.data_ptr(), index))
        return self.address


def test_the_pointer_comes_from_the_resolver_for_registered_memory():
    host = torch.zeros(64, dtype=torch.uint8)
    resolver = RecordingResolver()
    pointer = resolve(host, CUDA0, resolver=resolver, is_pinned=lambda t: True)
    assert resolver.calls == [(host.data_ptr(), 0)]
    assert pointer.data_ptr() == resolver.address and pointer.dtype == torch.uint8 and pointer.tensor is host


def test_without_the_resolver_cuda_uses_the_unified_address_and_rocm_is_refused():
    host = torch.zeros(64, dtype=torch.uint8)
    assert resolve(host, CUDA0, resolver=None, is_hip=False, is_pinned=lambda t: True).data_ptr() == host.data_ptr()
    with pytest.raises(HostPointerError, match="ROCm"):
        resolve(host, CUDA0, resolver=None, is_hip=True, is_pinned=lambda t: True)


def test_memory_cuda_does_not_know_as_registered_is_refused():
    with pytest.raises(HostPointerError, match="not registered"):
        resolve(torch.zeros(8, dtype=torch.uint8), CUDA0, resolver=RecordingResolver(), is_pinned=lambda t: False)


def test_on_cuda_the_kernel_never_gets_a_cpu_tensor(monkeypatch):
    host = torch.zeros(64, dtype=torch.uint8)
    resolved = HostPointer(host, 0xABC000)
    calls = []
    monkeypatch.setattr(copy_kv, "resolve", lambda t, d: calls.append((t, d)) or resolved)
    assert kernel_host_arg(host, CUDA0) is resolved and calls == [(host, CUDA0)]  # resolved, not passed on
    assert kernel_host_arg(resolved, CUDA0) is resolved and len(calls) == 1  # resolved once by the caller
    assert kernel_host_arg(resolved, torch.device("cpu")) is host  # the interpreter gets the tensor


class RecordingKernel:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_the_launch_passes_what_kernel_host_arg_gives_for_the_kv_device(monkeypatch):
    layout = HostChunkLayout(num_slots=2, num_layers=2, chunk_size=4, row_bytes=16)
    host = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    k = torch.zeros(8, 16, dtype=torch.uint8)
    v = torch.zeros(8, 16, dtype=torch.uint8)
    kernel = RecordingKernel()
    marker = HostPointer(host, 0xDEF000)
    seen = []
    monkeypatch.setattr(copy_kv, "_KERNEL", kernel)
    monkeypatch.setattr(copy_kv, "kernel_host_arg", lambda h, d: seen.append((h, d)) or marker)
    copy_layer_triton(Direction.HOST_TO_DEVICE, k, v, host, torch.arange(4), torch.tensor([1]), 1, layout)
    assert seen == [(host, k.device)]
    ((_, args, _),) = kernel.launches
    assert args[2] is marker
