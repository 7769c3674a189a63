"""The workload shared by our GPU end-to-end runs and the TRL peer (../shared/peers/trl_grpo.py).

A random model of the peer's Qwen2 shape (24 layers, hidden 896, 14 heads / 2 KV heads, intermediate 4864,
vocab 1024, tied embeddings; ~359M parameters) built from a config as a Llama: transformers 5 loads a saved
``qwen2`` folder's tokenizer as Qwen2Tokenizer, which replaces the word-level pre-tokenizer with its byte-level one
and encodes these prompts to nothing. Both our runs and the TRL run load this same folder, a word-level tokenizer over ``t0 .. t1020``, 256 prompts of 32 random tokens, and the
rule reward "fraction of completion tokens equal to the prompt's first token". Nothing is downloaded.

    python bench/peer_workload.py /tmp/peer     # writes /tmp/peer/model and /tmp/peer/prompts.jsonl
"""

from __future__ import annotations

import json
import os
import random
import sys

VOCAB = 1024


def build(root: str, *, layers: int = 24, hidden: int = 896, seed: int = 0) -> tuple[str, str]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model_dir, data = os.path.join(root, "model"), os.path.join(root, "prompts.jsonl")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        vocab = {f"t{i}": i for i in range(VOCAB - 3)}
        vocab.update({"<unk>": VOCAB - 3, "<pad>": VOCAB - 2, "</s>": VOCAB - 1})
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 54 // 10, num_hidden_layers=layers,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=1024,
                          pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, bos_token_id=None, tie_word_embeddings=True,
                          rope_theta=1_000_000.0, rms_norm_eps=1e-6)
        torch.manual_seed(seed)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    if not os.path.exists(data):
        rng = random.Random(seed)
        with open(data, "w") as f:
            for _ in range(256):
                f.write(json.dumps({"prompt": " ".join(f"t{rng.randrange(VOCAB - 3)}" for _ in range(32))}) + "\n")
    return model_dir, data


def copy_first(prompts, completions, **_):
    """The peer's reward: the fraction of completion tokens equal to the prompt's first token."""
    out = []
    for prompt, completion in zip(prompts, completions):
        first = prompt.split()[0]
        toks = completion.split()
        out.append(sum(t == first for t in toks) / max(1, len(toks)))
    return out


if __name__ == "__main__":
    print(*build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/peer"))
