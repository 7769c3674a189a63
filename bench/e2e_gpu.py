"""GPU end to end (issue 8): `hybrid grpo` / `hybrid ppo` colocated on one GPU, timed phase by phase.

``--kl 0 --zero_stage 1 --micro 64`` is the set-up matched to TRL's defaults (no reference model, no parameter
partitioning, one micro-batch); the default is the issue's (reference + KL, ZeRO-3).

The workload is the TRL peer's (bench/peer_workload.py): a random ~359M Qwen2-shaped model, 8 prompts x 8 samples
per step, 32-token prompts, up to 128 new tokens, reward = fraction of completion tokens equal to the prompt's first
token. vLLM engine with sleep, DeepSpeed ZeRO-3 actor with sleep, a reference model (KL), bf16.

    python bench/e2e_gpu.py --algo grpo --steps 8 --warmup 2      # runs the CLI, prints a table, writes JSON
    python bench/e2e_gpu.py --algo grpo --dry                      # only builds the workload and prints the command

Each step's phases come from the run's metrics.jsonl; the step time is the median over the steps after warm-up.
With --gpus 2 --split, the engine gets GPU 1 and the trainer GPU 0 (weight sync over NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PHASES = ("generate", "sleep", "wake", "infer", "reward", "train", "sync")


def command(args, model: str, data: str, save: str) -> list[str]:
    cmd = [sys.executable, "-m", "hybrid_cli", args.algo,
           "--pretrain", model, "--prompt_data", data, "--input_key", "prompt",
           "--reward_fn", f"{HERE}/peer_workload.py:copy_first", "--backend", args.backend,
           "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1",
           "--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "1",
           "--zero_stage", str(args.zero_stage), "--bf16", "--rollout_batch_size", "8", "--n_samples_per_prompt", "8",
           "--train_batch_size", "64", "--micro_train_batch_size", str(args.micro), "--micro_rollout_batch_size", "64",
           "--prompt_max_len", "64", "--generate_max_len", "128", "--max_steps", str(args.steps),
           "--actor_learning_rate", str(args.lr), "--temperature", "1.0", "--init_kl_coef", str(args.kl),
           "--vllm_gpu_memory_utilization", str(args.gpu_util), "--save_path", save, "--seed", "0",
           "--engine_sleep_level", str(args.sleep_level)]
    if args.algo == "ppo":
        cmd += ["--critic_num_nodes", "1", "--critic_num_gpus_per_node", "1", "--critic_learning_rate", "1e-6"]
    if args.split:
        # Engine on its own GPU, the trainer roles on the other: nothing sleeps, weights go over NCCL.
        cmd += ["--placement", "actor=0", "reference=0", "rollout=1", *(["critic=0"] if args.algo == "ppo" else []),
                "--no_vllm_enable_sleep"]
    else:
        cmd += ["--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep"]
    if args.enforce_eager:
        cmd += ["--enforce_eager"]
    return cmd


def summarize(metrics_path: str, warmup: int) -> dict:
    steps = [json.loads(line) for line in open(metrics_path)]
    steady = steps[warmup:] or steps
    med = {p: statistics.median(s.get(f"time/{p}", 0.0) for s in steady) for p in PHASES}
    step_s = statistics.median(s["time/step"] for s in steady)
    overhead = statistics.median((s.get("time/sleep", 0) + s.get("time/wake", 0) + s.get("time/sync", 0)) / s["time/step"]
                                 for s in steady)
    return {"steps": len(steps), "steady_steps": len(steady), "step_s": step_s, "phases_s": med,
            "sleep_wake_sync_share_pct": 100 * overhead, "rewards": [s["reward"] for s in steps],
            "step_times": [s["time/step"] for s in steps],
            "peak_gib": max((s.get("memory/peak_gib", 0.0) for s in steps), default=0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", choices=["grpo", "ppo", "reinforce"], default="grpo")
    ap.add_argument("--backend", default="vllm")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--gpu_util", type=float, default=0.35)
    ap.add_argument("--sleep_level", type=int, default=1)
    ap.add_argument("--split", action="store_true", help="engine on GPU 1, trainer on GPU 0")
    ap.add_argument("--zero_stage", type=int, default=3, help="the actor's ZeRO stage (the issue's set-up: 3)")
    ap.add_argument("--kl", type=float, default=0.001,
                    help="--init_kl_coef; 0 runs no reference model (TRL's default beta = 0)")
    ap.add_argument("--tag", default="", help="suffix of the run folder and JSON name (variants of one algo)")
    ap.add_argument("--enforce_eager", action="store_true")
    ap.add_argument("--workdir", default="/tmp/peer")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--small", action="store_true", help="a 2-layer model (CPU logic check with --backend hf)")
    args = ap.parse_args()

    sys.path.insert(0, HERE)
    from peer_workload import build

    model, data = build(args.workdir, **({"layers": 2, "hidden": 112} if args.small else {}))
    tag = f"{args.algo}-{'split' if args.split else 'colocated'}{'-' + args.tag if args.tag else ''}"
    save = os.path.join(args.workdir, "runs", tag)
    cmd = command(args, model, data, save)
    print("command:", shlex.join(cmd), flush=True)
    if args.dry:
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*(os.path.join(ROOT, "packages", p, "src") for p in ("hybrid-core", "hybrid-engines", "hybrid-algos", "hybrid-cli")),
         os.environ.get("PYTHONPATH", "")])}
    start = time.time()
    proc = subprocess.run(cmd, env=env)
    result = {"tag": tag, "rc": proc.returncode, "wall_s": time.time() - start, "command": shlex.join(cmd)}
    metrics = os.path.join(save, "metrics.jsonl")
    if os.path.exists(metrics):
        result.update(summarize(metrics, args.warmup))
        print(f"\n{tag}: {result['steps']} steps, median step {result['step_s']:.2f} s "
              f"(after {args.warmup} warm-up), sleep+wake+sync {result['sleep_wake_sync_share_pct']:.1f} %")
        print(f"{'phase':<10} {'s (median)':>10}")
        for p, v in result["phases_s"].items():
            print(f"{p:<10} {v:>10.3f}")
        print("reward per step:", " ".join(f"{r:.3f}" for r in result["rewards"]))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"e2e-{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
