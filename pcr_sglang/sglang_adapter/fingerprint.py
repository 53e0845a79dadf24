"""What goes into the cache namespace about the model: same namespace, same KV bytes for
the same tokens. Two parts:

* :func:`model_fingerprint`, the weights' identity: the full model config, and for each
  weight file SGLang may load (found in the local folder SGLang loads from: a hub id is
  resolved, without network, to the snapshot ``huggingface_hub`` already holds) its
  name, its size, and

  - safetensors: a digest of the whole header (every tensor's name, dtype, shape and
    byte offsets) plus ``_WINDOW`` bytes at the start, the middle and the end of every
    tensor's data (of at most ``_MAX_SAMPLED_TENSORS`` tensors per file, evenly spread);
  - other formats (``.bin``, ``.pt``, ``.gguf``): ``_OPAQUE_WINDOWS`` windows of
    ``_OPAQUE_WINDOW_BYTES`` spread evenly from the first byte to the last;

  and the content of every ``*.index.json`` (which tensor lives in which shard).

  Hashing every byte of a multi-hundred-GB checkpoint would take minutes per start; this
  reads a few hundred KB per file. **What collides**: two checkpoints with the same config,
  the same file names and sizes, byte-identical safetensors headers, and identical bytes
  in every sampled window, that differ only elsewhere — an edit confined to the interior
  of some tensors (e.g. surgery on a few rows, or a fine-tune restricted to a few
  embedding rows), or, for non-safetensors files, any change between the sampled windows.
  That is acceptable because a fine-tune, a different training run, a re-quantization or
  a different revision changes (nearly) every element of every tensor it trains, hence
  every window; the remaining case is a deliberate partial edit in place, for which the
  README tells the user to use a fresh ``--pcr-ssd-path``. Modification times are not
  hashed on purpose: a copied or re-downloaded identical checkpoint keeps its cache.
  The fingerprint is computed where the tree cache is built, after SGLang has loaded (and
  so downloaded) the weights. A model whose files are still not found locally falls back
  to the id and revision, with a warning; with the SSD or remote tier on, that is refused
  (``refusals.check_weights_local``: two revisions under one name would share their KV).
  A disk update to a path that is not a local folder never gets a name-only fingerprint
  either (:class:`WeightsNotLocal`).

* :func:`numerics_text`, every flag that changes the KV values computed from the same
  weights (see ``NUMERICS_FIELDS`` for each one and why). Flags that only change rounding
  (attention / MoE / GEMM backend choice, CUDA graphs, torch.compile, deterministic
  inference) are left out: they perturb KV the way batch composition already does for
  SGLang's own radix cache. ``--enable-fp32-lm-head`` is left out because the LM head
  runs after the last layer has written its KV. Which LoRA adapter a request uses is in its
  root key (SGLang's ``extra_key``); what the startup adapters' files hold is in the model
  fingerprint (:func:`adapters_text`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any, Optional

from pcr_sglang.core import CacheNamespace

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WINDOW = 64
_MAX_SAMPLED_TENSORS = 2048
_MAX_HEADER_BYTES = 256 << 20
_OPAQUE_WINDOWS = 32
_OPAQUE_WINDOW_BYTES = 64 << 10

# (ServerArgs field, why it changes the KV values). ``dtype`` and ``quantization`` are read
# from SGLang's resolved ModelConfig (the checkpoint's own quantization included).
NUMERICS_FIELDS: tuple[tuple[str, str], ...] = (
    ("dtype", "activation dtype: every K and V is computed in it"),
    ("quantization", "weight quantization (--quantization or the checkpoint's) changes every projection"),
    ("kv_cache_dtype", "the KV recipe: nvfp4 and fp4_mx_block16 share a torch dtype but not values"),
    ("quantization_param_path", "KV scaling factors (its content is hashed)"),
    ("load_format", "e.g. 'dummy' weights are random, not the files'"),
    ("model_impl", "SGLang's or the Transformers implementation of the model"),
    ("json_model_override_args", "config overrides (RoPE scaling, ...)"),
    ("modelopt_quant", "online ModelOpt quantization"),
    ("modelopt_checkpoint_restore_path", "a ModelOpt quantized checkpoint replaces the weights"),
    ("quantize_and_serve", "online ModelOpt quantization"),
    ("rl_quant_profile", "FlashRL quantization profile"),
)


def _config_text(model_config: Any) -> str:
    """The HF config as SGLang resolved it (overrides applied), without where it was read
    from: a copy of the same checkpoint elsewhere keeps its cache."""
    hf_config = getattr(model_config, "hf_config", None)
    to_dict = getattr(hf_config, "to_dict", None)
    if to_dict is None:
        return repr(hf_config)
    config = {k: v for k, v in to_dict().items() if k != "_name_or_path"}
    return json.dumps(config, sort_keys=True, default=repr)


def resolve_weights_dir(
    model_path: str, revision: Optional[str] = None, download_dir: Optional[str] = None
) -> Optional[Path]:
    """The local folder (or single weight file) SGLang loads ``model_path`` from; None if a
    hub id is not in the local cache. Never uses the network."""
    path = Path(model_path)
    if path.is_dir() or path.is_file():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_path, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception as e:  # not a hub id, or not downloaded: fall back to the name
        logger.warning(
            "PCR: cannot find the local files of --model-path %s (%s); the cache "
            "namespace uses the name and revision only",
            model_path,
            e,
        )
        return None


class WeightsNotLocal(LookupError):
    """The weights' files are not on this machine: a fingerprint would be their name only."""


def _weights_path(model_config: Any, model_path: str, weights_path: Optional[str] = None) -> str:
    """The path SGLang loads the weights from (its model config's, once resolved)."""
    return weights_path or str(getattr(model_config, "model_path", None) or model_path)


def weights_are_local(
    model_config: Any, model_path: str, revision: Optional[str] = None, download_dir: Optional[str] = None
) -> bool:
    """Whether :func:`model_fingerprint` reads the weights' files (False: their name only)."""
    return resolve_weights_dir(_weights_path(model_config, model_path), revision, download_dir) is not None


def _weight_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())


def _safetensors_header(fd: int, size: int) -> Optional[tuple[bytes, int, dict[str, Any]]]:
    """(raw header, data start, parsed header), or None if the file is not safetensors."""
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > min(size - 8, _MAX_HEADER_BYTES):
        return None
    raw = os.pread(fd, length, 8)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    return (raw, 8 + length, header) if isinstance(header, dict) else None


def _tensor_windows(header: dict[str, Any], data_start: int) -> list[int]:
    spans = sorted(
        tuple(v["data_offsets"])
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2
    )
    if len(spans) > _MAX_SAMPLED_TENSORS:
        step = len(spans) / _MAX_SAMPLED_TENSORS
        spans = [spans[int(i * step)] for i in range(_MAX_SAMPLED_TENSORS)]
    offsets = []
    for begin, end in spans:
        last = max(end - _WINDOW, begin)
        offsets += [data_start + begin, data_start + (begin + last) // 2, data_start + last]
    return offsets


def _hash_file(h: Any, f: Path, rel: str) -> None:
    size = f.stat().st_size
    h.update(f"|file={rel}:{size}".encode())
    fd = os.open(f, os.O_RDONLY)
    try:
        parsed = _safetensors_header(fd, size) if f.suffix == ".safetensors" else None
        if parsed is not None:
            raw, data_start, header = parsed
            h.update(b"|header=" + hashlib.blake2b(raw, digest_size=16).digest())
            for off in _tensor_windows(header, data_start):
                h.update(os.pread(fd, _WINDOW, off))
            return
        span = max(size - _OPAQUE_WINDOW_BYTES, 0)
        for i in range(_OPAQUE_WINDOWS):
            h.update(os.pread(fd, _OPAQUE_WINDOW_BYTES, span * i // (_OPAQUE_WINDOWS - 1)))
    finally:
        os.close(fd)


def weights_digest(root: Path) -> str:
    """The weights' identity of a local model folder (or single weight file)."""
    h = hashlib.blake2b(digest_size=16)
    files = _weight_files(root)
    if not files:
        h.update(f"|no-weight-files={os.path.normpath(root)}".encode())
    for f in files:
        _hash_file(h, f, f.name)
    if root.is_dir():
        for index in sorted(root.glob("*.index.json")):
            h.update(f"|index={index.name}:".encode() + index.read_bytes())
    return h.hexdigest()


def model_fingerprint(
    model_config: Any,
    model_path: str,
    revision: Optional[str] = None,
    download_dir: Optional[str] = None,
    *,
    weights_path: Optional[str] = None,
    adapters: str = "",
    require_files: bool = False,
) -> str:
    """Config + weights identity (see the module docstring for what it reads).

    ``weights_path``: the folder the weights are read from when it is not the one SGLang
    started with (``/update_weights_from_disk`` loads another checkpoint into the same
    config). ``adapters``: :func:`adapters_text` of the startup LoRA adapters.
    ``require_files``: raise :class:`WeightsNotLocal` instead of naming weights whose files
    are not found by their path alone."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_config_text(model_config).encode())
    h.update(f"|revision={revision}".encode())
    path = _weights_path(model_config, model_path, weights_path)
    root = resolve_weights_dir(path, revision, download_dir)
    if root is None:
        if require_files:
            raise WeightsNotLocal(f"the files of {path} are not on this machine")
        h.update(f"|path={path}".encode())
    else:
        h.update(f"|weights={weights_digest(root)}".encode())
    if adapters:
        h.update(f"|adapters={adapters}".encode())
    return h.hexdigest()


def in_memory_update_fingerprint(previous: str, nonce: int) -> str:
    """The fingerprint after an update whose weights have no files to read
    (``/update_weights_from_tensor``, ``_from_distributed``, ``_from_ipc``): the previous
    fingerprint and a nonce the TP ranks agreed on, so no other server, restart or update
    ever has the same one (two servers updated with different tensors must not share KV,
    and a server cannot tell two tensor updates apart by their content)."""
    return f"{IN_MEMORY_UPDATE_TAG}{hashlib.blake2b(f'{previous}|{nonce}'.encode(), digest_size=16).hexdigest()}"


IN_MEMORY_UPDATE_TAG = "in-memory-update:"


def _adapter_paths(lora_paths: Any) -> list[tuple[str, str]]:
    """(name, path) of each startup adapter, whatever form SGLang holds them in (LoRARef
    objects once resolved, dicts, ``name=path`` strings, or a name -> path dict)."""
    if not lora_paths:
        return []
    if isinstance(lora_paths, dict):
        return sorted((str(k), str(v)) for k, v in lora_paths.items())
    pairs = []
    for entry in lora_paths:
        if isinstance(entry, str):
            name, _, path = entry.partition("=")
            pairs.append((name, path or name))
        elif isinstance(entry, dict):
            pairs.append((str(entry.get("lora_name")), str(entry.get("lora_path"))))
        else:
            pairs.append((str(getattr(entry, "lora_name", None)), str(getattr(entry, "lora_path", None))))
    return sorted(pairs)


def adapters_text(server_args: Any) -> str:
    """The identity of the startup LoRA adapters (``--lora-paths``): each one's name and
    the digest of its files (weights and ``adapter_config.json``).

    SGLang names a startup adapter ``uuid5(name, path)`` and puts that id in every request's
    ``extra_key``: the same across restarts and servers, so without the files' digest a
    retrained adapter saved at the same path would be served the old adapter's KV from the
    SSD and remote tiers. An adapter whose files cannot be found locally is named by its
    path alone; :func:`unresolved_adapters` lets the support check refuse persistent tiers
    for it. Adapters loaded at run time get a random id from SGLang and never share KV."""
    parts = []
    for name, path in _adapter_paths(getattr(server_args, "lora_paths", None)):
        root = Path(path)
        if root.is_dir():
            h = hashlib.blake2b(digest_size=16)
            h.update(f"|weights={weights_digest(root)}".encode())
            for config in sorted(root.glob("*.json")):
                h.update(f"|{config.name}:".encode() + config.read_bytes())
            parts.append(f"{name}={h.hexdigest()}")
        elif root.is_file():
            parts.append(f"{name}={weights_digest(root)}")
        else:
            parts.append(f"{name}=path:{path}")
    return ";".join(parts)


def unresolved_adapters(server_args: Any) -> list[str]:
    """Startup adapters whose files are not on this machine (a hub id SGLang downloads)."""
    return [
        f"{name}={path}"
        for name, path in _adapter_paths(getattr(server_args, "lora_paths", None))
        if not Path(path).exists()
    ]


def _file_digest(path: Optional[str]) -> str:
    if not path:
        return "None"
    try:
        return f"{path}@{hashlib.blake2b(Path(path).read_bytes(), digest_size=16).hexdigest()}"
    except OSError:
        return str(path)


def numerics_text(
    server_args: Any, model_config: Any = None, fields: tuple[tuple[str, str], ...] = NUMERICS_FIELDS
) -> str:
    """The numerics flags, canonical (``name=value;...``), as the namespace records them."""
    parts = []
    for name, _why in fields:
        value = getattr(server_args, name, None)
        if name in ("dtype", "quantization") and model_config is not None:
            value = getattr(model_config, name, value)  # the resolved value
        if name in ("quantization_param_path", "rl_quant_profile"):
            value = _file_digest(value)
        elif isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        parts.append(f"{name}={value}")
    return ";".join(parts)


def cache_namespace(
    server_args: Any, model_config: Any, kv_dtype: str, chunk_size: int, tp_rank: int = 0, tp_size: int = 1
) -> CacheNamespace:
    """The cache namespace of a server: its weights, its numerics flags, its KV pool."""
    return CacheNamespace(
        model_fingerprint=model_fingerprint(
            model_config,
            server_args.model_path,
            getattr(server_args, "revision", None),
            getattr(server_args, "download_dir", None),
            # mutant: lora-adapter-files-not-in-the-namespace
            adapters=adapters_text(server_args),
        ),
        kv_dtype=kv_dtype,
        chunk_size=chunk_size,
        layout="token-major",
        tp_rank=tp_rank,
        tp_size=tp_size,
        numerics=numerics_text(server_args, model_config),
    )
