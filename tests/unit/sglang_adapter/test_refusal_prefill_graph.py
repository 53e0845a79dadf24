"""Layer-wise loads with a prefill CUDA graph that is not full (SGLang's default on CUDA is
``breakable``): refused, naming both flags, until a GPU run shows the per-layer read hook
runs at replay (issue 42, item 7)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pcr_sglang.config import PCRConfig
from pcr_sglang.sglang_adapter import refusals
from pcr_sglang.sglang_adapter.refusals import SupportInputs


def inputs(layerwise: str, backend: str, dram: bool = True) -> SupportInputs:
    cfg = SimpleNamespace(cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend=backend)))
    pcr = (
        PCRConfig(enabled=True, dram_gb=0.01, layerwise=layerwise)
        if dram
        else PCRConfig(enabled=True, layerwise=layerwise)
    )
    return SupportInputs(cfg, pcr)


@pytest.mark.parametrize(
    "layerwise, backend, refused",
    [
        ("both", "breakable", True),
        ("load", "breakable", True),
        ("offload", "breakable", False),
        ("off", "breakable", False),
        ("both", "disabled", False),
        ("both", "full", False),  # full: its own rule
    ],
)
def test_layerwise_loads_with_a_breakable_prefill_graph_are_refused_naming_both_flags(layerwise, backend, refused):
    reason = refusals.check_graph_prefill_layerwise(inputs(layerwise, backend))
    assert (reason is not None) == refused
    if refused:
        assert f"--pcr-layerwise {layerwise}" in reason and "--cuda-graph-backend-prefill disabled" in reason
        assert "--pcr-layerwise offload" in reason
    assert refusals.check_graph_prefill_layerwise(inputs(layerwise, backend, dram=False)) is None


def test_the_rule_runs_with_the_others_and_the_full_graph_advice_is_not_refused_by_it():
    assert refusals.check_graph_prefill_layerwise in refusals.RULES
    full = refusals.check_full_prefill_graph(inputs("both", "full"))
    assert full is not None and "--cuda-graph-backend-prefill disabled" in full
    assert refusals.unsupported_reasons(inputs("both", "disabled")) == []


@pytest.mark.parametrize(
    "graph_flags, resolved", [(("--cuda-graph-backend-prefill", "breakable"), "offload"), ((), "both")]
)
def test_the_default_layerwise_setting_is_served_under_sglangs_default_prefill_graph(tiny_model, graph_flags, resolved):
    """SGLang's prefill graph is ``breakable`` by default on CUDA, so a default of ``both``
    would refuse ``--enable-pcr --pcr-dram-gb N`` on every GPU: ``auto`` (the flag's
    default) takes ``offload`` there, ``both`` without a prefill graph (CPU); a value the
    user gives is kept, and refused as above. Through SGLang's own ``prepare_server_args``
    and ``resolve_once`` (with the plugin's hooks): SGLang keeps its resolved graph backend
    in overrides, not in the record (red before: ``auto`` read the record, took ``both``
    and was refused)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    base = ["--model-path", tiny_model, "--device", "cpu", "--enable-pcr", "--pcr-dram-gb", "0.01", *graph_flags]
    args = prepare_server_args(base)
    args.resolve_once()  # the plugin's refusals run here
    assert PCRConfig.from_server_args(args).layerwise == resolved
    given = prepare_server_args([*base, "--pcr-layerwise", "both"])
    if graph_flags:
        with pytest.raises(Exception, match="--pcr-layerwise both with --cuda-graph-backend-prefill breakable"):
            given.resolve_once()
    else:
        given.resolve_once()
        assert PCRConfig.from_server_args(given).layerwise == "both"
