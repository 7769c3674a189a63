"""The tiny built-in model of the demo: a Llama built from a config, with a word-level tokenizer, saved to a folder.

Every role and engine loads the same folder, exactly as they would load a real ``--pretrain`` checkpoint, so the
demo runs the same code path as a real run.
"""

from __future__ import annotations

import json
import os
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>")


def tiny_vocab(num_symbols: int) -> list[str]:
    """Special tokens first, then symbols ``s0 .. s{n-1}``."""
    return [*SPECIAL_TOKENS, *(f"s{i}" for i in range(num_symbols))]


def tiny_model_config(num_symbols: int = 8, **overrides: Any):
    """A LlamaConfig small enough to train in seconds on a CPU core."""
    from transformers import LlamaConfig

    vocab = tiny_vocab(num_symbols)
    settings = dict(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def build_tiny_tokenizer(num_symbols: int = 8):
    """A word-level tokenizer over the tiny vocabulary (whitespace-separated symbols)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(tiny_vocab(num_symbols))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        sep_token="<sep>",
        unk_token="<pad>",
        padding_side="left",
    )


def save_tiny_model(path: str, *, num_symbols: int = 8, seed: int = 0, **overrides: Any) -> str:
    """Build the tiny model with a fixed seed and save model + tokenizer to ``path`` (reused if already there)."""
    marker = os.path.join(path, "hybrid_tiny.json")
    settings = {"num_symbols": num_symbols, "seed": seed, **overrides}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == settings:
                return path
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_model_config(num_symbols, **overrides))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    build_tiny_tokenizer(num_symbols).save_pretrained(path)
    with open(marker, "w") as f:
        json.dump(settings, f)
    return path
