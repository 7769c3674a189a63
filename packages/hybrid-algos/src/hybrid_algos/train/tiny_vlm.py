"""A tiny Qwen2-VL built from configs into a folder, with its tokenizer (the vision tokens, a chat template with
image parts) and image processor: what the CPU tests of vision-language training load like a real checkpoint, with
nothing downloaded.

The folder holds what a Qwen2-VL checkpoint holds: ``config.json`` (``Qwen2VLConfig``: a 2-layer text model with
M-RoPE and a 1-block vision tower), the weights, ``tokenizer.json`` / ``tokenizer_config.json`` (a word-level
vocabulary with ``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``;
the chat template renders ``{"type": "image"}`` parts as ``<|vision_start|><|image_pad|><|vision_end|>``) and
``preprocessor_config.json`` (``Qwen2VLImageProcessor`` with 4-pixel patches merged 2 x 2: a 16 x 16 image is 4
image tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

VISION_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIAL = ("<pad>", *VISION_TOKENS)
#: The words of the built-in vocabulary (a test's prompts and answers use these).
WORDS = ("user", "assistant", "what", "colour", "is", "the", "square", "?", "red", "green", "blue", "none")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif c['type'] == 'text' %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
IMAGE_SIZE = 16  # pixels a side: min_pixels = max_pixels = 16 x 16, so every image is resized to it


def tiny_vlm_vocab(words: Sequence[str] = WORDS) -> list[str]:
    return [*SPECIAL, *words]


def build_tiny_vlm_tokenizer(words: Sequence[str] = WORDS):
    """A word-level tokenizer over the tiny vocabulary, the vision tokens special (they split without spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(tiny_vlm_vocab(words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<pad>",
        padding_side="left",
        additional_special_tokens=list(VISION_TOKENS),
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_image_processor(image_size: int = IMAGE_SIZE):
    """Qwen2-VL's image processor with 4-pixel patches, 2 x 2 merged, every image resized to ``image_size``."""
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    return pil.Qwen2VLImageProcessorPil(
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=image_size * image_size,
        max_pixels=image_size * image_size,
    )


def tiny_vlm_config(words: Sequence[str] = WORDS, **text_overrides: Any):
    """A ``Qwen2VLConfig`` small enough to train in seconds on a CPU core."""
    from transformers import Qwen2VLConfig

    vocab = {tok: i for i, tok in enumerate(tiny_vlm_vocab(words))}
    text = dict(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # of head_dim / 2 = 8
        pad_token_id=0,
        eos_token_id=vocab["<|im_end|>"],
        bos_token_id=vocab["<|im_start|>"],
        tie_word_embeddings=False,
    )
    text.update(text_overrides)
    vision = dict(
        depth=1,
        embed_dim=32,
        hidden_size=text["hidden_size"],
        num_heads=2,
        in_channels=3,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        mlp_ratio=2,
    )
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def save_tiny_vlm(path: str, *, words: Sequence[str] = WORDS, seed: int = 0, **text_overrides: Any) -> str:
    """Build the tiny Qwen2-VL with a fixed seed and save model, tokenizer and image processor to ``path``
    (reused if already there with the same settings)."""
    marker = os.path.join(path, "hybrid_tiny_vlm.json")
    settings = {"words": list(words), "seed": seed, **text_overrides}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == settings:
                return path
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(tiny_vlm_config(words, **text_overrides))
    model.generation_config.eos_token_id = model.config.text_config.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    build_tiny_vlm_tokenizer(words).save_pretrained(path)
    build_tiny_image_processor().save_pretrained(path)
    with open(marker, "w") as f:
        json.dump(settings, f)
    return path
