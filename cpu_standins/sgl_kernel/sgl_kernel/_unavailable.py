"""Placeholders for kernels that exist only in the CUDA build of ``sgl_kernel``.

SGLang imports many ``sgl_kernel`` names at module import time, also on code paths a CPU
server never calls. Each such name must resolve, but calling it is a bug in the caller's
dispatch: the error says which kernel was asked for, instead of computing something
wrong. Names are listed explicitly (no module ``__getattr__``), so feature probes such as
``hasattr(sgl_kernel, name)`` keep answering truthfully for everything not listed.
"""

from __future__ import annotations

from typing import Any, Callable


class SglKernelUnavailableError(NotImplementedError):
    """Raised when a CUDA-only ``sgl_kernel`` function is called on the CPU stand-in."""


def unavailable(qualified_name: str) -> Callable[..., Any]:
    def _raise(*args: Any, **kwargs: Any) -> Any:
        raise SglKernelUnavailableError(
            f"{qualified_name} is a CUDA kernel with no CPU implementation in the "
            "pcr-sglang sgl_kernel stand-in; this code path needs a GPU build of SGLang."
        )

    _raise.__name__ = qualified_name.rsplit(".", 1)[-1]
    _raise.__qualname__ = qualified_name
    return _raise


def export_unavailable(namespace: dict[str, Any], module: str, names: list[str]) -> None:
    for name in names:
        namespace[name] = unavailable(f"{module}.{name}")
