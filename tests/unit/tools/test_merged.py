"""A committed adapter merged into its base (``pcr_tools.models.merged``), with a real LoRA
adapter made by PEFT on the tiny test model: the adapter's config is checked like its
weights, and a merged folder built from other adapter files is rebuilt (review N12)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pcr_tools.models import weights_sha256
from pcr_tools.models.merged import CONFIG_FILE, RECIPE_FILE, adapter_checksum, build_merged


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def adapter(tiny_model, tmp_path) -> Path:
    """A LoRA adapter of the tiny model with non-zero weights (so its scaling shows in the
    merge), saved by PEFT, and the recipe a tuning writes with it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    folder = tmp_path / "adapter"
    model.save_pretrained(str(folder))
    recipe = {
        "base_model_sha256": weights_sha256(Path(tiny_model)),
        "result": {
            "adapter_sha256": sha256(folder / "adapter_model.safetensors"),
            "adapter_config_sha256": sha256(folder / CONFIG_FILE),
        },
    }
    (folder / RECIPE_FILE).write_text(json.dumps(recipe))
    return folder


def q_proj(folder: Path):
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
        name = next(n for n in f.keys() if n.endswith("layers.0.self_attn.q_proj.weight"))
        return f.get_tensor(name)


def edit_alpha(adapter: Path, alpha: int) -> None:
    config = json.loads((adapter / CONFIG_FILE).read_text())
    config["lora_alpha"] = alpha
    (adapter / CONFIG_FILE).write_text(json.dumps(config))


def test_an_edited_adapter_config_is_refused_and_a_merged_folder_never_returned_stale(tiny_model, adapter, tmp_path):
    """``lora_alpha`` / ``r`` are the merge's scaling. The config used to be checked nowhere:
    an edited one was merged without notice, and an existing merged folder was returned
    as it was."""
    out = tmp_path / "merged"
    first = q_proj(build_merged(Path(tiny_model), adapter, out))

    edit_alpha(adapter, 64)
    with pytest.raises(ValueError, match="adapter_config.json"):
        adapter_checksum(adapter)
    with pytest.raises(ValueError, match="adapter_config_sha256"):
        build_merged(Path(tiny_model), adapter, out)

    # The recipe of the edited config (a tuning that saved it): merged again, not the old folder.
    recipe = json.loads((adapter / RECIPE_FILE).read_text())
    recipe["result"]["adapter_config_sha256"] = sha256(adapter / CONFIG_FILE)
    (adapter / RECIPE_FILE).write_text(json.dumps(recipe))
    again = q_proj(build_merged(Path(tiny_model), adapter, out))
    assert not again.equal(first)


def test_the_committed_adapters_match_their_recipes():
    for folder in sorted((Path(__file__).parents[3] / "pcr_tools" / "models" / "adapters").iterdir()):
        assert adapter_checksum(folder)["adapter_config_sha256"] == sha256(folder / CONFIG_FILE)
