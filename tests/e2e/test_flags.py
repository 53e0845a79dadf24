"""Bad PCR flags fail at startup with a message naming the flag."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def resolve():
    """Parse and resolve CLI args exactly as launch_server does, plugins loaded."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    def _resolve(model_path, *flags):
        args = prepare_server_args(["--model-path", model_path, "--device", "cpu", *flags])
        args.resolve_once()
        return args

    return _resolve


def test_valid_flags_resolve(resolve, tiny_model):
    args = resolve(
        tiny_model, "--enable-pcr", "--pcr-chunk-size", "32", "--page-size", "16", "--pcr-lookahead-window", "0"
    )
    assert args.enable_pcr is True and args.pcr_chunk_size == 32 and args.pcr_lookahead_window == 0


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--pcr-chunk-size", "0"), "--pcr-chunk-size must be a positive"),
        (("--page-size", "16", "--pcr-chunk-size", "24"), "must be a multiple of --page-size"),
        (("--pcr-lookahead-window", "-1"), "--pcr-lookahead-window must be an integer >= 0"),
        (("--pcr-dram-gb", "-1"), "--pcr-dram-gb must be a number of GB >= 0"),
        (("--disable-radix-cache",), "cannot be combined with --disable-radix-cache"),
        (("--enable-hierarchical-cache",), "cannot be combined with --enable-hierarchical-cache"),
        (("--radix-cache-backend", "flexkv"), "drop --radix-cache-backend=flexkv"),
        (("--radix-eviction-policy", "slru"), "drop --radix-eviction-policy slru"),
        (("--pcr-dram-gb", "0.01", "--enable-two-batch-overlap"), "--enable-two-batch-overlap"),
        (("--pcr-doc-reuse", "concat", "--page-size", "16"), "--pcr-doc-reuse concat needs --page-size 1"),
        (("--pcr-doc-reuse", "concat", "--kv-cache-dtype", "fp8_e4m3"), "--kv-cache-dtype fp8_e4m3 is quantized"),
        (
            ("--pcr-doc-reuse", "blend", "--pcr-doc-recompute-ratio", "1.5"),
            r"--pcr-doc-recompute-ratio must be a number in \[0, 1\], got 1.5",
        ),
        (
            ("--pcr-doc-reuse", "lego", "--pcr-doc-recompute-tokens", "-3"),
            "--pcr-doc-recompute-tokens must be an integer >= 0, got -3",
        ),
        (
            ("--pcr-doc-reuse", "lego", "--attention-backend", "flashinfer"),
            "--pcr-doc-reuse lego recomputes tokens inside a permuted row, which needs the torch_native or triton",
        ),
    ],
)
def test_invalid_flags_fail_naming_the_flag(resolve, tiny_model, flags, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        resolve(tiny_model, "--enable-pcr", *flags)


def test_doc_reuse_needs_pcr(resolve, tiny_model):
    with pytest.raises((ValueError, RuntimeError), match="--pcr-doc-reuse needs --enable-pcr"):
        resolve(tiny_model, "--pcr-doc-reuse", "concat")


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--pcr-chunk-size", "big"), "--pcr-chunk-size"),
        (("--pcr-bogus", "1"), "--pcr-bogus"),
        (("--pcr-doc-reuse", "blend-everything"), "--pcr-doc-reuse"),
    ],
)
def test_malformed_and_unknown_options_are_argparse_errors(resolve, tiny_model, flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        resolve(tiny_model, "--enable-pcr", *flags)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


def test_launch_server_exits_fast_with_clear_message(tiny_model):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            tiny_model,
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--enable-pcr",
            "--pcr-chunk-size",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    assert "--pcr-chunk-size must be a positive integer, got 0" in proc.stderr


def test_dram_tier_larger_than_memory_fails_at_startup(tiny_model):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            tiny_model,
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--max-total-tokens",
            "2048",
            "--enable-pcr",
            "--pcr-dram-gb",
            "100000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "--pcr-dram-gb 100000" in proc.stderr and "of memory is available" in proc.stderr


def test_unsupported_model_is_refused_before_any_weight_loads(tiny_model, tmp_path):
    """A sliding-window model folder with no weight files at all: with --enable-pcr the
    launcher fails naming the model and the flag, and SGLang never begins loading weights
    (a refusal where the tree cache is built, after the weights, would instead fail on the
    missing weights, as the same folder without --enable-pcr does)."""
    import json
    import shutil
    from pathlib import Path

    for f in Path(tiny_model).iterdir():
        if "token" in f.name:
            shutil.copy(f, tmp_path)
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    config.update(is_hybrid_swa=True, sliding_window=64)  # SGLang's opt-in for hybrid-SWA models
    (tmp_path / "config.json").write_text(json.dumps(config))

    def launch(*flags):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "sglang.launch_server",
                "--model-path",
                str(tmp_path),
                "--device",
                "cpu",
                "--attention-backend",
                "torch_native",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return proc.returncode, proc.stdout + proc.stderr

    with ThreadPoolExecutor(2) as pool:  # two launches side by side: each is mostly imports on one core
        with_pcr, without = pool.submit(launch, "--enable-pcr"), pool.submit(launch)
    rc, log = with_pcr.result()
    assert rc != 0
    assert "--enable-pcr supports models whose layers all use full attention" in log
    assert "has sliding-window layers" in log and "--model-path" in log
    assert "Load weight begin" not in log
    rc, log = without.result()
    assert rc != 0 and "Load weight begin" in log and "full attention" not in log
