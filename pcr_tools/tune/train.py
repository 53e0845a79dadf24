"""TurboRAG's fine-tuning by self-distillation: a LoRA adapter trained so that the model under
the served reuse pattern (``concat``: each document's canonical KV re-placed) answers like
the base model under full prefill.

Each sample is a question over 2-4 ``train``-split articles (:mod:`.questions`; the asked-about
document anywhere). The base model (the adapter disabled) answers it greedily under full
prefill; the loss is the KL divergence from the base model's next-token distribution to the
student's, at every answer position (the first answer token included), summed over the
vocabulary. A ``full_share`` of the samples runs the student under full prefill instead, so
that unmarked requests keep the base model's behaviour. No labels are needed for that, and
the quantity trained is exactly the fidelity the benchmark reports.

Where the data has a gold answer (every question here does), a ``gold_share`` of the samples
trains on it instead: cross-entropy of the gold answer (then the end of the turn) under the
sample's mode, weighted by ``gold_weight`` against the distillation's KL (the gold
cross-entropy per token starts several times above the KL). That is TurboRAG's document-QA
half; the distillation is its "keep the general behaviour" half. ``gold_kinds`` limits the
gold samples to some kinds of question (``gold_share`` is then a share of those kinds'
samples), the others all distilled. The defaults are the committed SmolLM2 adapter's
recipe (it also ran with ``max_minutes=58`` and ``threads=2``): half the ``lead`` questions
(the reply that copies a re-placed document's first sentence, where distillation alone left
reuse furthest behind full prefill) on their gold sentence at weight 0.5, everything else
distilled.

Why LoRA through PEFT: a few MB to commit, merged into a servable checkpoint offline
(:func:`pcr_tools.models.smollm2.build_smollm2` with ``doc_reuse_tuned=True``), so the
server never loads an adapter and its cache namespace is that of new weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from pcr_tools.models import weights_sha256
from pcr_tools.tune.questions import KINDS, Question, make_question, split_articles
from pcr_tools.tune.served_pattern import MarkedPrompt, served_generate, served_logits

logger = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
RECIPE_FILE = "recipe.json"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class TuneParams:
    base_model: str
    out_dir: str
    seed: int = 0
    samples: int = 640
    max_minutes: float = 60.0
    grad_accum: int = 4
    lr: float = 3e-4
    warmup_steps: int = 8
    rank: int = 16
    alpha: int = 32
    full_share: float = 0.25
    # The committed SmolLM2 adapter's recipe: half the lead questions on their gold sentence.
    gold_share: float = 0.5
    gold_weight: float = 0.5
    gold_kinds: str = "lead"  # comma-separated: the kinds whose questions may train on gold
    answer_tokens: int = 32
    min_documents: int = 2
    max_documents: int = 4
    validation_questions: int = 16
    threads: Optional[int] = None
    log_every: int = 16


@dataclass
class TuneResult:
    adapter_dir: str
    samples: int
    optimizer_steps: int
    elapsed_s: float
    validation_kl_before: float
    validation_kl_after: float
    loss_curve: list[tuple[int, float]] = field(default_factory=list)  # distillation KL, every log_every samples
    gold_curve: list[tuple[int, float]] = field(default_factory=list)  # gold cross-entropy, likewise
    adapter_sha256: str = ""
    adapter_bytes: int = 0
    adapter_config_sha256: str = ""  # adapter_config.json's (lora_alpha and r are the merge's scaling)


def marked(question: Question, tokenizer: Any) -> MarkedPrompt:
    prompt = question.prompt(tokenizer)
    return MarkedPrompt(tuple(prompt.input_ids), tuple(prompt.doc_bounds))


def answer_rows(prompt: MarkedPrompt, answer: Sequence[int]) -> slice:
    """Rows of :func:`served_logits` (for ``prompt`` + ``answer``) that predict the answer's
    tokens: from the last prompt token on, one per answer token."""
    first = len(prompt.input_ids) - 1 - prompt.documents()[-1][1]
    return slice(first, first + len(answer))


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), summed over the vocabulary."""
    teacher = torch.log_softmax(teacher_logits.float(), dim=-1)
    student = torch.log_softmax(student_logits.float(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def sample_loss(model: Any, tokenizer: Any, question: Question, mode: str, answer_tokens: int) -> torch.Tensor:
    """One sample's distillation loss: the base model's full-prefill answer as the teacher's
    path, the student (adapter on) under ``mode``."""
    prompt = marked(question, tokenizer)
    with torch.no_grad(), model.disable_adapter():
        answer = served_generate(model, prompt, answer_tokens, mode="full", stop_ids=_stops(tokenizer))
        answer = answer or [tokenizer.eos_token_id]
        rows = answer_rows(prompt, answer)
        teacher = served_logits(model, prompt, answer, mode="full")[rows]
    student = served_logits(model, prompt, answer, mode=mode)[rows]
    return distillation_kl(student, teacher)


def gold_answer(question: Question) -> str:
    """The gold answer as a reply: the lead sentence as it is, a planted value or city
    followed by a full stop (the scores ask that the answer contain the value)."""
    if question.kind == "lead":
        return question.gold
    return f"{question.gold}."


def gold_loss(model: Any, tokenizer: Any, question: Question, mode: str) -> torch.Tensor:
    """Cross-entropy of the gold answer and the end of the turn, the student under ``mode``."""
    prompt = marked(question, tokenizer)
    answer = list(tokenizer.encode(gold_answer(question), add_special_tokens=False)) + [tokenizer.eos_token_id]
    logits = served_logits(model, prompt, answer, mode=mode)[answer_rows(prompt, answer)]
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(answer, device=logits.device))


def parse_kinds(text: str) -> frozenset[str]:
    """``"lead,needle"`` -> those kinds; an unknown or empty list is an error, not an empty set."""
    kinds = frozenset(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(kinds - set(KINDS))
    if unknown or not kinds:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "empty"
        raise ValueError(f"gold kinds {text!r} ({what}): expected a comma-separated list of {', '.join(KINDS)}")
    return kinds


def _stops(tokenizer: Any) -> list[int]:
    return [t for t in {tokenizer.eos_token_id, getattr(tokenizer, "pad_token_id", None)} if t is not None]


def training_questions(params: TuneParams) -> Callable[[], Question]:
    """An endless, seeded stream of ``train``-split questions (the kinds in turn, 2-4
    documents, the asked-about document anywhere)."""
    rng = random.Random(f"tune:{params.seed}")
    articles = split_articles("train")
    count = [0]

    def next_question() -> Question:
        kind = KINDS[count[0] % len(KINDS)]
        count[0] += 1
        low = max(params.min_documents, 3 if kind == "two_hop" else 2)
        documents = rng.randint(low, max(low, params.max_documents))
        return make_question(kind, articles, rng, documents=documents, allow_first=True)

    return next_question


def validation_questions(params: TuneParams) -> list[Question]:
    """Fixed ``train``-split questions (never a test article), targets never first."""
    rng = random.Random(f"tune-validation:{params.seed}")
    articles = split_articles("train")
    return [
        make_question(KINDS[i % len(KINDS)], articles, rng, documents=3) for i in range(params.validation_questions)
    ]


def validation_kl(model: Any, tokenizer: Any, questions: Sequence[Question], answer_tokens: int) -> float:
    with torch.no_grad():
        return sum(float(sample_loss(model, tokenizer, q, "concat", answer_tokens)) for q in questions) / max(
            1, len(questions)
        )


def train(params: TuneParams, progress: Callable[[str], None] = logger.info) -> TuneResult:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gold_kinds = parse_kinds(params.gold_kinds)  # before the model loads: a bad value fails at once
    if params.threads:
        torch.set_num_threads(params.threads)
    torch.manual_seed(params.seed)
    tokenizer = AutoTokenizer.from_pretrained(params.base_model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = AutoModelForCausalLM.from_pretrained(params.base_model, dtype=torch.float32).to(device)
    progress(f"tuning {params.base_model} on {device}")
    model = get_peft_model(
        base,
        LoraConfig(
            r=params.rank, lora_alpha=params.alpha, lora_dropout=0.0, target_modules=list(TARGET_MODULES), bias="none"
        ),
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=params.lr, weight_decay=0.0)
    total_steps = max(1, math.ceil(params.samples / params.grad_accum))

    def lr_at(step: int) -> float:
        if step < params.warmup_steps:
            return (step + 1) / params.warmup_steps
        return max(0.1, 1.0 - (step - params.warmup_steps) / max(1, total_steps - params.warmup_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    held_out = validation_questions(params)
    started = time.monotonic()
    model.eval()
    kl_before = validation_kl(model, tokenizer, held_out, params.answer_tokens)
    progress(f"validation KL before: {kl_before:.4f} ({len(held_out)} train-split questions)")
    model.train()
    next_question = training_questions(params)
    rng = random.Random(f"tune-modes:{params.seed}")
    gold_rng = random.Random(f"tune-gold:{params.seed}")  # apart, so gold_share 0 draws the modes as without it
    curve: list[tuple[int, float]] = []
    window: list[float] = []  # the distillation samples' KL (the curve)
    gold_window: list[float] = []  # the gold samples' cross-entropy
    gold_curve: list[tuple[int, float]] = []
    samples = steps = 0
    deadline = started + params.max_minutes * 60
    while samples < params.samples and time.monotonic() < deadline:
        mode = "full" if rng.random() < params.full_share else "concat"
        question = next_question()
        # The draw comes first and always: the kinds chosen do not move the other samples' draws.
        if gold_rng.random() < params.gold_share and question.kind in gold_kinds:
            loss = gold_loss(model, tokenizer, question, mode)
            (params.gold_weight * loss / params.grad_accum).backward()
            gold_window.append(loss.item())
        else:
            loss = sample_loss(model, tokenizer, question, mode, params.answer_tokens)
            (loss / params.grad_accum).backward()
            window.append(loss.item())
        samples += 1
        if samples % params.grad_accum == 0:
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
        if samples % params.log_every == 0:
            said = []
            if window:
                curve.append((samples, round(sum(window) / len(window), 5)))
                said.append(f"KL {curve[-1][1]:.4f}")
            if gold_window:
                gold_curve.append((samples, round(sum(gold_window) / len(gold_window), 4)))
                said.append(f"gold CE {gold_curve[-1][1]:.3f}")
            window.clear()
            gold_window.clear()
            elapsed = time.monotonic() - started
            progress(
                f"sample {samples}/{params.samples}  {'  '.join(said)}  {elapsed / 60:.1f} min "
                f"(about {elapsed / samples * (params.samples - samples) / 60:.1f} min left)"
            )
    if samples % params.grad_accum:
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
    model.eval()
    kl_after = validation_kl(model, tokenizer, held_out, params.answer_tokens)
    progress(f"validation KL after: {kl_after:.4f}")
    elapsed = time.monotonic() - started
    result = TuneResult(
        adapter_dir=params.out_dir,
        samples=samples,
        optimizer_steps=steps,
        elapsed_s=round(elapsed, 1),
        validation_kl_before=round(kl_before, 5),
        validation_kl_after=round(kl_after, 5),
        loss_curve=curve,
        gold_curve=gold_curve,
    )
    save_adapter(model, Path(params.out_dir), params, result)
    return result


def save_adapter(model: Any, out_dir: Path, params: TuneParams, result: TuneResult) -> None:
    """The adapter in float16 (half the bytes; merged into float32 weights it rounds below
    the model's own quantization noise), its PEFT config, and the recipe with checksums."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, str(out_dir / ADAPTER_FILE))
    config = model.peft_config["default"]
    # The base by name, not by this machine's path (the adapter is committed and shared).
    config.base_model_name_or_path = Path(params.base_model).name
    config.save_pretrained(str(out_dir))
    data = (out_dir / ADAPTER_FILE).read_bytes()
    result.adapter_sha256 = hashlib.sha256(data).hexdigest()
    result.adapter_bytes = len(data)
    result.adapter_config_sha256 = hashlib.sha256((out_dir / "adapter_config.json").read_bytes()).hexdigest()
    recipe = {
        "what": "LoRA for --pcr-doc-reuse concat by self-distillation from full prefill"
        + (" and gold answers" if params.gold_share > 0 else "")
        + " (pcr_tools.tune)",
        "params": {k: v for k, v in asdict(params).items() if k not in ("base_model", "out_dir")},
        "base_model_sha256": weights_sha256(Path(params.base_model)),
        "split": "articles by blake2b(title) % 100 < 20 -> test (never trained on)",
        "result": asdict(result) | {"adapter_dir": None},
        "versions": {"torch": torch.__version__, "python": platform.python_version(), **_versions()},
    }
    (out_dir / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")


def _versions() -> dict[str, str]:
    import peft
    import transformers

    return {"transformers": transformers.__version__, "peft": peft.__version__}
