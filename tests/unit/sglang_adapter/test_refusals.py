"""What --enable-pcr refuses, at flag resolution: each refusal goes through SGLang's real
resolution (``prepare_server_args`` + ``ServerArgs.resolve_once`` with the plugin's hook),
on model folders holding only a config and a tokenizer — no weights, so a refusal here
cannot have come from anything that loads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pcr_sglang.sglang_adapter import refusals
from pcr_sglang.sglang_adapter.refusals import SupportInputs, UnsupportedConfigError

DRAM = ("--pcr-dram-gb", "0.01")

MLA = dict(
    model_type="deepseek_v2",
    architectures=["DeepseekV2ForCausalLM"],
    kv_lora_rank=64,
    q_lora_rank=None,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
)
MAMBA2 = dict(
    model_type="mamba2",
    architectures=["Mamba2ForCausalLM"],
    num_heads=16,
    head_dim=32,
    n_groups=1,
    state_size=16,
    expand=2,
)
QWEN3_NEXT = dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"])
SWA = dict(is_hybrid_swa=True, sliding_window=64)  # SGLang's opt-in for custom hybrid-SWA models
DSA = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV32ForCausalLM"],
    kv_lora_rank=64,
    q_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_topk=16,
    index_head_dim=32,
    index_n_heads=4,
)


@pytest.fixture(scope="module")
def resolve():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    def _resolve(model_path, *flags):
        args = prepare_server_args(["--model-path", str(model_path), "--device", "cpu", "--enable-pcr", *flags])
        args.resolve_once()
        return args

    return _resolve


@pytest.fixture(scope="module")
def config_only_model(tiny_model, tmp_path_factory):
    """A folder with the tiny model's tokenizer and its config updated by ``fields``."""

    def make(name: str, fields: dict) -> Path:
        folder = tmp_path_factory.mktemp(name)
        for f in Path(tiny_model).iterdir():
            if "token" in f.name:
                shutil.copy(f, folder)
        config = json.loads((Path(tiny_model) / "config.json").read_text())
        config.update(fields)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return make


def test_supported_configuration_resolves(resolve, tiny_model):
    args = resolve(tiny_model, *DRAM, "--radix-eviction-policy", "lru")
    assert args.enable_pcr and args.pcr_dram_gb == 0.01


@pytest.mark.parametrize(
    "fields,flags,message",
    [
        (SWA, (), r"--model-path \S+ \(LlamaForCausalLM\) has sliding-window layers"),
        (MAMBA2, (), r"\(Mamba2ForCausalLM\) has state-space / linear-attention layers"),
        (
            QWEN3_NEXT,
            ("--disable-overlap-schedule", "--mamba-radix-cache-strategy", "no_buffer"),
            r"\(Qwen3NextForCausalLM\) has state-space / linear-attention layers",
        ),
        (MLA, DRAM, r"--pcr-dram-gb copies separate K and V rows \(MHA/GQA\); this model uses MLA"),
    ],
    ids=["swa", "mamba2", "qwen3-next", "mla-host-tier"],
)
def test_model_kinds_are_refused_at_resolution(resolve, config_only_model, fields, flags, message):
    folder = config_only_model(fields["architectures"][0] if "architectures" in fields else "swa", fields)
    with pytest.raises(UnsupportedConfigError, match=message):
        resolve(folder, *flags)


def test_mla_without_host_tier_resolves(resolve, config_only_model):
    args = resolve(config_only_model("mla", MLA))
    assert args.enable_pcr


def test_kv_cache_events_resolve_and_routers_are_told_the_chunk_size(resolve, tiny_model):
    """PCR publishes SGLang's KV cache events (once refused: it published none), one block
    per chunk: both places SGLang advertises the block size say the chunk size."""
    from types import SimpleNamespace

    from pcr_sglang import plugin
    from pcr_sglang.sglang_adapter.prefix_cache import PCRPrefixCache

    args = resolve(tiny_model, "--kv-events-config", '{"publisher": "zmq", "topic": "kv"}', "--pcr-chunk-size", "32")
    assert args.enable_pcr and args.kv_events_config
    assert plugin._kv_event_block_size({"block_size": 1}, args) == {"block_size": 32}
    cache = object.__new__(PCRPrefixCache)
    cache.chunk_size = 32
    sources = lambda publisher, block_size: [{"block_size": block_size}]  # noqa: E731
    assert plugin._kv_event_sources(sources, SimpleNamespace(tree_cache=cache), 1) == [{"block_size": 32}]
    assert plugin._kv_event_sources(sources, SimpleNamespace(tree_cache=object()), 1) == [{"block_size": 1}]


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--radix-eviction-policy", "lfu"), "drop --radix-eviction-policy lfu"),
        ((*DRAM, "--enable-two-batch-overlap"), "--pcr-layerwise both copies layer i .* --enable-two-batch-overlap"),
        (
            (*DRAM, "--enable-unified-memory", "--attention-backend", "triton"),
            r"--pcr-dram-gb copies token-major \(NHD\) KV rows; --enable-unified-memory",
        ),
    ],
    ids=["eviction-policy", "two-batch-overlap", "unified-memory"],
)
def test_flags_are_refused_at_resolution(resolve, tiny_model, flags, message):
    with pytest.raises(UnsupportedConfigError, match=message):
        resolve(tiny_model, *flags)


@pytest.mark.parametrize(
    "layerwise, backend, refused",
    [
        ("both", "full", True),
        ("load", "full", True),
        ("offload", "full", False),
        ("both", "breakable", False),
    ],
)
def test_layerwise_loads_are_refused_with_a_full_prefill_graph(layerwise, backend, refused):
    """A full prefill CUDA graph replays the forward without SGLang's per-layer read hook,
    where layer-wise loads are waited for and a reused document's layers re-placed."""
    from pcr_sglang.config import PCRConfig

    cfg = SimpleNamespace(cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend=backend)))
    inputs = SupportInputs(cfg, PCRConfig(enabled=True, dram_gb=0.01, layerwise=layerwise))
    reason = refusals.check_full_prefill_graph(inputs)
    assert (reason is not None) == refused
    if refused:
        assert f"--pcr-layerwise {layerwise}" in reason and "--cuda-graph-backend-prefill breakable" in reason
    device_only = SupportInputs(cfg, PCRConfig(enabled=True, layerwise=layerwise))
    assert refusals.check_full_prefill_graph(device_only) is None  # no host tier: nothing is copied


def test_two_batch_overlap_with_layerwise_load_resolves(resolve, tiny_model):
    args = resolve(tiny_model, *DRAM, "--enable-two-batch-overlap", "--pcr-layerwise", "load")
    assert args.enable_two_batch_overlap


def test_hnd_layout_env_is_refused_with_host_tier(resolve, tiny_model, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    with pytest.raises(UnsupportedConfigError, match="SGLANG_USE_HND_KVCACHE=1"):
        resolve(tiny_model, *DRAM)
    assert resolve(tiny_model).enable_pcr  # device-only PCR copies nothing: accepted


def test_every_reason_in_one_message(resolve, config_only_model):
    with pytest.raises(UnsupportedConfigError) as exc:
        resolve(config_only_model("mamba-lfu", MAMBA2), "--radix-eviction-policy", "lfu")
    assert "state-space" in str(exc.value) and "--radix-eviction-policy lfu" in str(exc.value)


class _With:
    """A resolved view with one field replaced (for what SGLang itself refuses on a CPU)."""

    def __init__(self, view, **fields):
        self._view, self._fields = view, fields

    def __getattr__(self, name):
        return self._fields[name] if name in self._fields else getattr(self._view, name)


@pytest.mark.parametrize("dtype", refusals.SCALE_BUFFER_KV_DTYPES)
def test_scale_buffer_kv_dtypes_are_refused_with_host_tier(resolve, tiny_model, dtype):
    """SGLang's CPU resolution rejects these KV recipes before the plugin's hook runs (they
    need Blackwell or CUDA kernels), so the rule runs on the real resolved inputs of the
    tiny model with only --kv-cache-dtype replaced."""
    real = refusals.inputs_from_server_args(resolve(tiny_model, *DRAM))
    assert refusals.unsupported_reasons(real) == []
    swapped = SupportInputs(_With(real.cfg, kv_cache_dtype=dtype), real.pcr, real.model_config)
    [reason] = refusals.unsupported_reasons(swapped)
    assert f"per-token scale buffers of --kv-cache-dtype {dtype}" in reason and "--pcr-dram-gb" in reason
    device_only = refusals.inputs_from_server_args(resolve(tiny_model))
    no_tier = SupportInputs(_With(device_only.cfg, kv_cache_dtype=dtype), device_only.pcr, device_only.model_config)
    assert refusals.unsupported_reasons(no_tier) == []


def test_dsa_model_is_refused(config_only_model):
    """SGLang cannot resolve a DSA model on a CPU at all, so the rule runs on SGLang's real
    ModelConfig of a DeepSeek-V3.2-style config."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig

    from pcr_sglang.config import PCRConfig

    folder = config_only_model("dsa", DSA)
    model_config = ModelConfig(str(folder))
    reasons = refusals.unsupported_reasons(
        SupportInputs(SimpleNamespace(model_path=str(folder)), PCRConfig(enabled=True), model_config)
    )
    assert len(reasons) == 1 and "DeepSeek sparse-attention (DSA) layers" in reasons[0]
    assert "--model-path" in reasons[0]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"kv_cache_layout": "hnd"}, "this KV pool's layout is hnd"),
        ({"k_scale_buffer": "per-token scales"}, "also keeps k_scale_buffer"),
    ],
)
def test_host_pool_build_refuses_what_it_cannot_copy(change, message):
    """The second line, where the tree cache is built: SGLang's real CPU pool is accepted,
    and refused once it reports a layout or a scale buffer the host tier cannot copy."""
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from pcr_sglang.config import PCRConfig, PCRConfigError
    from pcr_sglang.sglang_adapter.factory import build_host_pool

    kvcache = MHATokenToKVPool(256, 1, torch.float32, 2, 16, 2, "cpu", False)
    allocator = TokenToKVPoolAllocator(256, torch.float32, "cpu", kvcache, need_sort=False)
    config = PCRConfig(enabled=True, chunk_size=16, dram_gb=0.001)
    build_host_pool(config, allocator).close()
    for name, value in change.items():
        setattr(kvcache, name, value)
    with pytest.raises(PCRConfigError, match=message):
        build_host_pool(config, allocator)


def test_selecting_pcr_by_radix_cache_backend_runs_the_same_refusals(tiny_model):
    """Review finding: ``--radix-cache-backend pcr`` (without ``--enable-pcr``) skipped
    every check at resolution, so refusals came only after the weights loaded."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    args = prepare_server_args(
        [
            "--model-path",
            str(tiny_model),
            "--device",
            "cpu",
            "--radix-cache-backend",
            "pcr",
            "--radix-eviction-policy",
            "lfu",
        ]
    )
    with pytest.raises(UnsupportedConfigError, match="--radix-eviction-policy"):
        args.resolve_once()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention_backend": "flashinfer"}, "needs the torch_native or triton attention backend"),
        ({"attention_backend": "triton", "prefill_attention_backend": "fa3"}, "this server's is fa3"),
        ({"tp_size": 2}, "--tp-size > 1"),
        ({"enable_dp_attention": True}, "--enable-dp-attention"),
        ({"dcp_size": 2}, "decode context parallelism"),
        ({"enable_pdmux": True}, "--enable-pdmux"),
        ({"enable_mixed_chunk": True}, "--enable-mixed-chunk"),
        ({"lora_paths": ["adapter"]}, "LoRA"),
        (
            {"cuda_graph_config": SimpleNamespace(prefill=SimpleNamespace(backend="breakable"))},
            "--disable-prefill-cuda-graph",
        ),
    ],
)
def test_recompute_modes_refuse_what_cannot_mask_a_permuted_row(overrides, message):
    from pcr_sglang.sglang_adapter.refusals import _recompute_flags

    cfg = SimpleNamespace(**{"attention_backend": "torch_native", **overrides})
    assert message in _recompute_flags(cfg)
    assert (
        _recompute_flags(
            SimpleNamespace(
                attention_backend="triton",
                tp_size=1,
                cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend="disabled")),
            )
        )
        is None
    )


def test_mixed_chunks_are_refused_only_where_sglang_mixes_them():
    """SGLang mixes decode rows into an extend only with chunked prefill on."""
    from pcr_sglang.sglang_adapter.refusals import _recompute_flags

    def verdict(**flags):
        return _recompute_flags(SimpleNamespace(attention_backend="torch_native", enable_mixed_chunk=True, **flags))

    assert "--enable-mixed-chunk" in verdict(chunked_prefill_size=8192)
    assert "--enable-mixed-chunk" in verdict(chunked_prefill_size=None)  # SGLang picks a size
    assert verdict(chunked_prefill_size=-1) is None


def test_pipeline_parallelism_is_refused():
    """Every stage would share one namespace (one SSD directory and key), so a stage could
    read another stage's layers as its own (it was accepted)."""
    from pcr_sglang.config import PCRConfig

    inputs = SupportInputs(SimpleNamespace(pp_size=2), PCRConfig(enabled=True))
    reason = refusals.check_pipeline_parallel(inputs)
    assert reason is not None and "--pp-size 2" in reason
    assert refusals.check_pipeline_parallel(SupportInputs(SimpleNamespace(pp_size=1), PCRConfig(enabled=True))) is None
    assert refusals.check_pipeline_parallel in refusals.RULES


def test_pipeline_parallelism_is_refused_at_resolution(resolve, tiny_model):
    with pytest.raises(UnsupportedConfigError, match="pipeline parallelism"):
        resolve(tiny_model, "--pp-size", "2")


def test_concat_under_tp_is_refused():
    """A copy failing on one rank would change that rank's prefix length alone."""
    from pcr_sglang.config import PCRConfig

    reason = refusals.check_doc_reuse_tp(
        SupportInputs(SimpleNamespace(tp_size=2), PCRConfig(enabled=True, doc_reuse="concat"))
    )
    assert reason is not None and "--pcr-doc-reuse concat" in reason and "--tp-size > 1" in reason
    assert (
        refusals.check_doc_reuse_tp(
            SupportInputs(SimpleNamespace(tp_size=1), PCRConfig(enabled=True, doc_reuse="concat"))
        )
        is None
    )
    assert refusals.check_doc_reuse_tp in refusals.RULES


@pytest.mark.parametrize("tiers,refused", [((), False), (("ssd",), True), (("ssd", "remote"), True)])
def test_an_adapter_without_local_files_is_refused_with_persistent_tiers(tmp_path, tiers, refused):
    from pcr_sglang.config import PCRConfig

    pcr = PCRConfig(
        enabled=True,
        dram_gb=0.01,
        ssd_path=str(tmp_path) if tiers else None,
        ssd_gb=0.1 if tiers else 0.0,
        remote="mooncake" if "remote" in tiers else "off",
    )
    missing = SupportInputs(SimpleNamespace(lora_paths=["a=org/adapter-on-the-hub"]), pcr)
    reason = refusals.check_lora_persistent_tiers(missing)
    assert (reason is not None) == refused
    if refused:
        assert "a=org/adapter-on-the-hub" in reason
    local = SupportInputs(SimpleNamespace(lora_paths=[f"a={tmp_path}"]), pcr)
    assert refusals.check_lora_persistent_tiers(local) is None


def test_only_the_debug_flag_or_the_admin_key_may_ask_for_the_tree_check():
    from pcr_sglang.sglang_adapter.invariant_route import may_check

    assert may_check(True, None, None)
    assert not may_check(False, None, None)
    assert not may_check(False, None, "Bearer anything")  # no admin key configured: nobody
    assert not may_check(False, "k3y", None) and not may_check(False, "k3y", "Bearer wrong")
    assert not may_check(False, "k3y", "Basic k3y")
    assert may_check(False, "k3y", "Bearer k3y") and may_check(False, "k3y", "bearer k3y")


@pytest.mark.parametrize("tiers,refused", [((), False), (("ssd",), True), (("remote",), True)])
def test_weights_not_found_locally_are_refused_with_persistent_tiers(tmp_path, tiny_model, monkeypatch, tiers, refused):
    """review N7: a model whose files PCR cannot find once SGLang has loaded it got a cache
    namespace of its name and revision alone (a warning only), so every revision pushed
    under that name shared the SSD and remote tiers' KV."""
    from pcr_sglang.config import PCRConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pcr = PCRConfig(
        enabled=True,
        dram_gb=0.01,
        ssd_path=str(tmp_path) if "ssd" in tiers else None,
        ssd_gb=0.1 if "ssd" in tiers else 0.0,
        remote="mooncake" if "remote" in tiers else "off",
    )

    def inputs(model_path: str, loaded: bool = True) -> SupportInputs:
        cfg = SimpleNamespace(model_path=model_path, revision=None, download_dir=str(tmp_path))
        return SupportInputs(cfg, pcr, SimpleNamespace(hf_config=None, model_path=model_path), weights_loaded=loaded)

    reason = refusals.check_weights_local(inputs("org/not-on-this-machine"))
    assert (reason is not None) == refused
    if refused:
        assert "--model-path org/not-on-this-machine" in reason and "local folder" in reason
    # At flag resolution SGLang has not downloaded a hub id yet: not refused there.
    assert refusals.check_weights_local(inputs("org/not-on-this-machine", loaded=False)) is None
    assert refusals.check_weights_local(inputs(str(tiny_model))) is None
    assert refusals.check_weights_local in refusals.RULES
