"""The workloads shared by our GPU end-to-end runs and the peers (TRL, ../shared/peers/trl_grpo.py).

Random models of Qwen2 shapes built from a config as a Llama (transformers 5 loads a saved ``qwen2`` folder's
tokenizer as Qwen2Tokenizer, which replaces the word-level pre-tokenizer with its byte-level one and encodes these
prompts to nothing), a word-level tokenizer over ``t0 .. t1020``, random prompts, and the rule reward "fraction of
completion tokens equal to the prompt's first token". Both our runs and the peers load the same folder. Nothing is
downloaded.

* ``357m`` -- the TRL peer's shape: 24 layers, hidden 896, 14 heads / 2 KV heads, intermediate 4864, tied embeddings;
  prompts of 32 tokens (8 prompts x 8 samples, <= 128 new tokens per step in the runs).
* ``1.5b`` -- Qwen2-1.5B's body: 28 layers, hidden 1536, 12 heads / 2 KV heads, intermediate 8960 (1.3B parameters
  with this small vocabulary); prompts of 256 tokens (32 prompts x 8 samples, <= 1024 new tokens).
* ``7b`` -- Qwen2-7B's body: 28 layers, hidden 3584, 28 heads / 4 KV heads, intermediate 18944 (6.5B parameters);
  prompts of 256 tokens.
* ``qwen2.5-7b`` -- Qwen2.5-7B's body (the same as Qwen2-7B's: 28 layers, hidden 3584, 28 heads / 4 KV heads,
  intermediate 18944); prompts of 512 tokens (issue 38's G7: 64 prompts x 8 samples, <= 1024 new tokens, 4 GPUs).
* ``llama3-8b`` -- Llama-3-8B's body: 32 layers, hidden 4096, 32 heads / 8 KV heads, intermediate 14336 (7.0B
  parameters with this vocabulary); prompts of 512 tokens (issue 38's P8: 256 prompts x 1, <= 1024 new tokens).
  The small vocabulary (1024, not 152k / 128k) leaves out most of the embedding and LM-head weights: the
  transformer body, the KV cache and the sequence lengths are the real models'.

    python bench/peer_workload.py /tmp/peer              # the 357m workload: /tmp/peer/model, /tmp/peer/prompts.jsonl
    python bench/peer_workload.py /tmp/peer15 1.5b       # the realistic-scale one
    python bench/peer_workload.py /tmp/peer-qwen2.5-7b qwen2.5-7b 512   # G7 (bench/peers.py builds it itself)
"""

from __future__ import annotations

import json
import os
import random
import sys

VOCAB = 1024
#: size -> (layers, hidden, heads, kv heads, intermediate, prompt tokens, tied embeddings)
SHAPES = {
    "357m": (24, 896, 14, 2, 4864, 32, True),
    "1.5b": (28, 1536, 12, 2, 8960, 256, False),
    "7b": (28, 3584, 28, 4, 18944, 256, False),
    "qwen2.5-7b": (28, 3584, 28, 4, 18944, 512, False),
    "llama3-8b": (32, 4096, 32, 8, 14336, 512, False),
}


def build(
    root: str,
    *,
    size: str = "357m",
    layers: int | None = None,
    hidden: int | None = None,
    seed: int = 0,
    prompts: int = 256,
) -> tuple[str, str]:
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
        n_layers, width, heads, kv_heads, inter, _, tied = SHAPES[size]
        if hidden is not None:  # a small variant of the shape (CPU checks of the scripts)
            width, inter, heads, kv_heads = hidden, hidden * 54 // 10, 14 if hidden % 14 == 0 else 4, 2
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            intermediate_size=inter,
            num_hidden_layers=layers or n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=4096 if size != "357m" else 1024,
            pad_token_id=VOCAB - 2,
            eos_token_id=VOCAB - 1,
            bos_token_id=None,
            tie_word_embeddings=tied,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
        )
        torch.manual_seed(seed)
        # Built on the CPU, in bf16: a GPU build in the background would take memory from the runs beside it
        # (vLLM's start-up profiling refuses to start when other processes' GPU memory changes under it).
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            # PEER_BUILD_DEVICE=cuda: initialise on the GPU (seconds for 7B, against ~9 min on the CPU) where nothing
            # else runs beside the build
            with torch.device(os.environ.get("PEER_BUILD_DEVICE", "cpu")):
                model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(previous)
        model.save_pretrained(model_dir)
        del model
        tok.save_pretrained(model_dir)
    write_prompts(root, size=size, seed=seed, prompts=prompts)
    return model_dir, data


def prompt_count(root: str) -> int:
    """How many prompts ``root``/prompts.jsonl holds (0 when it is missing)."""
    try:
        with open(os.path.join(root, "prompts.jsonl")) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def write_prompts(root: str, *, size: str = "357m", seed: int = 0, prompts: int = 256) -> str:
    """``root``/prompts.jsonl with ``prompts`` random prompts of the shape's length, written when it is missing or
    holds fewer (the first prompts are the same for any count: one seed). No torch needed."""
    data = os.path.join(root, "prompts.jsonl")
    if prompt_count(root) >= prompts:
        return data
    os.makedirs(root, exist_ok=True)
    rng = random.Random(seed)
    prompt_len = SHAPES[size][5]
    with open(data, "w") as f:
        for _ in range(prompts):
            f.write(json.dumps({"prompt": " ".join(f"t{rng.randrange(VOCAB - 3)}" for _ in range(prompt_len))}) + "\n")
    return data


def copy_first(prompts, completions, **_):
    """The peer's reward: the fraction of completion tokens equal to the prompt's first token."""
    out = []
    for prompt, completion in zip(prompts, completions):
        first = prompt.split()[0]
        toks = completion.split()
        out.append(sum(t == first for t in toks) / max(1, len(toks)))
    return out


if __name__ == "__main__":
    print(
        *build(
            sys.argv[1] if len(sys.argv) > 1 else "/tmp/peer",
            size=sys.argv[2] if len(sys.argv) > 2 else "357m",
            prompts=int(sys.argv[3]) if len(sys.argv) > 3 else 256,
        )
    )
