"""Bad PCR flags fail at startup with a message naming the flag."""

from __future__ import annotations

import subprocess
import sys

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
    args = resolve(tiny_model, "--enable-pcr", "--pcr-chunk-size", "32", "--page-size", "16",
                   "--pcr-lookahead-window", "0")
    assert args.enable_pcr is True and args.pcr_chunk_size == 32 and args.pcr_lookahead_window == 0


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--pcr-chunk-size", "0"), "--pcr-chunk-size must be a positive"),
        (("--page-size", "16", "--pcr-chunk-size", "24"), "must be a multiple of --page-size"),
        (("--pcr-lookahead-window", "-1"), "--pcr-lookahead-window must be a non-negative integer"),
        (("--pcr-dram-gb", "-1"), "--pcr-dram-gb must be a number of GB >= 0"),
        (("--disable-radix-cache",), "cannot be combined with --disable-radix-cache"),
        (("--enable-hierarchical-cache",), "cannot be combined with --enable-hierarchical-cache"),
        (("--radix-cache-backend", "flexkv"), "drop --radix-cache-backend=flexkv"),
    ],
)
def test_invalid_flags_fail_naming_the_flag(resolve, tiny_model, flags, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        resolve(tiny_model, "--enable-pcr", *flags)


@pytest.mark.parametrize(
    "flags,message",
    [(("--pcr-chunk-size", "big"), "--pcr-chunk-size"), (("--pcr-bogus", "1"), "--pcr-bogus")],
)
def test_malformed_and_unknown_options_are_argparse_errors(resolve, tiny_model, flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        resolve(tiny_model, "--enable-pcr", *flags)
    assert exc.value.code != 0
    assert message in capsys.readouterr().err


def test_launch_server_exits_fast_with_clear_message(tiny_model):
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", tiny_model, "--device", "cpu",
         "--attention-backend", "torch_native", "--enable-pcr", "--pcr-chunk-size", "0"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode != 0
    assert "--pcr-chunk-size must be a positive number of tokens, got 0" in proc.stderr


def test_dram_tier_larger_than_memory_fails_at_startup(tiny_model):
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", tiny_model, "--device", "cpu",
         "--attention-backend", "torch_native", "--max-total-tokens", "2048", "--enable-pcr",
         "--pcr-dram-gb", "100000"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "--pcr-dram-gb 100000" in proc.stderr and "of memory is available" in proc.stderr
