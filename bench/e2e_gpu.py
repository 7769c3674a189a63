"""GPU end to end: `hybrid grpo` / `hybrid ppo` colocated on one GPU, timed phase by phase, with the residency plan's
predicted peak per phase checked against nvidia-smi samples.

Workloads (bench/peer_workload.py, shared with the TRL peer): ``--size 357m`` (8 prompts x 8 samples, 32-token
prompts, <= 128 new tokens), ``--size 1.5b`` (32 x 8, 256-token prompts, <= 1024 new tokens, gradient
checkpointing), ``--size 7b`` (a model that does not fit resident: the planner decides what moves), and issue 38's
``--size qwen2.5-7b`` (G7: 64 x 8, 512-token prompts, <= 1024 new tokens) and ``--size llama3-8b`` (P8: 256 x 1,
with ``--algo ppo``), both with ``--gpus 4`` (every role on the 4 GPUs, ``--engines`` x ``--tp`` vLLM engines).
Set-ups: the default is the issue's (reference + KL, ZeRO-3 actor); ``--kl 0 --zero_stage 1 --micro 64`` is matched
to TRL's defaults (no reference, one micro-batch). ``--residency`` auto (the planner) | all-sleep (every role moves
between its phases: the behaviour before the planner).

    python bench/e2e_gpu.py --algo grpo --steps 8 --warmup 2      # runs the CLI, prints a table, writes JSON
    python bench/e2e_gpu.py --algo grpo --dry                      # only builds the workload and prints the command

Each step's phases come from the run's metrics.jsonl; the step time is the median over the steps after warm-up.
``residency peak error %``: per phase, |measured - predicted| / predicted of the GPU's peak (all processes), the
worst phase, after the warm-up steps (GPU 0's). With --split (two GPUs), the engine gets GPU 1 and the trainer GPU 0.
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
#: size -> (prompts per step, samples, max new tokens, prompt max len, micro rollout batch)
WORKLOADS = {
    "357m": (8, 8, 128, 64, 64),
    "1.5b": (32, 8, 1024, 256, 16),
    "7b": (16, 8, 512, 256, 8),
    # issue 38's multi-GPU workloads (bench/peers.py G7 / P8): run with --gpus 4
    "qwen2.5-7b": (64, 8, 1024, 512, 16),
    "llama3-8b": (256, 1, 1024, 512, 16),
}


def command(args, model: str, data: str, save: str) -> list[str]:
    prompts, samples, max_new, prompt_len, micro_rollout = WORKLOADS[args.size]
    per_step = prompts * samples
    cmd = [
        sys.executable,
        "-m",
        "hybrid_cli",
        args.algo,
        "--pretrain",
        model,
        "--prompt_data",
        data,
        "--input_key",
        "prompt",
        "--reward_fn",
        f"{HERE}/peer_workload.py:copy_first",
        "--backend",
        args.backend,
        "--actor_num_nodes",
        "1",
        "--actor_num_gpus_per_node",
        str(args.gpus),
        "--ref_num_nodes",
        "1",
        "--ref_num_gpus_per_node",
        str(args.gpus),
        "--vllm_num_engines",
        str(args.engines),
        "--vllm_tensor_parallel_size",
        str(args.tp),
        "--bf16",
        "--rollout_batch_size",
        str(prompts),
        "--n_samples_per_prompt",
        str(samples),
        "--train_batch_size",
        str(per_step),
        "--micro_train_batch_size",
        str(min(args.micro, per_step)),
        "--micro_rollout_batch_size",
        str(micro_rollout),
        "--prompt_max_len",
        str(prompt_len),
        "--generate_max_len",
        str(max_new),
        "--max_steps",
        str(args.steps),
        "--actor_learning_rate",
        str(args.lr),
        "--temperature",
        "1.0",
        "--init_kl_coef",
        str(args.kl),
        "--save_path",
        save,
        "--seed",
        "0",
        "--residency",
        args.residency,
    ]
    if args.trainer == "fsdp2":  # DeepSpeed's --zero_stage is refused under FSDP2 (it shards per decoder layer)
        cmd += ["--trainer", "fsdp2"]
    else:
        cmd += ["--zero_stage", str(args.zero_stage)]
    if args.backend != "hf":  # the built-in engine has no memory pool (nor CUDA graphs): hybrid refuses these there
        cmd += ["--vllm_gpu_memory_utilization", str(args.gpu_util)]
    if args.sleep_level:
        cmd += ["--engine_sleep_level", str(args.sleep_level)]
    if args.ckpt or args.size != "357m":
        cmd += ["--gradient_checkpointing"]
    if args.algo == "ppo":
        cmd += [
            "--critic_num_nodes",
            "1",
            "--critic_num_gpus_per_node",
            str(args.gpus),
            "--critic_learning_rate",
            "1e-6",
        ]
    if args.split:
        # Engine on its own GPU, the trainer roles on the other: nothing shares, weights go over NCCL.
        cmd += ["--placement", "actor=0", "reference=0", "rollout=1", *(["critic=0"] if args.algo == "ppo" else [])]
    else:
        cmd += ["--colocate_all_models"]
    if args.enforce_eager and args.backend != "hf":
        cmd += ["--enforce_eager"]
    cmd += args.extra
    return cmd


def summarize(metrics_path: str, warmup: int) -> dict:
    """The run's steps after ``warmup``: ``step_s`` on the peers' clock (wall time between step ends, everything the
    step costs: _common.steady_step_times), ``step_s_inside`` the loop's own step timer, and the phases' medians."""
    from _common import steady_step_times

    steps = [json.loads(line) for line in open(metrics_path)]
    steady = steps[warmup:] or steps
    med = {p: statistics.median(s.get(f"time/{p}", 0.0) for s in steady) for p in PHASES}
    wall = steady_step_times([s["wall_time"] for s in steps], warmup) if len(steps) > warmup else []
    step_s = statistics.median(wall) if wall else statistics.median(s["time/step"] for s in steady)
    overhead = statistics.median(
        (s.get("time/sleep", 0) + s.get("time/wake", 0) + s.get("time/sync", 0)) / s["time/step"] for s in steady
    )
    return {
        "steps": len(steps),
        "steady_steps": len(wall) or len(steady),
        "step_s": step_s,
        "step_s_inside": statistics.median(s["time/step"] for s in steady),
        "phases_s": med,
        "sleep_wake_sync_share_pct": 100 * overhead,
        "rewards": [s["reward"] for s in steps],
        "step_times": [s["time/step"] for s in steps],
        "step_ends": [s.get("wall_time") for s in steps],  # the one clock's raw times (bench/peer_ratio.py)
        "response_len": statistics.median(s.get("response_len", 0.0) for s in steady),
    }


def peak_error(save: str, samples_csv: str, warmup: int) -> dict:
    """Predicted (residency.json) vs measured (nvidia-smi, all processes) peak per phase on GPU 0."""
    from gpu_sampler import peaks

    plan = json.load(open(os.path.join(save, "residency.json")))
    measured = peaks(samples_csv, os.path.join(save, "timeline.jsonl"), skip_steps=warmup)
    # the timeline's phase names -> the plan's (several timeline phases happen inside one plan phase)
    timeline_to_plan = {"generate": "generate", "train": "actor_train", "sync": "sync"}
    rows = {}
    for tl_phase, plan_phase in timeline_to_plan.items():
        seen = measured.get(tl_phase, {}).get(0)
        predicted = plan["peaks"]["0"].get(plan_phase)
        if seen is None or not predicted:
            continue
        pred_gib = predicted / 2**30
        rows[plan_phase] = {
            "predicted_gib": pred_gib,
            "measured_gib": seen,
            "error_pct": 100 * abs(seen - pred_gib) / pred_gib,
        }
    worst = max((r["error_pct"] for r in rows.values()), default=None)
    return {"phases": rows, "worst_error_pct": worst, "moves": plan["moves"], "capacity_gib": plan["capacity"] / 2**30}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", choices=["grpo", "ppo", "reinforce"], default="grpo")
    ap.add_argument("--size", choices=sorted(WORKLOADS), default="357m")
    ap.add_argument("--backend", default="vllm")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--gpu_util", type=float, default=0.35)
    ap.add_argument("--sleep_level", type=int, default=0, help="force --engine_sleep_level (0: the plan decides)")
    ap.add_argument("--residency", default="auto", choices=["auto", "all-sleep", "manual"])
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing (always on above 357m)")
    ap.add_argument("--split", action="store_true", help="engine on GPU 1, trainer on GPU 0")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of every colocated role (issue 38's workloads: 4)")
    ap.add_argument("--engines", type=int, default=None, help="vLLM engines (default: --gpus / --tp)")
    ap.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size of each engine")
    ap.add_argument("--zero_stage", type=int, default=3, help="the actor's ZeRO stage (the issue's set-up: 3)")
    ap.add_argument("--trainer", choices=["deepspeed", "fsdp2"], default="deepspeed", help="the trainer backend")
    ap.add_argument(
        "--kl", type=float, default=0.001, help="--init_kl_coef; 0 runs no reference model (TRL's default beta = 0)"
    )
    ap.add_argument("--tag", default="", help="suffix of the run folder and JSON name (variants of one algo)")
    ap.add_argument("--enforce_eager", action="store_true")
    ap.add_argument("--workdir", default=None, help="default /tmp/peer (357m) or /tmp/peer-<size>")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--small", action="store_true", help="a 2-layer model (CPU logic check with --backend hf)")
    ap.add_argument("extra", nargs="*", help="more hybrid flags, after --")
    args = ap.parse_args()
    args.engines = args.engines or max(1, args.gpus // args.tp)
    if args.split and args.gpus != 1:
        ap.error("--split places the trainer on GPU 0 and the engine on GPU 1: leave --gpus at 1")

    sys.path.insert(0, HERE)
    from peer_workload import build

    workdir = args.workdir or ("/tmp/peer" if args.size == "357m" else f"/tmp/peer-{args.size}")
    per_step_prompts = WORKLOADS[args.size][0]  # prompts enough for every step (each is used once)
    model, data = build(
        workdir,
        size=args.size,
        prompts=max(256, args.steps * per_step_prompts),
        **({"layers": 2, "hidden": 112} if args.small else {}),
    )
    tag = f"{args.algo}-{args.size}-{'split' if args.split else 'colocated'}"
    tag += ("-fsdp2" if args.trainer == "fsdp2" else "") + (f"-{args.tag}" if args.tag else "")
    save = os.path.join(workdir, "runs", tag)
    cmd = command(args, model, data, save)
    print("command:", shlex.join(cmd), flush=True)
    if args.dry:
        return 0
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
    from gpu_sampler import start as start_sampler

    samples_csv = os.path.join(workdir, f"mem-{tag}.csv")
    sampler = start_sampler(samples_csv)
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env)
    finally:
        if sampler is not None:
            sampler.terminate()
    result = {"tag": tag, "rc": proc.returncode, "wall_s": time.time() - start, "command": shlex.join(cmd)}
    metrics = os.path.join(save, "metrics.jsonl")
    if os.path.exists(metrics) and os.path.getsize(metrics) == 0:
        print(f"\n{tag}: the run wrote no step (exit {proc.returncode}): nothing to time; its error is above")
    elif os.path.exists(metrics):
        result.update(summarize(metrics, args.warmup))
        prompts, samples, _, _, _ = WORKLOADS[args.size]
        result["tokens_per_s"] = prompts * samples * result["response_len"] / result["step_s"]
        print(
            f"\n{tag}: {result['steps']} steps, median step {result['step_s']:.2f} s "
            f"(after {args.warmup} warm-up), sleep+wake+sync {result['sleep_wake_sync_share_pct']:.1f} %, "
            f"{result['tokens_per_s']:.0f} generated tokens/s"
        )
        print(f"{'phase':<10} {'s (median)':>10}")
        for p, v in result["phases_s"].items():
            print(f"{p:<10} {v:>10.3f}")
        print("reward per step:", " ".join(f"{r:.3f}" for r in result["rewards"]))
    summary_json = os.path.join(save, "summary.json")
    if os.path.exists(summary_json):  # where the run's start went, before its first step (the one clock skips it)
        result["setup_s"] = json.load(open(summary_json)).get("setup_seconds") or {}
        print("set-up s:", ", ".join(f"{k} {v:.1f}" for k, v in result["setup_s"].items()))
    if sampler is not None and "step_s" in result and os.path.exists(os.path.join(save, "residency.json")):
        result["peaks"] = peak_error(save, samples_csv, args.warmup)
        for phase, r in result["peaks"]["phases"].items():
            print(
                f"peak {phase:<12} predicted {r['predicted_gib']:6.2f} GiB  measured {r['measured_gib']:6.2f} GiB  "
                f"error {r['error_pct']:5.1f} %"
            )
    out = os.environ.get("OUT")
    if out:
        from _common import code_id

        result["code"] = code_id()  # the peers' `compare --record` names the code this run measured
        with open(os.path.join(out, f"e2e-{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
