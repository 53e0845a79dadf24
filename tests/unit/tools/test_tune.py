"""The document-reuse tuning: the served forward, the question set and its split, the
distillation loop, the merged checkpoint (all on the tiny model; the e2e check of the
forward against a live server is in tests/e2e/test_doc_reuse.py)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pcr_client.prompt import build_doc_prompt
from pcr_tools.tune import questions
from pcr_tools.tune.served_pattern import MarkedPrompt, rotate_keys, served_generate, served_logits


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _prompt(tokenizer, docs: int, seed: int = 0) -> MarkedPrompt:
    rng = random.Random(seed)
    texts = [
        f"Passage {rng.randrange(1000)} about {word} and more words here."
        for word in rng.sample(["rivers", "stars", "trains", "music", "salt", "glass"], docs)
    ]
    prompt = build_doc_prompt(tokenizer, "Answer briefly.", texts, "What is it?")
    return MarkedPrompt(tuple(prompt.input_ids), tuple(prompt.doc_bounds))


def test_one_document_right_after_s_is_exact(hf_model, tokenizer):
    prompt = _prompt(tokenizer, 1)
    with torch.no_grad():
        concat = served_logits(hf_model, prompt, [5, 6], mode="concat")
        full = served_logits(hf_model, prompt, [5, 6], mode="full")
    assert concat.shape == full.shape
    assert torch.allclose(concat, full, atol=1e-4), (concat - full).abs().max()


def test_later_documents_are_blended_not_full_prefill(hf_model, tokenizer):
    prompt = _prompt(tokenizer, 3)
    with torch.no_grad():
        concat = served_logits(hf_model, prompt, mode="concat")
        full = served_logits(hf_model, prompt, mode="full")
    assert (concat - full).abs().max() > 1e-2


def test_rotating_keys_composes_with_the_models_rope(hf_model):
    """K computed at position p and moved by δ equals K computed at p + δ."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = hf_model.model.rotary_emb
    head_dim = hf_model.config.hidden_size // hf_model.config.num_attention_heads
    k = torch.randn(1, 2, 5, head_dim)
    positions = torch.arange(3, 8)[None]
    cos, sin = rotary(k, positions)
    _, at_p = apply_rotary_pos_emb(k, k, cos, sin)
    cos, sin = rotary(k, positions + 11)
    _, at_p_plus = apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.allclose(rotate_keys(hf_model, at_p, 11), at_p_plus, atol=1e-5)
    assert not torch.allclose(rotate_keys(hf_model, at_p, 10), at_p_plus, atol=1e-3)


def test_greedy_generation_agrees_with_the_logits(hf_model, tokenizer):
    prompt = _prompt(tokenizer, 3, seed=1)
    answer = served_generate(hf_model, prompt, 5, mode="concat")
    with torch.no_grad():
        logits = served_logits(hf_model, prompt, answer, mode="concat")
    first = len(prompt.input_ids) - 1 - prompt.doc_bounds[-1]
    assert logits[first : first + len(answer)].argmax(-1).tolist() == answer


def test_an_adapter_acts_in_every_part_of_the_served_forward(tiny_model, tokenizer):
    """A PEFT-wrapped model's served forward equals its merged checkpoint's, in both modes:
    the adapter acts in ``S``, in the tokens between documents, in the documents' canonical
    KV and in the tail (an extend that ran the frozen weights alone, to save the LM head,
    would differ); and it does change them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pcr_tools.tune.train import TARGET_MODULES

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGET_MODULES)))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # zero at initialisation: the adapter would do nothing
                parameter.normal_(std=0.05)
    marked = _prompt(tokenizer, 3, seed=2)
    bounds = list(marked.doc_bounds)
    bounds[1] -= 2  # the first document's last two tokens become tokens between documents
    prompt = MarkedPrompt(marked.input_ids, tuple(bounds))
    with torch.no_grad():
        adapted = {mode: served_logits(model, prompt, [5, 6], mode=mode) for mode in ("concat", "full")}
        with model.disable_adapter():
            frozen = served_logits(model, prompt, [5, 6], mode="concat")
        merged = model.merge_and_unload()
        for mode, logits in adapted.items():
            assert torch.allclose(logits, served_logits(merged, prompt, [5, 6], mode=mode), atol=1e-4), mode
    assert not torch.allclose(adapted["concat"], frozen, atol=1e-3)


@pytest.mark.parametrize(
    "bounds, message",
    [
        ((), "non-empty"),
        ((0, 3), "before its first document"),
        ((2, 9, 5, 12), "out of order"),
        ((2, 99), "past the prompt"),
    ],
)
def test_bad_marks_are_refused(bounds, message):
    with pytest.raises(ValueError, match=message):
        MarkedPrompt(tuple(range(20)), bounds)


def test_the_split_is_by_article_stable_and_disjoint():
    train, test = questions.split_articles("train"), questions.split_articles("test")
    train_titles, test_titles = {a.title for a in train}, {a.title for a in test}
    assert train_titles and test_titles and not train_titles & test_titles
    assert 0.12 < len(test) / (len(train) + len(test)) < 0.28
    assert all(questions.article_split(t) == "test" for t in test_titles)
    for q in questions.question_set("test", 30, seed=4):
        assert set(q.titles) <= test_titles
    from pcr_tools.tune.train import TuneParams, training_questions, validation_questions

    params = TuneParams(base_model="", out_dir="")
    draw = training_questions(params)
    for q in [draw() for _ in range(30)] + validation_questions(params):
        assert set(q.titles) <= train_titles  # the tuning never sees a test article


def test_questions_ask_about_re_placed_documents_and_plant_what_they_ask():
    qs = questions.question_set("test", 30, seed=2)
    assert {q.kind for q in qs} == set(questions.KINDS)
    for q in qs:
        assert 0 not in q.targets
        if q.kind == "needle":
            assert q.gold in q.documents[q.targets[0]]
        elif q.kind == "two_hop":
            founder, birth = (q.documents[t] for t in q.targets)
            person = founder.split("was founded by ")[1].split(".")[0]
            assert f"{person} was born in {q.gold}." in birth
        else:
            assert q.documents[q.targets[0]].split(":\n", 1)[1].startswith(q.gold)
        moved = q.shuffled(random.Random(0))
        assert 0 not in moved.targets and sorted(moved.documents) == sorted(q.documents)
        assert [moved.documents[t] for t in moved.targets] == [q.documents[t] for t in q.targets]
    assert questions.question_set("test", 5, seed=2) == qs[:5]


def test_a_few_steps_lower_the_distillation_loss(tiny_model, tokenizer):
    """Steps on one question bring its concat loss below half: the adapter learns through
    the served forward (a frozen adapter, or a loss that is not the student's, would not)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pcr_tools.tune.train import TARGET_MODULES, sample_loss

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGET_MODULES)))
    question = questions.question_set("train", 1, seed=5)[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = float(sample_loss(model, tokenizer, question, "concat", 8))
    for _ in range(25):  # Adam's first steps overshoot at this rate; 25 settle well below
        optimizer.zero_grad()
        sample_loss(model, tokenizer, question, "concat", 8).backward()
        optimizer.step()
    after = float(sample_loss(model, tokenizer, question, "concat", 8))
    assert before > 1e-3 and after < 0.5 * before, (before, after)


def test_the_gold_loss_is_the_gold_replys_cross_entropy_and_steps_lower_it(tiny_model, hf_model, tokenizer):
    """Under full prefill the gold loss equals the plain forward's cross-entropy of the gold
    reply and the end of the turn (the rows line up with the tokens they predict: one row
    off, it would not), and a few steps on it under concat bring it down."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pcr_tools.tune.train import TARGET_MODULES, gold_answer, gold_loss, marked

    question = questions.question_set("train", 2, seed=7)[1]  # a needle: the gold is a short value
    assert gold_answer(question) == question.gold + "."
    prompt = marked(question, tokenizer)
    answer = list(tokenizer.encode(gold_answer(question), add_special_tokens=False)) + [tokenizer.eos_token_id]
    with torch.no_grad():
        logits = hf_model(torch.tensor([list(prompt.input_ids) + answer])).logits[0]
        n = len(prompt.input_ids)
        expected = torch.nn.functional.cross_entropy(logits[n - 1 : n - 1 + len(answer)], torch.tensor(answer))
        assert float(gold_loss(hf_model, tokenizer, question, "full")) == pytest.approx(float(expected), rel=1e-4)

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGET_MODULES)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = float(gold_loss(model, tokenizer, question, "concat"))
    for _ in range(10):
        optimizer.zero_grad()
        gold_loss(model, tokenizer, question, "concat").backward()
        optimizer.step()
    assert float(gold_loss(model, tokenizer, question, "concat")) < 0.5 * before


def test_the_gradient_reaches_every_documents_canonical_kv(tiny_model, tokenizer, monkeypatch):
    """Training must shape the documents' KV, not only the question's projections: every
    layer's re-placed K and V of every document gets a gradient (a detached canonical
    forward would leave them without)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pcr_tools.tune import served_pattern
    from pcr_tools.tune.train import TARGET_MODULES, sample_loss

    kept = []
    original = served_pattern._canonical_kv

    def spy(model, prompt):
        layers = original(model, prompt)
        for layer in layers:
            for k, v in layer:
                k.retain_grad()
                v.retain_grad()
                kept.append((k, v))
        return layers

    monkeypatch.setattr(served_pattern, "_canonical_kv", spy)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGET_MODULES)))
    sample_loss(model, tokenizer, questions.question_set("train", 1, seed=6)[0], "concat", 6).backward()
    assert len(kept) == base.config.num_hidden_layers * 3  # three documents per question
    assert all(k.grad is not None and k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0 for k, v in kept)


def tiny_training(base_model: str, out_dir, **params):
    """A training run small enough for a unit test on the tiny model (a few samples, three
    documents a question, one warm-up step); ``params`` set the rest of :class:`TuneParams`."""
    from pcr_tools.tune.train import TuneParams, train

    settings = dict(grad_accum=2, lr=3e-3, warmup_steps=1, max_documents=3)
    return train(TuneParams(base_model=base_model, out_dir=str(out_dir), **{**settings, **params}))


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-adapter")
    result = tiny_training(tiny_model, out, samples=8, answer_tokens=6, validation_questions=2, log_every=2)
    return out, result


def test_a_run_on_gold_answers_alone_logs_its_own_curve(tiny_model, tmp_path):
    """With every sample on a gold answer there is no distillation KL to log: the gold
    cross-entropy still gets its curve, one point per interval."""
    result = tiny_training(
        tiny_model,
        tmp_path,
        samples=4,
        answer_tokens=4,
        validation_questions=1,
        log_every=2,
        gold_share=1.0,
        gold_kinds="lead,needle,two_hop",
    )
    assert result.loss_curve == [] and [n for n, _ in result.gold_curve] == [2, 4]


@pytest.fixture
def losses_seen(monkeypatch):
    """The kinds of question each loss of :func:`train` was computed for (the real losses
    are still computed and trained on)."""
    from pcr_tools.tune import train as train_module

    seen: dict[str, list[str]] = {"gold": [], "distilled": []}
    real_gold, real_sample = train_module.gold_loss, train_module.sample_loss

    def gold_spy(model, tokenizer, question, mode):
        seen["gold"].append(question.kind)
        return real_gold(model, tokenizer, question, mode)

    def sample_spy(model, tokenizer, question, mode, answer_tokens):
        seen["distilled"].append(question.kind)
        return real_sample(model, tokenizer, question, mode, answer_tokens)

    monkeypatch.setattr(train_module, "gold_loss", gold_spy)
    monkeypatch.setattr(train_module, "sample_loss", sample_spy)
    return seen


def test_gold_kinds_keep_the_gold_loss_to_those_kinds_questions(tiny_model, tmp_path, losses_seen):
    """``gold_kinds="lead"`` with every sample drawn for gold: the lead questions train on
    their gold reply, the needle and two-hop questions are distilled (the kinds come in turn)."""
    result = tiny_training(
        tiny_model,
        tmp_path,
        samples=6,
        answer_tokens=4,
        validation_questions=0,
        log_every=3,
        gold_share=1.0,
        gold_kinds="lead",
    )
    assert losses_seen["gold"] == ["lead", "lead"]
    assert losses_seen["distilled"] == ["needle", "two_hop", "needle", "two_hop"]
    assert [n for n, _ in result.gold_curve] == [3, 6] and [n for n, _ in result.loss_curve] == [3, 6]
    assert json.loads((tmp_path / "recipe.json").read_text())["params"]["gold_kinds"] == "lead"


def test_no_gold_share_means_no_gold_sample_whatever_the_kinds(tiny_model, tmp_path, losses_seen):
    result = tiny_training(
        tiny_model,
        tmp_path,
        samples=3,
        grad_accum=3,
        answer_tokens=4,
        validation_questions=0,
        log_every=3,
        gold_share=0.0,
        gold_kinds="lead",
    )
    assert losses_seen["gold"] == [] and result.gold_curve == [] and [n for n, _ in result.loss_curve] == [3]
    assert losses_seen["distilled"] == ["lead", "needle", "two_hop"]


def test_gold_kinds_are_read_with_spaces():
    from pcr_tools.tune.train import parse_kinds

    assert parse_kinds(" lead , two_hop ") == {"lead", "two_hop"}


@pytest.mark.parametrize("text", ["", "lead,bogus", " , "])
def test_unknown_or_empty_gold_kinds_are_refused(text):
    from pcr_tools.tune.train import parse_kinds

    with pytest.raises(ValueError, match="comma-separated list of lead, needle, two_hop"):
        parse_kinds(text)


def test_the_command_refuses_bad_gold_kinds_before_any_work(capsys):
    from pcr_tools.tune.__main__ import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--out", "unused", "--gold-kinds", "lead,bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--gold-kinds" in err and "unknown 'bogus'" in err


def test_the_defaults_are_the_committed_adapters_recipe():
    """``python -m pcr_tools.tune --out DIR`` trains what is committed (but for the time
    limit and threads the committed run was given)."""
    from pcr_tools.models.smollm2 import TUNED_ADAPTER_DIR
    from pcr_tools.tune.train import TuneParams

    recipe = json.loads((TUNED_ADAPTER_DIR / "recipe.json").read_text())["params"]
    defaults = asdict(TuneParams(base_model="", out_dir=""))
    ran_with = {k: v for k, v in recipe.items() if k not in ("max_minutes", "threads")}
    assert ran_with == {k: v for k, v in defaults.items() if k in ran_with}
    assert set(defaults) - set(recipe) == {"base_model", "out_dir"}


def test_the_tuning_run_writes_the_adapter_and_its_recipe(tiny_adapter):
    out, result = tiny_adapter
    assert result.samples == 8 and result.optimizer_steps == 4
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["result"]["adapter_sha256"] == result.adapter_sha256
    assert [n for n, _ in recipe["result"]["loss_curve"]] == [2, 4, 6, 8]
    assert recipe["params"]["samples"] == 8 and (out / "adapter_config.json").is_file()


def test_the_merged_checkpoint_has_new_weights_and_its_own_namespace(tiny_model, tiny_adapter, tmp_path):
    from safetensors.torch import load_file

    from pcr_sglang.sglang_adapter.fingerprint import model_fingerprint
    from pcr_tools.models.merged import build_merged

    adapter, _ = tiny_adapter
    merged = build_merged(tiny_model, adapter, tmp_path / "merged")
    base_w = load_file(str(sorted(Path(tiny_model).glob("*.safetensors"))[0]))
    merged_w = load_file(str(sorted(merged.glob("*.safetensors"))[0]))
    changed = [k for k in base_w if "q_proj" in k and not torch.equal(base_w[k], merged_w[k])]
    assert changed
    config = SimpleNamespace(hf_config=None)
    assert model_fingerprint(config, str(merged)) != model_fingerprint(config, tiny_model)
    assert build_merged(tiny_model, adapter, tmp_path / "merged") == merged  # cached


def test_a_changed_adapter_is_refused(tiny_model, tiny_adapter, tmp_path):
    import shutil

    from pcr_tools.models.merged import build_merged

    adapter, _ = tiny_adapter
    copy = tmp_path / "adapter"
    shutil.copytree(adapter, copy)
    data = bytearray((copy / "adapter_model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (copy / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="refusing to merge"):
        build_merged(tiny_model, copy, tmp_path / "merged")


def test_an_adapter_is_not_merged_into_a_base_it_was_not_tuned_on(tiny_model, tiny_adapter, tmp_path):
    import shutil

    from pcr_tools.models import weights_sha256
    from pcr_tools.models.merged import build_merged

    adapter, _ = tiny_adapter
    assert json.loads((adapter / "recipe.json").read_text())["base_model_sha256"] == weights_sha256(Path(tiny_model))
    other = tmp_path / "adapter"
    shutil.copytree(adapter, other)
    recipe = json.loads((other / "recipe.json").read_text())
    recipe["base_model_sha256"] = "0" * 64  # as if tuned on other weights
    (other / "recipe.json").write_text(json.dumps(recipe))
    with pytest.raises(ValueError, match="refusing to merge it into other weights"):
        build_merged(tiny_model, other, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_the_committed_calibration_of_the_tuned_model_is_valid_and_portable():
    """The demo serves the tuned SmolLM2 with it: a file the server accepts (the strict
    loader), measured under the server's default conditions, naming the model by its
    folder, never by a machine's path."""
    from pcr_sglang.reuse.calibration import CalibrationConditions, DocReuseCalibration
    from pcr_tools.models.smollm2 import TUNED_CALIBRATION, default_smollm2_dir

    calibration = DocReuseCalibration.load(TUNED_CALIBRATION)
    assert calibration.model == default_smollm2_dir(doc_reuse_tuned=True).name
    assert calibration.conditions == CalibrationConditions()
    assert set(calibration.modes) == {"concat", "lego", "blend"}
    for verdict in calibration.modes.values():
        assert verdict.meets == any(m.meets for m in verdict.measured)
