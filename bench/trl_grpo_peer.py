"""Peer anchor (issue 8): TRL's GRPOTrainer on the very model folder and workload `bench/e2e_gpu.py` trains.

    python bench/peer_workload.py /tmp/peer                   # the model + prompts (also built by e2e_gpu.py)
    python bench/trl_grpo_peer.py /tmp/peer/model             # TRL with plain transformers generate
    python bench/trl_grpo_peer.py /tmp/peer/model vllm        # TRL's vLLM colocate mode (sleep on)

Needs `pip install trl` (not a dependency of hybrid). Prints one `RESULT {json}` line with the seconds per step.
"""
import json, os, time
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true")
import torch
from datasets import Dataset
import sys
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from tokenizers import Tokenizer, models, pre_tokenizers
import trl
from trl import GRPOConfig, GRPOTrainer

V = 1024
vocab = {f"t{i}": i for i in range(V - 3)}; vocab.update({"<unk>": V - 3, "<pad>": V - 2, "</s>": V - 1})
tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")); tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
# Same-session comparison: the very model folder `hybrid grpo` trains (bench/peer_workload.py; the peer's shape).
MODEL_DIR = sys.argv[1] if len(sys.argv) > 1 else "/tmp/peer/model"
USE_VLLM = len(sys.argv) > 2 and sys.argv[2] == "vllm"
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16)
nparams = sum(p.numel() for p in model.parameters())
import random
random.seed(0)
prompts = [" ".join(f"t{random.randrange(V - 3)}" for _ in range(32)) for _ in range(256)]
ds = Dataset.from_dict({"prompt": prompts})

def reward_copy_first(completions, prompts, **kw):  # rule-based: fraction of completion tokens equal to the prompt's first token
    out = []
    for c, p in zip(completions, prompts):
        first = p.split()[0]; toks = c.split()
        out.append(sum(t == first for t in toks) / max(1, len(toks)))
    return out

class Clock(TrainerCallback):
    def __init__(self): self.t = []
    def on_step_end(self, args, state, control, **kw): torch.cuda.synchronize(); self.t.append(time.perf_counter())

clock = Clock()
args = GRPOConfig(output_dir="/tmp/trl-out", per_device_train_batch_size=64, num_generations=8, max_completion_length=128,
                  learning_rate=1e-6, bf16=True, logging_steps=1, max_steps=6, report_to="none", save_strategy="no",
                  use_vllm=USE_VLLM, temperature=1.0, gradient_accumulation_steps=1,
                  **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "vllm_enable_sleep_mode": True} if USE_VLLM else {}))
trainer = GRPOTrainer(model=model, reward_funcs=reward_copy_first, args=args, train_dataset=ds, processing_class=tok, callbacks=[clock])
t0 = time.perf_counter(); trainer.train(); total = time.perf_counter() - t0
steps = [b - a for a, b in zip(clock.t, clock.t[1:])]
res = {"trl": trl.__version__, "use_vllm": USE_VLLM, "model_dir": MODEL_DIR, "params_M": round(nparams / 1e6), "completions_per_step": 64, "max_completion_length": 128,
       "step_s": [round(s, 2) for s in steps], "median_step_s_after_first": round(sorted(steps)[len(steps) // 2], 2) if steps else None,
       "total_s": round(total, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
print("RESULT", json.dumps(res), flush=True)
