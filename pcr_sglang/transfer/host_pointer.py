"""Device-accessible pointers to registered host memory, obtained explicitly for kernels.

The copy kernel reads and writes the host pool (POSIX shared memory registered with
``cudaHostRegister``). Handing that CPU tensor to Triton would work only because Triton's
launcher asks the driver for its device pointer (``cuPointerGetAttribute``), and fails with
"Pointer argument cannot be accessed from Triton (cpu tensor?)" the moment it does not.
SGLang's HiCache never relies on that: it builds its kernels' pointer tables from
``sgl_kernel.kvcacheio.get_device_accessible_ptr`` (``make_kernel_ptr_table``), and falls
back to the host address only on CUDA, whose unified addressing makes the two equal for
registered memory (on ROCm they differ, and the call is required). This module does the
same, once per buffer and device, and gives the kernel a :class:`HostPointer`: an object
with ``data_ptr()`` (the device address) and ``dtype``, never the CPU tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger(__name__)


class HostPointerError(RuntimeError):
    """Host memory the GPU cannot address (not registered, or no way to get its address)."""


@dataclass(frozen=True, eq=False)
class HostPointer:
    """What a Triton kernel gets for a registered host buffer: its device address.
    ``tensor`` is kept so the memory outlives every launch that uses the address."""

    tensor: torch.Tensor
    device_ptr: int

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def data_ptr(self) -> int:
        return self.device_ptr


def _sgl_kernel_fn() -> Optional[Callable[[torch.Tensor, int], int]]:
    """HiCache's resolver, where the installed sgl-kernel has it (``_resolve_device_accessible_ptr_fn``)."""
    try:
        from sgl_kernel.kvcacheio import get_device_accessible_ptr
    except ImportError:
        return None
    if not hasattr(torch.ops.sgl_kernel, "get_device_accessible_ptr"):
        return None
    fn: Callable[[torch.Tensor, int], int] = get_device_accessible_ptr
    return fn


def resolve(
    host: torch.Tensor,
    device: torch.device,
    *,
    resolver: Optional[Callable[..., Any]] = None,
    is_hip: Optional[bool] = None,
    is_pinned: Callable[[torch.Tensor], bool] = torch.Tensor.is_pinned,
) -> HostPointer:
    """The device address of registered host buffer ``host`` for CUDA device ``device``.

    Called once per buffer (the transfer engine keeps the result). ``resolver``,
    ``is_hip``, ``is_pinned``: tests pass recording stand-ins (defaults: sgl-kernel's
    ``get_device_accessible_ptr`` when installed, ``torch.version.hip``, and torch's
    own pinned check). Raises :class:`HostPointerError` for memory CUDA does not know as
    registered, and on ROCm without the resolver."""
    if host.device.type != "cpu":
        raise HostPointerError(f"a host pointer is for CPU memory; this tensor is on {host.device}")
    if not is_pinned(host):
        raise HostPointerError(
            "the host buffer is not registered with CUDA (cudaHostRegister or pin_memory): a GPU kernel "
            "cannot address it"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = resolver if resolver is not None else _sgl_kernel_fn()
    hip = bool(torch.version.hip) if is_hip is None else is_hip
    if fn is not None:
        address = int(fn(host, index))
    elif hip:
        raise HostPointerError(
            "sgl_kernel.kvcacheio.get_device_accessible_ptr is missing: on ROCm registered host memory has a "
            "device address of its own, which PCR's copy kernel needs (install an sglang-kernel that has it)"
        )
    else:
        # CUDA's unified addressing: registered host memory has the same address on the device.
        address = host.data_ptr()
        logger.info(
            "PCR host tier: sgl_kernel.kvcacheio.get_device_accessible_ptr is not installed; the copy "
            "kernel uses the host address of the registered pool (equal on CUDA with unified addressing)"
        )
    if address == 0:
        raise HostPointerError("no device address for the registered host buffer")
    return HostPointer(host, address)
