"""Peer anchor: TRL's GRPOTrainer on the very model folder and workload `bench/e2e_gpu.py` trains.

    python bench/peer_workload.py /tmp/peer                   # the model + prompts (also built by e2e_gpu.py)
    python bench/trl_grpo_peer.py /tmp/peer/model             # TRL with plain transformers generate
    python bench/trl_grpo_peer.py /tmp/peer/model vllm        # TRL's vLLM colocate mode, at its default (no sleep)
    python bench/trl_grpo_peer.py /tmp/peer/model vllm --sleep   # ... with vllm_enable_sleep_mode (its memory saver)
    python bench/trl_grpo_peer.py /tmp/peer15/model vllm --prompts 32 --max_new 1024 --micro 8 --ckpt --steps 8

One optimizer step = one generation round of ``--prompts`` x ``--generations`` completions (TRL's
``generation_batch_size``), trained in micro-batches of ``--micro`` with gradient accumulation. Needs `pip install
trl` (not a dependency of hybrid). Timed on the clock of every peer comparison (bench/_common.py
``steady_step_times``: wall time between step ends, the same ``--warmup`` steps dropped as ours, >= 5 measured).
Prints one `RESULT {json}` line with the seconds per step; an out-of-memory
failure prints `RESULT {"error": ...}` (the 7B workload is expected to need settings TRL does not make by itself).
"""

import argparse
import json
import os
import random
import sys
import time

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true")

ap = argparse.ArgumentParser()
ap.add_argument("model_dir", nargs="?", default="/tmp/peer/model")
ap.add_argument("mode", nargs="?", default="plain", choices=["plain", "vllm"])
ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
ap.add_argument("--generations", type=int, default=8)
ap.add_argument("--max_new", type=int, default=128)
ap.add_argument("--micro", type=int, default=64, help="completions per micro-batch (per_device_train_batch_size)")
ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--warmup", type=int, default=2, help="steps dropped before timing (the same as ours)")
ap.add_argument(
    "--sleep",
    action="store_true",
    help="vllm_enable_sleep_mode=True (TRL's default is off: use it where the run does not fit without)",
)
ap.add_argument("--gpu_util", type=float, default=0.3)
args = ap.parse_args()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from _common import median_step, steady_step_times  # noqa: E402

V = 1024
vocab = {f"t{i}": i for i in range(V - 3)}
vocab.update({"<unk>": V - 3, "<pad>": V - 2, "</s>": V - 1})
tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
prompts_file = os.path.join(os.path.dirname(args.model_dir), "prompts.jsonl")
prompts = [json.loads(line)["prompt"] for line in open(prompts_file)]
random.seed(0)
ds = Dataset.from_dict({"prompt": prompts})


def reward_copy_first(completions, prompts, **kw):  # the rule of bench/peer_workload.py
    out = []
    for c, p in zip(completions, prompts):
        first = p.split()[0]
        toks = c.split()
        out.append(sum(t == first for t in toks) / max(1, len(toks)))
    return out


class Clock(TrainerCallback):
    def __init__(self):
        self.t = []

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.t.append(time.perf_counter())


per_step = args.prompts * args.generations
clock = Clock()
result = {
    "trl": trl.__version__,
    "mode": args.mode,
    "model_dir": args.model_dir,
    "completions_per_step": per_step,
    "max_completion_length": args.max_new,
}
try:
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    result["params_M"] = round(sum(p.numel() for p in model.parameters()) / 1e6)
    config = GRPOConfig(
        output_dir="/tmp/trl-out",
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=per_step // args.micro,
        num_generations=args.generations,
        max_completion_length=args.max_new,
        learning_rate=1e-6,
        bf16=True,
        logging_steps=1,
        max_steps=args.steps,
        report_to="none",
        save_strategy="no",
        temperature=1.0,
        gradient_checkpointing=args.ckpt,
        use_vllm=args.mode == "vllm",
        **(
            {
                "vllm_mode": "colocate",
                "vllm_gpu_memory_utilization": args.gpu_util,
                "vllm_enable_sleep_mode": args.sleep,
            }
            if args.mode == "vllm"
            else {}
        ),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_copy_first,
        args=config,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[clock],
    )
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    steps = steady_step_times(clock.t, args.warmup)
    median = median_step(clock.t, args.warmup)
    result.update(
        step_s=[round(s, 3) for s in steps],
        total_s=round(total, 1),
        warmup=args.warmup,
        sleep=args.sleep,
        median_step_s=round(median, 3) if median is not None else None,
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
        tokens_per_step=None,
    )
except torch.OutOfMemoryError as e:  # noqa: BLE001 - the report is the point
    result["error"] = f"CUDA out of memory: {str(e).splitlines()[0][:300]}"
except Exception as e:  # noqa: BLE001
    result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
print("RESULT", json.dumps(result), flush=True)
sys.exit(0 if "error" not in result else 3)
