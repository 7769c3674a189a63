"""Issue 10: reference document 001's hybrid-engine command line (REINFORCE++, everything colocated on 8 GPUs,
vLLM and DeepSpeed sleeping), run as written through ``hybrid ppo`` with local stand-ins, scaled to the GPUs at hand.

What changes from the document's command (tests/hybrid_cli/data/openrlhf_commands/001_hybrid_8gpu.args):
- ``--pretrain``: a ~1B Llama built from a config (bf16, random weights, a word-level tokenizer with a chat
  template) instead of Llama-3-8b-sft; ``--reward_pretrain``: a small random LlamaForSequenceClassification.
- ``--prompt_data``: local synthetic chat prompts (``context_messages``).
- ``--gpus N`` (8 as written): every ``*_num_gpus_per_node`` becomes N, ``--vllm_num_engines`` N / TP, and the
  rollout batch scales with the GPUs (1024 x N / 8) so each GPU does the document's share of the work.
- ``--max_len L`` sets ``--prompt_max_len`` and ``--generate_max_len`` (1024 as written; a random model never
  stops early, so every sample is L tokens long) and ``--max_steps`` bounds the run.

Prints the step table (median after warm-up), the phase breakdown, GPU memory peak per GPU per phase (all
processes, from nvidia-smi samples matched to the run's phase timeline) and the weight-sync time; JSON to $OUT.

    python bench/openrlhf_001.py --gpus 2 --tp 1 --max_len 256 --steps 6     # 2 engines x TP 1
    python bench/openrlhf_001.py --gpus 2 --tp 2 --max_len 256 --steps 6     # 1 engine  x TP 2
    python bench/openrlhf_001.py --dry                                       # print the command, build nothing
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ARGS_FILE = os.path.join(ROOT, "tests", "hybrid_cli", "data", "openrlhf_commands", "001_hybrid_8gpu.args")
PHASES = ("generate", "sleep", "wake", "infer", "reward", "train", "sync")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<sep>{% endif %}"
)
# ~1.0B parameters: 18 Llama layers of width 2048 (GQA 16/8 heads), vocabulary 32000, untied head.
POLICY_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=18,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
)
REWARD_SHAPE = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=32000,
)
SPECIALS = ("<pad>", "<s>", "</s>", "<sep>", "<unk>")


def tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i + len(SPECIALS) for i in range(vocab_size - len(SPECIALS))})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        sep_token="<sep>",
        unk_token="<unk>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build(root: str, prompts: int = 4096, seed: int = 0, small: bool = False) -> tuple[str, str, str]:
    """Policy, reward model and prompt file under ``root`` (reused when present); ``small``: 2-layer stand-ins."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    policy, reward, data = (os.path.join(root, n) for n in ("policy", "reward", "prompts.jsonl"))
    ids = dict(
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    policy_shape = {**REWARD_SHAPE, "hidden_size": 128, "intermediate_size": 256} if small else POLICY_SHAPE
    for path, cls, shape, extra in (
        (policy, LlamaForCausalLM, policy_shape, {}),
        (reward, LlamaForSequenceClassification, REWARD_SHAPE, {"num_labels": 1}),
    ):
        if not os.path.exists(os.path.join(path, "config.json")):
            torch.manual_seed(seed)
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of 1B is slow on CPU
                model = cls(LlamaConfig(**shape, **ids, **extra)).to(torch.bfloat16)
            model.save_pretrained(path)
            tokenizer(shape["vocab_size"]).save_pretrained(path)
            del model
    if not os.path.exists(data):
        rng = random.Random(seed)
        with open(data + ".tmp", "w") as f:
            for _ in range(prompts):
                text = " ".join(
                    f"t{rng.randrange(POLICY_SHAPE['vocab_size'] - len(SPECIALS))}"
                    for _ in range(rng.randrange(16, 65))
                )
                f.write(json.dumps({"context_messages": [{"role": "user", "content": text}]}) + "\n")
        os.replace(data + ".tmp", data)
    return policy, reward, data


def document_argv() -> list[str]:
    with open(ARGS_FILE) as f:
        return shlex.split(" ".join(line.strip() for line in f if line.strip() and not line.startswith("#")))


def command(args, policy: str, reward: str, data: str, save: str) -> list[str]:
    engines = args.gpus // args.tp
    replace = {
        "--ref_num_gpus_per_node": str(args.gpus),
        "--reward_num_gpus_per_node": str(args.gpus),
        "--actor_num_gpus_per_node": str(args.gpus),
        "--vllm_num_engines": str(engines),
        "--vllm_tensor_parallel_size": str(args.tp),
        "--pretrain": policy,
        "--reward_pretrain": reward,
        "--prompt_data": data,
        "--save_path": os.path.join(save, "final"),
        "--ckpt_path": os.path.join(save, "ckpt"),
        "--rollout_batch_size": str(1024 * args.gpus // 8),
        "--prompt_max_len": str(args.max_len),
        "--generate_max_len": str(args.max_len),
    }
    argv = document_argv()
    argv = [replace.get(argv[i - 1], word) if i else word for i, word in enumerate(argv)]
    extra = ["--backend", args.backend] if args.backend else []
    return [sys.executable, "-m", "hybrid_cli", "ppo", *argv, "--max_steps", str(args.steps), "--seed", "0", *extra]


def summarize(run_dir: str, warmup: int) -> dict:
    steps = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steady = steps[warmup:] or steps
    return {
        "steps": len(steps),
        "steady_steps": len(steady),
        "step_s": statistics.median(s["time/step"] for s in steady),
        "phases_s": {p: statistics.median(s.get(f"time/{p}", 0.0) for s in steady) for p in PHASES},
        "sync_s": statistics.median(s.get("time/sync", 0.0) for s in steady),
        "step_times": [s["time/step"] for s in steps],
        "rewards": [s.get("reward") for s in steps],
        # engine vs actor log-probs of the same tokens: numerics only when the weight sync delivered the weights
        "logprob_gap": [s.get("rollout/logprob_gap") for s in steps],
        "logprob_gap_max": [s.get("rollout/logprob_gap_max") for s in steps],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--workdir", default="/tmp/r001")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--build_only", action="store_true")
    ap.add_argument(
        "--small", action="store_true", help="2-layer stand-ins (a CPU check of the script with --backend hf)"
    )
    ap.add_argument("--backend", default=None, help="override the engine backend (vllm as written; hf for a CPU check)")
    args = ap.parse_args()
    if args.gpus % args.tp:
        ap.error(f"--gpus {args.gpus} is not a multiple of --tp {args.tp}")

    tag = f"001-{args.gpus}gpu-tp{args.tp}"
    save = os.path.join(args.workdir, "runs", tag)
    paths = (
        (os.path.join(args.workdir, n) for n in ("policy", "reward", "prompts.jsonl"))
        if args.dry
        else build(args.workdir, small=args.small)
    )
    cmd = command(args, *paths, save)
    print("command:", shlex.join(cmd), flush=True)
    if args.dry or args.build_only:
        return 0

    sys.path.insert(0, HERE)
    import gpu_sampler

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [
                *(
                    os.path.join(ROOT, "packages", p, "src")
                    for p in ("hybrid-core", "hybrid-engines", "hybrid-algos", "hybrid-cli")
                ),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    out = os.environ.get("OUT")
    samples = os.path.join(out or args.workdir, f"mem-{tag}.csv")
    sampler = gpu_sampler.start(samples)
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env)
    finally:
        if sampler is not None:
            sampler.terminate()
    result = {"tag": tag, "rc": proc.returncode, "wall_s": time.time() - start, "command": shlex.join(cmd)}
    run_dir = os.path.join(save, "final")
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        result.update(summarize(run_dir, args.warmup))
        print(f"\n{tag}: {result['steps']} steps, median step {result['step_s']:.2f} s after {args.warmup} warm-up")
        print(
            "engine vs actor log-prob gap per step (mean / max):",
            ", ".join(
                f"{a:.4f}/{b:.3f}" for a, b in zip(result["logprob_gap"], result["logprob_gap_max"]) if a is not None
            ),
        )
        print(f"{'phase':<10} {'s (median)':>10}")
        for p, v in result["phases_s"].items():
            print(f"{p:<10} {v:>10.3f}")
        timeline = os.path.join(run_dir, "timeline.jsonl")
        if sampler is not None and os.path.exists(timeline):
            table = gpu_sampler.peaks(samples, timeline, skip_steps=args.warmup)
            result["peak_gib"] = {p: {str(g): round(v, 2) for g, v in per.items()} for p, per in table.items()}
            result["peak_gib_max"] = max((v for per in table.values() for v in per.values()), default=None)
            print("\nGPU memory peak, GiB (all processes):\n" + gpu_sampler.render(table))
    if out:
        with open(os.path.join(out, f"{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
