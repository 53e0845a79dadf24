from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pcr_sglang.config import PCRConfig, PCRConfigError
from pcr_sglang.install_check import check_sglang_install

REPO = Path(__file__).resolve().parents[2]


def load_apply_patches():
    spec = importlib.util.spec_from_file_location("apply_patches", REPO / "scripts" / "apply_patches.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["apply_patches"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "chunk_size,page_size,message",
    [
        (0, 1, "--pcr-chunk-size must be a positive"),
        (-16, 1, "--pcr-chunk-size must be a positive"),
        (24, 16, r"--pcr-chunk-size \(24\) must be a multiple of --page-size \(16\)"),
        ("64", 1, "--pcr-chunk-size must be a positive integer, got .64."),
    ],
)
def test_invalid_chunk_size_names_the_flag(chunk_size, page_size, message):
    with pytest.raises(PCRConfigError, match=message):
        PCRConfig(enabled=True, chunk_size=chunk_size).validate(page_size)


def test_config_from_server_args_defaults():
    config = PCRConfig.from_server_args(SimpleNamespace())
    assert config == PCRConfig(enabled=False, chunk_size=64, lookahead_window=8, dram_gb=0.0)
    config.validate(page_size=16)


@pytest.mark.parametrize("window", [-1, 1.5, True])
def test_invalid_lookahead_window_names_the_flag(window):
    with pytest.raises(PCRConfigError, match="--pcr-lookahead-window must be an integer >= 0"):
        PCRConfig(enabled=True, lookahead_window=window).validate(page_size=1)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"layerwise": "sometimes"}, "--pcr-layerwise must be one of off, load, offload, both"),
        ({"ssd_gb": 1.0}, "--pcr-ssd-gb needs --pcr-ssd-path"),
        ({"ssd_path": "/x"}, "--pcr-ssd-path needs --pcr-ssd-gb > 0"),
        ({"ssd_path": "/x", "ssd_gb": 1.0}, "--pcr-ssd-path needs --pcr-dram-gb > 0"),
        ({"ssd_path": "/x", "ssd_gb": -1.0}, "--pcr-ssd-gb must be a number of GB >= 0"),
        ({"ssd_reserve_gb": -1}, "--pcr-ssd-reserve-gb must be a number of GB >= 0"),
        (
            {"ssd_path": "/x", "ssd_gb": 1.0, "dram_gb": 1.0, "ssd_write": "later"},
            "--pcr-ssd-write must be one of through, on-evict",
        ),
        ({"ssd_read_threads": 0}, "--pcr-ssd-read-threads must be an integer from 1 to 64, got 0"),
        ({"ssd_read_threads": 65}, "--pcr-ssd-read-threads must be an integer from 1 to 64"),
        ({"ssd_read_threads": 2.5}, "--pcr-ssd-read-threads must be an integer from 1 to 64"),
        ({"ssd_keep_namespaces": -1}, "--pcr-ssd-keep-namespaces must be an integer >= 0, got -1"),
        ({"ssd_keep_namespaces": 1.5}, "--pcr-ssd-keep-namespaces must be an integer >= 0"),
        ({"hint_to_device": "always"}, "--pcr-hint-to-device must be one of auto, on, off, got 'always'"),
    ],
)
def test_invalid_tier_flags_name_the_flag(fields, message):
    with pytest.raises(PCRConfigError, match=message):
        PCRConfig(enabled=True, **fields).validate(page_size=1)


def test_installed_sglang_is_patched():
    assert check_sglang_install() is None


def test_patch_applier_is_idempotent_and_detects_conflicts(tmp_path):
    ap = load_apply_patches()
    original = "a\nb\nc\nd\ne\nf\ng\n"
    diff = (
        "Header text explaining why.\n"
        "--- a/pkg/mod.py\n+++ b/pkg/mod.py\n"
        "@@ -2,4 +2,5 @@\n b\n c\n+inserted\n d\n-e\n+E\n"
    )
    (fp,) = ap.parse_patch(diff)
    assert fp.path == "pkg/mod.py"
    patched, state = ap.apply_file_patch(original, fp)
    assert state == "applied" and patched == "a\nb\nc\ninserted\nd\nE\nf\ng\n"
    again, state = ap.apply_file_patch(patched, fp)
    assert state == "already" and again == patched
    _, state = ap.apply_file_patch("something else entirely\n", fp)
    assert state == "conflict"


def test_every_patch_has_a_why_header_and_parses():
    ap = load_apply_patches()
    patches = sorted((REPO / "patches").glob("*/*.patch"))
    assert patches
    for path in patches:
        text = path.read_text()
        header = text.split("\n--- ", 1)[0]
        assert "Why" in header or "why" in header, path
        assert ap.parse_patch(text), path


def test_install_check_rejects_modified_sglang(tmp_path, monkeypatch):
    from importlib import metadata

    import pcr_sglang.install_check as ic

    root = Path(metadata.distribution("sglang").locate_file(""))
    stamp = json.loads((root / "sglang" / ic.STAMP_NAME).read_text())
    fake_root = tmp_path
    (fake_root / "sglang").mkdir()
    for rel in stamp["files"]:
        target = fake_root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("# not the patched file\n")
    (fake_root / "sglang" / ic.STAMP_NAME).write_text(json.dumps(stamp))

    class FakeDist:
        version = "0.5.23"

        def locate_file(self, _):
            return fake_root

    monkeypatch.setattr(ic.metadata, "distribution", lambda name: FakeDist())
    monkeypatch.setattr(ic.metadata, "version", lambda name: FakeDist.version)
    problem = ic.check_sglang_install()
    assert problem is not None and "changed after pcr-sglang's patches" in problem.message
    (fake_root / "sglang" / ic.STAMP_NAME).unlink()
    problem = ic.check_sglang_install()
    assert problem is not None and "without pcr-sglang's patches" in problem.message


def test_unpatched_install_guards_explain_the_problem():
    from pcr_sglang.plugin import PCRStartupError, _make_argv_guard

    argv_guard = _make_argv_guard("SGLang 0.5.22 is installed")
    assert argv_guard(["--model-path", "m"]) is None  # plain SGLang use is untouched
    with pytest.raises(PCRStartupError, match="--enable-pcr cannot be used: SGLang 0.5.22"):
        argv_guard(["--model-path", "m", "--pcr-chunk-size", "32"])


def test_every_flag_is_a_config_field_of_its_declared_type_and_default():
    """PCRConfig is derived from PcrFlags: each field names its flag and takes the flag's
    declared default (layerwise holds ``auto`` resolved); only the flags read where they
    are used are left out."""
    import typing
    from dataclasses import fields

    import msgspec

    from pcr_sglang.config import flag_rule
    from pcr_sglang.flags import DEFAULT_LAYERWISE, PcrFlags

    declared = {f.name: f for f in msgspec.structs.fields(PcrFlags)}
    config_hints = typing.get_type_hints(PCRConfig)
    taken = {}
    for f in fields(PCRConfig):
        rule = f.metadata["flag"]
        taken[rule.name] = f.name
        flag_type = typing.get_args(typing.get_type_hints(PcrFlags, include_extras=True)[rule.name])[0]
        assert config_hints[f.name] == flag_type, f.name
        assert f.default == (DEFAULT_LAYERWISE if f.name == "layerwise" else declared[rule.name].default), f.name
        assert rule.kind in (bool, int, float, str) and flag_rule(rule.name).range == rule.range
    assert set(declared) - set(taken) == {"pcr_doc_format", "pcr_debug_checks"}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dram_gb": float("nan")}, "--pcr-dram-gb must be a number of GB >= 0, got nan"),
        ({"prefetch_window": -1}, "--pcr-prefetch-window must be an integer >= 0, got -1"),
        ({"prefetch_budget_mb": "2"}, "--pcr-prefetch-budget-mb must be an integer >= 0, got '2'"),
        ({"hint_budget_mb": True}, "--pcr-hint-budget-mb must be an integer >= 0, got True"),
        ({"hint_max_ttl_s": 0}, "--pcr-hint-max-ttl-s must be a positive number, got 0"),
        ({"hint_rate": True}, "--pcr-hint-rate must be a positive number, got True"),
        ({"doc_recompute_ratio": 1.5}, r"--pcr-doc-recompute-ratio must be a number in \[0, 1\], got 1.5"),
        ({"doc_anchor_tokens": -1}, "--pcr-doc-anchor-tokens must be an integer >= 0, got -1"),
        ({"doc_reuse": "all"}, "--pcr-doc-reuse must be one of off, reorder, concat, lego, blend, got 'all'"),
        ({"doc_selector": "best"}, "--pcr-doc-selector must be one of deviation, gradual, query, prophet"),
        ({"ssd_durability": "sometimes"}, "--pcr-ssd-durability must be one of record, batch, none"),
        ({"remote": "redis"}, "--pcr-remote must be one of off, mooncake, got 'redis'"),
        ({"remote": "mooncake"}, "--pcr-remote mooncake needs the SSD tier"),
        ({"remote_config": "{}"}, "--pcr-remote-config needs --pcr-remote mooncake"),
    ],
)
def test_each_declared_range_and_choice_is_checked_naming_the_flag(fields, message):
    with pytest.raises(PCRConfigError, match=message):
        PCRConfig(enabled=True, **fields).validate(page_size=1)


def test_config_from_server_args_reads_each_flag_as_declared():
    args = SimpleNamespace(
        enable_pcr=1, pcr_ssd_path="", pcr_doc_reuse_calibration_warn=0, pcr_chunk_size=32, pcr_doc_recompute_ratio=0.5
    )
    config = PCRConfig.from_server_args(args)
    assert (config.enabled, config.ssd_path, config.doc_reuse_calibration_warn) == (True, None, False)
    assert (config.chunk_size, config.doc_recompute_ratio, config.layerwise) == (32, 0.5, "both")
    assert PCRConfig.from_server_args(None) == PCRConfig()
