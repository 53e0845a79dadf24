"""The cache namespace changes whenever the weights or a numerics flag change, and only then."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pcr_sglang.sglang_adapter import fingerprint
from pcr_sglang.sglang_adapter.fingerprint import cache_namespace, model_fingerprint, weights_digest

WEIGHTS = "model.safetensors"


def _header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[: 8 + int.from_bytes(data[:8], "little")]


def _rewrite_tensor(src: Path, dst: Path, name: str, fn) -> None:
    """``dst``: ``src``'s checkpoint with tensor ``name`` replaced by ``fn(tensor)`` (same
    dtype and shape, so the safetensors header is byte-identical)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src / WEIGHTS), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = fn(tensors[name]).contiguous()
    if dst != src:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(tensors, str(dst / WEIGHTS), metadata=metadata)


def _tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS), "pt") as f:
        return list(f.keys())


@pytest.fixture(scope="module")
def model_copy(tiny_model, tmp_path_factory):
    def make(name: str) -> Path:
        folder = tmp_path_factory.mktemp(name)
        shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
        return folder

    return make


def test_identical_copy_has_the_same_digest(tiny_model, model_copy):
    assert weights_digest(model_copy("copy")) == weights_digest(Path(tiny_model))


def test_changing_any_one_tensor_changes_the_digest(tiny_model, model_copy):
    """Every tensor, one at a time, nudged by one part in 10^4 (a fine-tune-sized change):
    same sizes, same header, different digest."""
    base = weights_digest(Path(tiny_model))
    folder = model_copy("one-tensor")
    names = _tensor_names(folder)
    assert len(names) >= 10
    for name in names:
        _rewrite_tensor(Path(tiny_model), folder, name, lambda t: t * 1.0001 + 1e-6)
        assert _header(folder / WEIGHTS) == _header(Path(tiny_model) / WEIGHTS)
        assert (folder / WEIGHTS).stat().st_size == (Path(tiny_model) / WEIGHTS).stat().st_size
        assert weights_digest(folder) != base, name
    shutil.copy(Path(tiny_model) / WEIGHTS, folder / WEIGHTS)
    assert weights_digest(folder) == base


def test_documented_collision_an_edit_between_the_sampled_windows(tiny_model, model_copy):
    """What the module docstring says collides does: bytes inside a tensor, away from its
    start, middle and end windows. (If this starts failing, update the docstring.)"""
    folder = model_copy("interior-edit")
    path = folder / WEIGHTS
    header = json.loads(_header(path)[8:])
    name, info = max(
        ((k, v) for k, v in header.items() if k != "__metadata__"),
        key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0],
    )
    begin = len(_header(path)) + info["data_offsets"][0]
    data = bytearray(path.read_bytes())
    data[begin + 4096 : begin + 4100] = b"\x00\x00\x80\x7f"
    path.write_bytes(bytes(data))
    assert weights_digest(folder) == weights_digest(Path(tiny_model))


def test_index_and_extra_weight_files_change_the_digest(tiny_model, model_copy):
    base = weights_digest(Path(tiny_model))
    folder = model_copy("index")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": WEIGHTS}}))
    assert weights_digest(folder) != base
    folder = model_copy("extra")
    (folder / "extra.bin").write_bytes(b"\x01" * 1000)
    assert weights_digest(folder) != base


def test_non_safetensors_files_are_sampled_from_head_to_tail(tmp_path):
    """A byte changed in the first, a middle or the last window changes the digest; one
    between windows does not (the documented collision for opaque formats)."""
    path = tmp_path / "pytorch_model.bin"
    size = 8 << 20
    span = size - fingerprint._OPAQUE_WINDOW_BYTES
    middle = span * 15 // (fingerprint._OPAQUE_WINDOWS - 1)

    def digest(offset):
        data = bytearray(size)
        if offset is not None:
            data[offset] = 1
        path.write_bytes(bytes(data))
        return weights_digest(tmp_path)

    base = digest(None)
    assert len({base, digest(0), digest(middle + 5), digest(size - 1)}) == 4
    assert digest(middle + fingerprint._OPAQUE_WINDOW_BYTES + 5) == base


def test_hub_id_resolves_to_the_local_snapshot(tiny_model, tmp_path, monkeypatch):
    """``org/name`` is fingerprinted by the snapshot huggingface_hub holds (no network), so a
    new snapshot with other weights under the same id changes the fingerprint."""
    from types import SimpleNamespace

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_model, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    config = SimpleNamespace(hf_config=None)  # the config part is tested with real configs below
    by_id = model_fingerprint(config, "org/tiny", None, download_dir=str(tmp_path))
    assert by_id == model_fingerprint(config, str(snapshot))
    assert fingerprint.resolve_weights_dir("org/tiny", None, str(tmp_path)) == snapshot
    _rewrite_tensor(Path(tiny_model), snapshot, _tensor_names(snapshot)[0], lambda t: -t)
    assert model_fingerprint(config, "org/tiny", None, download_dir=str(tmp_path)) != by_id
    # Not downloaded: the id and revision, with a warning, and never the network.
    assert fingerprint.resolve_weights_dir("org/absent", None, str(tmp_path)) is None


# --------------------------------------------------------------------------- numerics


@pytest.fixture(scope="module")
def namespace_of(tiny_model):
    """The namespace a server with these flags gets, through SGLang's real resolution."""
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    def make(*flags, model=tiny_model, fields=fingerprint.NUMERICS_FIELDS):
        args = prepare_server_args(["--model-path", str(model), "--device", "cpu", "--enable-pcr", *flags])
        args.resolve_once()
        mc = model_config_of(args)
        ns = cache_namespace(args, mc, kv_dtype="float32", chunk_size=16)
        return (
            ns
            if fields is fingerprint.NUMERICS_FIELDS
            else ns.__class__(**{**ns.__dict__, "numerics": fingerprint.numerics_text(args, mc, fields)})
        )

    return make


def _kv_scales(tmp_path: Path, value: float) -> str:
    path = tmp_path / f"kv_scales_{value}.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": value, "1": value}}},
            }
        )
    )
    return str(path)


NUMERICS_CASES = {
    "dtype": ("--dtype", "bfloat16"),
    "quantization": ("--quantization", "w8a8_int8"),
    "kv_cache_dtype": ("--kv-cache-dtype", "fp8_e5m2"),
    "load_format": ("--load-format", "dummy"),
    "model_impl": ("--model-impl", "transformers"),
    "json_model_override_args": ("--json-model-override-args", '{"rope_theta": 5000.0}'),
}


@pytest.mark.parametrize("field", list(NUMERICS_CASES))
def test_each_numerics_flag_changes_the_namespace(namespace_of, field):
    base = namespace_of()
    changed = namespace_of(*NUMERICS_CASES[field])
    assert changed.chain_digest() != base.chain_digest() and changed.digest() != base.digest()
    assert f"{field}=" in changed.numerics
    # Negative control, built in: without this field in the hash the two collide (so the
    # assertion above is this field's doing, not some other difference).
    fields = tuple(f for f in fingerprint.NUMERICS_FIELDS if f[0] != field)
    if field != "json_model_override_args":  # the override also reaches the hashed HF config
        assert (
            namespace_of(*NUMERICS_CASES[field], fields=fields).chain_digest()
            == namespace_of(fields=fields).chain_digest()
        )


def test_kv_scales_file_content_changes_the_namespace(namespace_of, tmp_path):
    path = _kv_scales(tmp_path, 0.5)
    first = namespace_of("--quantization-param-path", path).chain_digest()
    assert first == namespace_of("--quantization-param-path", path).chain_digest()
    Path(path).write_text(Path(path).read_text().replace("0.5", "0.25"))
    assert namespace_of("--quantization-param-path", path).chain_digest() != first


def test_lm_head_precision_does_not_change_the_namespace(namespace_of):
    """The LM head runs after the last layer wrote its KV: same KV, same namespace."""
    assert namespace_of("--enable-fp32-lm-head").chain_digest() == namespace_of().chain_digest()


def test_other_weights_change_the_namespace(namespace_of, tiny_model, model_copy):
    folder = model_copy("ns-weights")
    _rewrite_tensor(Path(tiny_model), folder, _tensor_names(folder)[-1], lambda t: t * 1.0001)
    assert namespace_of(model=folder).chain_digest() != namespace_of(model=model_copy("ns-same")).chain_digest()
    assert namespace_of(model=model_copy("ns-same2")).chain_digest() == namespace_of().chain_digest()


def _write_adapter(folder: Path, seed: int, hidden: int = 256) -> Path:
    """A PEFT LoRA adapter folder (rank 4 on q_proj and v_proj of both layers) with
    seeded weights."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 4,
                "lora_alpha": 8,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": ["q_proj", "v_proj"],
                "task_type": "CAUSAL_LM",
            }
        )
    )
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                hidden if proj == "q_proj" else 128, 4, generator=generator
            )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_a_retrained_adapter_at_the_same_path_changes_the_namespace(tmp_path):
    """SGLang names a startup adapter uuid5(name, path): the same after the adapter at that
    path is retrained, so its files must be in the namespace (they were not: the SSD and
    remote tiers served the old adapter's KV to the new one)."""
    from types import SimpleNamespace

    path = _write_adapter(tmp_path / "adapter", seed=1)
    args = SimpleNamespace(lora_paths=[f"a={path}"])
    first = fingerprint.adapters_text(args)
    assert first == fingerprint.adapters_text(SimpleNamespace(lora_paths=[f"a={path}"]))
    _write_adapter(path, seed=2)  # retrained, saved at the same path
    second = fingerprint.adapters_text(args)
    assert second != first and second.startswith("a=")
    # The forms SGLang holds the flag in name the same adapter the same way.
    ref = SimpleNamespace(lora_name="a", lora_path=str(path))
    assert fingerprint.adapters_text(SimpleNamespace(lora_paths=[ref])) == second
    assert fingerprint.adapters_text(SimpleNamespace(lora_paths={"a": str(path)})) == second
    assert fingerprint.adapters_text(SimpleNamespace(lora_paths=None)) == ""
    mc = SimpleNamespace(hf_config=None, model_path=str(tmp_path))
    assert model_fingerprint(mc, str(tmp_path), adapters=first) != model_fingerprint(mc, str(tmp_path), adapters=second)
    assert fingerprint.unresolved_adapters(SimpleNamespace(lora_paths=["b=org/not-here"])) == ["b=org/not-here"]


def test_a_disk_update_gets_the_fresh_servers_fingerprint(tiny_model, model_copy):
    """The fingerprint a server moves to on /update_weights_from_disk is the one a server
    started on that checkpoint has (so a rollback finds its records), and an in-memory
    update's is new each time."""
    from types import SimpleNamespace

    other = model_copy("update-target")
    _rewrite_tensor(Path(tiny_model), other, _tensor_names(other)[0], lambda t: t + 1)
    mc = SimpleNamespace(hf_config=None, model_path=str(tiny_model))
    started_on_other = model_fingerprint(SimpleNamespace(hf_config=None, model_path=str(other)), str(other))
    assert model_fingerprint(mc, str(tiny_model), weights_path=str(other)) == started_on_other
    assert model_fingerprint(mc, str(tiny_model)) != started_on_other
    one, two = (fingerprint.in_memory_update_fingerprint(started_on_other, n) for n in (1, 2))
    assert one != two and one.startswith(fingerprint.IN_MEMORY_UPDATE_TAG)


def test_a_retrained_adapter_at_the_same_path_changes_the_server_namespace(namespace_of, tmp_path):
    """Through SGLang's real flag resolution: the server's namespace follows the files of a
    --lora-paths adapter, not its name and path (SGLang's id for it)."""
    path = _write_adapter(tmp_path / "adapter", seed=1)
    lora = (
        "--enable-lora",
        "--lora-paths",
        f"a={path}",
        "--max-lora-rank",
        "4",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
    )
    first = namespace_of(*lora).chain_digest()
    assert namespace_of(*lora).chain_digest() == first
    _write_adapter(path, seed=2)
    assert namespace_of(*lora).chain_digest() != first
