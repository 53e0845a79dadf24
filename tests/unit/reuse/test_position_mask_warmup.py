"""No JIT in the serving path, for SGLang's masked extend (``reuse/mask_warmup.py``).

A forward with a permuted row runs SGLang's Triton extend with PCR's position mask: a
specialization of ``_fwd_kernel`` the startup warm-up must have compiled. Checked on CPU by
what reaches the kernel: SGLang's own ``extend_attention_fwd`` runs with its ``_fwd_kernel``
replaced by a recorder that keys each launch as Triton specializes it (constexprs, tensor
dtypes and 16-byte alignment, integers as 1 / a multiple of 16 / other, launch options).
Serving's launches come from SGLang's real ``TritonAttnBackend.forward_extend`` through PCR's
two Triton hooks; every one must be a key the warm-up launched. The real launches run under
the Triton interpreter in tests/kernels/test_position_mask_warmup_triton.py. Nothing here
ran on a GPU."""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

extend_module = pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend as SGLangTriton  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402

from pcr_sglang.reuse import mask_warmup  # noqa: E402
from pcr_sglang.reuse.forward_plan import ForwardPlan, ForwardPlans  # noqa: E402
from pcr_sglang.sglang_adapter import forward_hooks  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, SLOTS = 4, 2, 16, 3, 256
DTYPE = torch.bfloat16
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack")


def _int_class(value: int) -> str:
    if value == 1:
        return "1"
    return "D" if value % 16 == 0 else ("i32" if -(2**31) <= value < 2**31 else "i64")


class KeyingKernel:
    """Stands for ``_fwd_kernel``: ``kernel[grid](*args, **kwargs)`` records the launch's
    specialization key, computed as Triton 3 does from the real kernel's parameters."""

    def __init__(self, real: Any):
        self.signature = inspect.signature(real.fn)
        self.constexprs = {name for name, p in self.signature.parameters.items() if "constexpr" in str(p.annotation)}
        assert {"USE_CUSTOM_MASK", "SKIP_PREFIX_CUSTOM_MASK", "IS_CAUSAL"} <= self.constexprs
        self.unspecialized = set(getattr(real, "do_not_specialize", ()) or ())
        self.keys: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: Any) -> Any:
        return self.launch

    def launch(self, *args: Any, **kwargs: Any) -> None:
        options = tuple((name, kwargs.pop(name, None)) for name in _LAUNCH_OPTIONS)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key: list[Any] = []
        for name, value in bound.arguments.items():
            if name in self.constexprs or value is None:
                key.append((name, "constexpr", value))
            elif isinstance(value, torch.Tensor):
                key.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
            elif isinstance(value, bool):
                key.append((name, "u1"))
            elif isinstance(value, int):
                key.append((name, "int" if name in self.unspecialized else _int_class(value)))
            elif isinstance(value, float):
                key.append((name, "fp32"))
            else:
                raise AssertionError(f"unexpected kernel argument {name}={value!r}")
        self.keys.append((tuple(key), options))


class Pool:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.k = [torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(DTYPE) for _ in range(LAYERS)]
        self.v = [torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(DTYPE) for _ in range(LAYERS)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v[layer_id]


class TritonAttnBackend:
    """What SGLang's ``forward_extend`` reads of its backend, PCR's hook around the kernel
    call as the plugin installs it, and SGLang's own ``extend_attention_fwd``."""

    forward_extend = SGLangTriton.forward_extend

    def __init__(self, pool: Pool) -> None:
        self.token_to_kv_pool = pool
        self.kv_indptr = torch.zeros(65, dtype=torch.int32)  # SGLang's buffers' dtypes
        self.qo_indptr = torch.zeros(65, dtype=torch.int64)
        self.page_size, self.dcp_size, self.enable_deterministic, self.dllm_attention = 1, 1, False, None
        self.use_verify_shared_kv = self.use_verify_splitkv = False
        self.extend_attention_fwd = extend_module.extend_attention_fwd
        self.forward_metadata: Any = None

    def _can_run_dense_fp8_chunked_mha(self, *args: Any) -> bool:
        return False

    def _forward_extend_kernel(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        return forward_hooks.triton_extend_kernel(SGLangTriton._forward_extend_kernel, self, layer, *args, **kwargs)


def _model() -> torch.nn.Module:
    return torch.nn.ModuleList([RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=i) for i in range(LAYERS)])


def _rig(monkeypatch: pytest.MonkeyPatch) -> tuple[KeyingKernel, TritonAttnBackend, Any, torch.nn.Module]:
    kernel = KeyingKernel(extend_module._fwd_kernel)
    monkeypatch.setattr(extend_module, "_fwd_kernel", kernel)
    backend = TritonAttnBackend(Pool())
    worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, dtype=DTYPE))
    return kernel, backend, worker, _model()


def _serve(backend: TritonAttnBackend, model: torch.nn.Module, batch: int, permuted: bool = True) -> None:
    """One extend forward of ``batch`` requests, request 0's row permuted (its prefix and
    extend both), through PCR's metadata hook and SGLang's ``forward_extend`` on every layer;
    q, k and v split from one fused projection, as SGLang's models hand them over."""
    prefix = [5 + i for i in range(batch)]
    extend = [3 + i % 4 for i in range(batch)]
    seq = [p + e for p, e in zip(prefix, extend)]
    order = list(range(seq[0]))
    order[1], order[2], order[-1], order[-2] = order[2], order[1], order[-2], order[-1]
    plans = ForwardPlans().attach(backend.token_to_kv_pool)
    if permuted:
        plans.current = ForwardPlan(rows={}, bound={0: (0, torch.tensor(order))})
        plans.current.prefix_lens, plans.current.extend_lens = prefix, extend

    def init_forward_metadata(b: Any, forward: Any) -> None:  # the extend branch's tensors
        b.kv_indptr[1 : batch + 1] = torch.tensor(prefix).cumsum(0)
        b.qo_indptr[1 : batch + 1] = torch.tensor(extend).cumsum(0)
        b.forward_metadata = SimpleNamespace(
            kv_indptr=b.kv_indptr[: batch + 1],
            kv_indices=torch.arange(sum(prefix), dtype=torch.int64),
            qo_indptr=b.qo_indptr[: batch + 1],
            custom_mask=None,
            mask_indptr=None,
            max_extend_len=max(extend),
        )

    mode = SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: False)
    forward = SimpleNamespace(
        forward_mode=mode,
        req_pool_indices_cpu=torch.arange(batch),
        seq_lens=torch.tensor(seq),
        extend_seq_lens_cpu=extend,
        mha_one_shot=False,
    )
    forward_hooks.triton_metadata(init_forward_metadata, backend, forward)
    qkv = torch.randn(sum(extend), (HEADS + 2 * KV_HEADS) * DIM).to(DTYPE)
    for layer in model:
        q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
        backend.forward_extend(q, k.view(-1, KV_HEADS, DIM), v.view(-1, KV_HEADS, DIM), layer, forward, False)
    plans.current = None


def test_a_permuted_forward_launches_only_what_the_startup_warm_up_compiled(monkeypatch):
    kernel, backend, worker, model = _rig(monkeypatch)
    _serve(backend, model, 3)
    assert kernel.keys, "the serving forward launched nothing"
    kernel.keys.clear()  # before the warm-up nothing is compiled: a permuted forward would compile

    report = mask_warmup.warm_up_position_mask(worker, model, fill_gaps=True, on_cuda=True, synchronize=lambda: None)
    assert report is not None and {kernel for kernel, _, _ in report.launches} == {mask_warmup.KERNEL}
    assert len(report.launches) == len(mask_warmup.BATCH_SIZES)  # every layer has one shape: layer 0's
    compiled = set(kernel.keys)
    kernel.keys.clear()
    for batch in (1, 2, 3, 7, 16, 32):
        _serve(backend, model, batch)
    assert kernel.keys and [key for key in kernel.keys if key not in compiled] == []

    kernel.keys.clear()
    _serve(backend, model, 3, permuted=False)  # SGLang's own variant (no mask): not PCR's to compile
    assert [key for key in kernel.keys if key not in compiled] == kernel.keys


def test_the_warm_up_reads_layer_0s_pool_buffers_with_the_serving_mask_and_writes_nothing(monkeypatch):
    calls = []
    _, backend, worker, model = _rig(monkeypatch)
    before = [(k.clone(), v.clone()) for k, v in zip(backend.token_to_kv_pool.k, backend.token_to_kv_pool.v)]

    def extend(*args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))

    report = mask_warmup.warm_up_position_mask(
        worker, model, fill_gaps=True, on_cuda=True, extend=extend, synchronize=lambda: None
    )
    assert report is not None and [layer for _, layer, _ in report.launches] == [0, 0, 0]
    pool = backend.token_to_kv_pool
    for args, kwargs in calls:
        assert args[4] is pool.k[0] and args[5] is pool.v[0]
        assert args[9].dtype == torch.bool and args[10] is True and kwargs["skip_prefix_custom_mask"] is False
        assert args[8].tolist() == [0] * (args[6].numel() - 1)  # every prefix is slot 0
    assert sorted(args[6].numel() - 1 for args, _ in calls) == sorted(mask_warmup.BATCH_SIZES)
    for (k, v), (k0, v0) in zip(zip(pool.k, pool.v), before):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_nothing_is_launched_off_cuda_without_gap_filling_or_without_the_triton_backend(monkeypatch):
    _, backend, worker, model = _rig(monkeypatch)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("launched")

    def run(w: Any = worker, **kw: Any) -> Any:
        return mask_warmup.warm_up_position_mask(w, model, extend=fail, synchronize=fail, **{"fill_gaps": True, **kw})

    assert run() is None  # the pool is on the CPU
    assert run(on_cuda=True, fill_gaps=False) is None
    native = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=SimpleNamespace(token_to_kv_pool=None)))
    assert run(native, on_cuda=True) is None
    backend.enable_deterministic = True  # another kernel (the unified one) runs the extend then
    assert run(on_cuda=True) is None
    backend.enable_deterministic = False
    hybrid = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=SimpleNamespace(prefill_backend=backend)))
    assert mask_warmup.triton_extend_backend(hybrid) is backend


def test_a_failed_launch_is_logged_and_never_stops_the_server(monkeypatch, caplog):
    _, _, worker, model = _rig(monkeypatch)
    caplog.set_level(logging.WARNING, logger=mask_warmup.__name__)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("out of resources")

    assert mask_warmup.warm_up_position_mask(worker, model, fill_gaps=True, on_cuda=True, extend=broken) is None
    assert "out of resources" in caplog.text
