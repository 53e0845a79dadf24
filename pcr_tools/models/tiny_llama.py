"""Build a tiny, deterministic, random-weight Llama with a locally trained BPE tokenizer.

The model is meaningless as a language model but exercises every code path SGLang runs
for a real Llama (paged KV pool, RoPE, GQA), in milliseconds per forward on a CPU. The
tokenizer is trained by ``tokenizers`` on the Wikipedia corpus so RAG-style prompts
tokenize to realistic lengths. Everything is seeded; the folder is rebuilt only when the
recipe version changes.

Usage: ``python -m pcr_tools.models.tiny_llama [--layers N] [--out DIR]`` prints the folder
path. The default has two layers (every test's model); ``--layers 4`` builds a deeper
variant in a folder of its own, for what two layers cannot tell (blend keeps re-placed KV
only past its probe's layers, at least 0-1, so on two layers its choice of tokens moves no
answer, and its gradual and prophet selectors are deviation and query).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pcr_tools.models import build_cached, cache_root

logger = logging.getLogger(__name__)

RECIPE_VERSION = 1


@dataclass(frozen=True)
class TinyLlamaRecipe:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    seed: int = 1234
    tokenizer_corpus_articles: int = 3000
    version: int = RECIPE_VERSION


def default_tiny_llama_dir(num_layers: int = TinyLlamaRecipe.num_hidden_layers) -> Path:
    """The cache folder of the tiny model with ``num_layers`` layers (each depth its own)."""
    name = "tiny-llama" if num_layers == TinyLlamaRecipe.num_hidden_layers else f"tiny-llama-{num_layers}l"
    return cache_root() / "models" / name


def _train_tokenizer(recipe: TinyLlamaRecipe, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pcr_tools.data import load_wiki_articles

    articles = load_wiki_articles()[: recipe.tokenizer_corpus_articles]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((a.text for a in articles), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
    )
    fast.save_pretrained(out_dir)


def _build_model(recipe: TinyLlamaRecipe, out_dir: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default init spreads the logits so greedy decoding is not dominated by
    # ties, which would make token-for-token comparisons insensitive to wrong KV.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_llama(
    out_dir: Path | None = None, recipe: TinyLlamaRecipe | None = None, num_layers: int | None = None
) -> Path:
    """Return the folder of the tiny model, building it first if missing or stale.
    ``num_layers`` overrides the recipe's depth (and picks that depth's default folder)."""
    recipe = recipe or TinyLlamaRecipe()
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        recipe = replace(recipe, num_hidden_layers=num_layers)
    out_dir = Path(out_dir) if out_dir else default_tiny_llama_dir(recipe.num_hidden_layers)

    def build(folder: Path) -> None:
        logger.info("Building the tiny Llama for %s", out_dir)
        _train_tokenizer(recipe, folder)
        from transformers import AutoTokenizer

        vocab_size = len(AutoTokenizer.from_pretrained(folder))
        _build_model(recipe, folder, vocab_size)

    return build_cached(out_dir, asdict(recipe), build)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="Output folder (default: the cache).")
    parser.add_argument(
        "--layers",
        type=int,
        default=TinyLlamaRecipe.num_hidden_layers,
        help="Number of decoder layers (default: %(default)s; other depths get their own folder).",
    )
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers must be >= 1, got {args.layers}")
    print(build_tiny_llama(args.out, num_layers=args.layers))


if __name__ == "__main__":
    main()
