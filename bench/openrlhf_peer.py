"""Peer: OpenRLHF 0.11.2 itself (``python -m openrlhf.cli.train_ppo_ray``) on the workloads `bench/e2e_gpu.py` runs.

Same model folders and prompts (bench/peer_workload.py), same reward (``copy_first``, through OpenRLHF's
custom-reward-file hook: bench/openrlhf_reward.py), everything colocated on one GPU with vLLM and DeepSpeed
sleeping (OpenRLHF's hybrid engine: ``--vllm.enable_sleep --ds.enable_sleep``) or, with ``--no_sleep``, both kept
resident (OpenRLHF's default for those two flags; nothing is offloaded or reloaded between phases, where the
workload fits). OpenRLHF's model code imports flash-attn at module level and none exists for the GPU image's torch:
bench/openrlhf_standin/ provides those few names (no package metadata, so transformers does not use it) and the runs
ask for ``--ds.attn_implementation sdpa``, without packing / dynamic batch / ring attention.

Set-ups (``--setup``), each the counterpart of one of our runs in bench/sessions/residency_session.sh:
* ``matched`` -- ours ``--kl 0 --zero_stage 1 --micro 64``: ZeRO-1, no reference model.
* ``zero3ref`` -- ours default: ZeRO-3 actor + reference model (KL coefficient 0.001 in the reward).
``--size 1.5b`` is the realistic-scale workload (32 x 8, 256-token prompts, <= 1024 new tokens, micro 8, gradient
checkpointing, vLLM at 0.3 of the GPU), run with ``matched``.

    python bench/openrlhf_peer.py --size 357m --setup matched --steps 10 --warmup 2   # runs it, table + JSON
    python bench/openrlhf_peer.py --size 1.5b --no_sleep --steps 8   # without --vllm.enable_sleep --ds.enable_sleep
    python bench/openrlhf_peer.py --dry                       # print the command only (builds the workload)
    python bench/openrlhf_peer.py --check                     # OpenRLHF's own parser + checks on the command, no run
    python bench/openrlhf_peer.py compare --openrlhf A.json --ours B.json [--record]   # speedup rows

The step time is on the clock of every peer comparison (bench/_common.py ``steady_step_times``): wall time between
step ends, here the arrival times of OpenRLHF's per-step log lines (``✨ Global step N: {...}``, logged once the
step's status is complete) as this script receives them, the same ``--warmup`` steps dropped as ours, a figure only
with >= 5 measured steps (fewer: the run is reported as failed, with the fix). The lines come through Ray's log
forwarding from the trainer actor: a delay that is the same for every line cancels out of the differences, and the
median is not moved by one late line. The phases come from the same line, the trainer's status dict:
``timing/generation`` (vLLM wake-up + rollout + engine sleep), ``timing/make_experience`` (rewards, old and reference
log-probs), ``timing/ppo_train`` (DeepSpeed reload, actor update, offload), ``timing/broadcast`` (vLLM weights woken
+ the actor's parameters sent one at a time over CUDA IPC: their weight sync) and ``timing/step_total`` (their sum:
OpenRLHF's own step timer, kept as ``step_s_inside`` and printed beside the wall figure as a cross-check; it leaves
out what happens between its phases, logging and checkpoints included).
A failed run prints the tail of OpenRLHF's log and its last traceback, and writes them into the JSON.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import MIN_MEASURED_STEPS, steady_step_times  # noqa: E402
from _peer_process import (  # noqa: E402
    DEFAULTS,
    WORKLOADS,
    failure,
    gpu_name,
    installed_version,
    run_peer,
    summarize_steps,
)

STANDIN = os.path.join(HERE, "openrlhf_standin")
REWARD_FILE = os.path.join(HERE, "openrlhf_reward.py")
#: where bench/sessions/openrlhf_session.sh installs OpenRLHF and the packages it carries (kept apart from /tmp/site:
#: the OpenRLHF wheel also installs a top-level ``tests`` package)
DEFAULT_SITE = "/tmp/site-orl"
PHASES = ("generation", "make_experience", "ppo_train", "broadcast")
STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})\s*$")
NUMBER_ITEM = re.compile(r"'([^']+)':\s*(?:np\.float\d*\()?(-?[0-9.]+(?:e[-+]?\d+)?|nan|inf)")


def command(args, model: str, data: str) -> list[str]:
    """OpenRLHF 0.11.2's dotted flags for one run (see the module docstring for what each set-up means)."""
    prompts, samples, max_new, prompt_len, micro_rollout = WORKLOADS[args.size]
    per_step = prompts * samples
    zero_stage, kl = (1, 0.0) if args.setup == "matched" else (3, 0.001)
    if args.zero_stage is not None:
        zero_stage = args.zero_stage
    cmd = [
        sys.executable,
        "-m",
        "openrlhf.cli.train_ppo_ray",
        "--actor.model_name_or_path",
        model,
        "--reward.remote_url",
        REWARD_FILE,
        "--data.prompt_dataset",
        data,
        "--data.input_key",
        "prompt",
        "--data.max_samples",
        str(args.steps * prompts),
        "--data.max_len",
        str(prompt_len + max_new),
        "--rollout.max_new_tokens",
        str(max_new),
        "--rollout.batch_size",
        str(prompts),
        "--rollout.n_samples_per_prompt",
        str(samples),
        "--rollout.micro_batch_size",
        str(micro_rollout),
        "--rollout.temperature",
        "1.0",
        "--rollout.top_p",
        "1.0",
        "--train.batch_size",
        str(per_step),
        "--train.micro_batch_size",
        str(min(args.micro, per_step)),
        "--train.max_epochs",
        "1",
        "--train.num_episodes",
        "1",
        "--train.seed",
        "0",
        "--algo.advantage.estimator",
        "group_norm",
        "--algo.kl.init_coef",
        str(kl),
        "--actor.adam.lr",
        str(args.lr),
        "--actor.num_nodes",
        "1",
        "--actor.num_gpus_per_node",
        "1",
        "--ref.num_nodes",
        "1",
        "--ref.num_gpus_per_node",
        "1",
        "--reward.num_nodes",
        "1",
        "--reward.num_gpus_per_node",
        "1",
        "--vllm.num_engines",
        "1",
        "--vllm.tensor_parallel_size",
        "1",
        "--vllm.gpu_memory_utilization",
        str(args.gpu_util),
        "--train.colocate_all",
        "--ds.zero_stage",
        str(zero_stage),
        "--ds.param_dtype",
        "bf16",
        "--ds.attn_implementation",
        "sdpa",
        "--logger.logging_steps",
        "1",
        "--ckpt.output_dir",
        os.path.join(args.workdir, "openrlhf-ckpt"),
        "--ckpt.path",
        os.path.join(args.workdir, "openrlhf-ckpt", "checkpoints"),
    ]
    if not args.no_sleep:  # the hybrid engine's memory saver: vLLM and DeepSpeed release the GPU between phases
        cmd += ["--vllm.enable_sleep", "--ds.enable_sleep"]
    if args.ckpt:
        cmd += ["--actor.gradient_checkpointing_enable"]
    if args.enforce_eager:
        cmd += ["--vllm.enforce_eager"]
    return cmd + list(args.extra)


def environment(site: str) -> dict:
    """The run's environment: the stand-in and OpenRLHF's packages first, then what the session already set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STANDIN, site, env.get("PYTHONPATH", "")) if p)
    # OpenRLHF drives vLLM's AsyncLLMEngine as its authors run it: the engine core in its own process.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_DISABLED="true",
        PYTHONUNBUFFERED="1",
        PYTHONIOENCODING="utf-8",
    )  # its step line starts with an emoji
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # else FlashInfer JIT-compiles its sampler for minutes
    return env


# ---- OpenRLHF's log ------------------------------------------------------------------------------------------------


def parse_status(text: str) -> dict[str, float]:
    """The numbers of one step's status dict as OpenRLHF logs it (a Python dict repr; a regex when not literal)."""
    try:
        raw = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {k: float(v) for k, v in NUMBER_ITEM.findall(text)}
    return {k: float(v) for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def parse_log(lines) -> list[dict]:
    """Every ``Global step`` line of a log: ``[{"step": n, "status": {...}, "t": arrival time or None}]``.

    ``lines`` holds strings or ``(arrival_time, string)`` pairs; Ray's ``(PPOTrainer pid=...)`` prefix is fine.
    """
    steps = []
    for item in lines:
        t, line = item if isinstance(item, tuple) else (None, item)
        m = STEP_LINE.search(line)
        if m:
            steps.append({"step": int(m.group(1)), "status": parse_status(m.group(2)), "t": t})
    return steps


def summarize(steps: list[dict], warmup: int) -> dict:
    """``step_s``: the median step on the one clock (bench/_common.py: wall time between step ends, here the step
    lines' arrival times, ``warmup`` steps dropped), None with fewer than ``MIN_MEASURED_STEPS`` measured steps or
    an arrival time missing; ``step_s_inside``: OpenRLHF's own ``timing/step_total``; the phases' medians after
    ``warmup`` steps (all steps if there are no more than that)."""
    out = summarize_steps(
        steps,
        warmup,
        step="timing/step_total",
        phase="timing/{}",
        phases=PHASES,
        response_len="rollout/response_length_mean",
        reward="rollout/reward_mean",
    )
    out["step_s_inside"] = out.pop("step_s")
    ends = [s["t"] for s in steps]
    steady = steady_step_times(ends, warmup) if None not in ends and len(ends) > warmup else []
    out.update(
        step_ends=ends if None not in ends else None,
        steady_step_s=steady,
        steady_steps=len(steady),
        step_s=statistics.median(steady) if len(steady) >= MIN_MEASURED_STEPS else None,
    )
    return out


# ---- running it ----------------------------------------------------------------------------------------------------


def run(cmd: list[str], env: dict, log_path: str, timeout: float, expected_steps: int, grace: float) -> dict:
    """Run OpenRLHF in its own process group, teeing its output to ``log_path`` with arrival times of the step lines.

    Once every expected step is logged it gets ``grace`` seconds to save and exit; after that (or at ``timeout``)
    the whole group is stopped: the timing is already in the log.
    """
    return run_peer(
        cmd,
        env,
        log_path,
        timeout=timeout,
        expected_steps=expected_steps,
        grace=grace,
        count_steps=lambda lines: len(parse_log(lines)),
        echo=("Global step", "Error", "Traceback"),
    )


PARSE_CHECK = r"""
import json, runpy, sys
import ray
import openrlhf.utils


class Parsed(Exception):
    pass


def stop(args):  # train() asks for its strategy first: stop there, before anything starts
    raise Parsed(args)


ray.is_initialized = lambda: True  # train() would start Ray before that
openrlhf.utils.get_strategy = stop
sys.argv = ["train_ppo_ray", *sys.argv[1:]]
try:
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
except Parsed as p:
    tree = lambda x: {k: tree(v) for k, v in vars(x).items()} if hasattr(x, "__dict__") else x  # noqa: E731
    print("PARSED " + json.dumps(tree(p.args[0]), sort_keys=True, default=str))
else:
    raise SystemExit("train_ppo_ray returned without reaching train()")
"""


def check(cmd: list[str], env: dict) -> dict:
    """Run OpenRLHF's own parser and its post-parse checks on ``cmd`` (imports everything it imports; no Ray, no
    GPU): ``{"ok": bool, "args": the hierarchized namespace, "error": ...}``."""
    proc = subprocess.run(
        [sys.executable, "-c", PARSE_CHECK, *cmd[3:]], env=env, capture_output=True, text=True, timeout=600
    )
    for line in proc.stdout.splitlines():
        if line.startswith("PARSED "):
            return {"ok": True, "args": json.loads(line[len("PARSED ") :])}
    out = (proc.stdout + proc.stderr).splitlines()
    return {"ok": False, "rc": proc.returncode, **failure(out, keep=40)}


# ---- the comparison rows -------------------------------------------------------------------------------------------

#: our flags that change how the step runs, named in the speedup row when our run used them (OpenRLHF's own packing
#: needs flash-attn, which the device machine does not have)
OUR_EXTRA_FLAGS = ("--packing_samples", "--use_dynamic_batch", "--async_train", "--partial_rollout")


def compare(orl: dict, ours: dict) -> tuple[list, list[str]]:
    """Rows for bench/RESULTS.md from one OpenRLHF JSON and our e2e JSON of the same call; speedups only when both
    runs completed, and only for OpenRLHF asleep: the no-sleep ratio is a figure of the fair protocol, the median of
    >= 3 same-call ratios that bench/peer_ratio.py makes, never one call's. Returns ``(rows, problems)``."""
    from _common import Row

    problems = []
    orl_ok = orl.get("step_s") is not None and not orl.get("error")
    ours_ok = ours.get("rc") == 0 and ours.get("step_s") is not None
    if not orl_ok:
        problems.append(f"OpenRLHF run did not complete: {orl.get('error') or 'no step timings'}")
    if not ours_ok:
        problems.append(f"our run did not complete (rc {ours.get('rc')}, step {ours.get('step_s')})")
    size, setup = orl.get("size", "357m"), orl.get("setup", "matched")
    sfx = "" if size == "357m" else f" {size.upper()}"
    sfx += "" if setup == "matched" else f" {setup}"
    asleep = orl.get("sleep", True)  # JSONs from before --no_sleep: always asleep
    sfx += "" if asleep else " nosleep"
    what = (
        f"{size}, {WORKLOADS[size][0]} x {WORKLOADS[size][1]}, <= {WORKLOADS[size][2]} new tokens, "
        f"{'ZeRO-1, no reference' if setup == 'matched' else 'ZeRO-3 + reference'}, colocated "
        + ("with sleep" if asleep else "without sleep (all resident)")
        + (f"; partial: {orl['partial']}" if orl.get("partial") else "")
    )
    inside = orl.get("step_s_inside")
    rows = []
    if orl_ok:
        ph = orl["phases_s"]
        rows += [
            Row(
                f"OpenRLHF grpo step{sfx} s",
                orl["step_s"],
                f"s (OpenRLHF 0.11.2, wall time between step ends, median of {orl.get('steady_steps', '?')} "
                f"after {orl['warmup']} warm-up"
                + (f"; its timing/step_total {inside:.3f} s" if inside is not None else "")
                + f"; {what})",
            ),
            Row(
                f"OpenRLHF weight sync{sfx} s",
                ph["broadcast"],
                "s (timing/broadcast: "
                + ("vLLM weights woken + " if asleep else "")
                + "parameters sent one by one over CUDA IPC"
                + (f"; ours {ours['phases_s']['sync']:.3f} s same call)" if ours_ok else ")"),
            ),
            Row(
                f"OpenRLHF generation{sfx} s",
                ph["generation"],
                f"s (timing/generation: {'wake + rollout + sleep' if asleep else 'rollout'})",
            ),
            Row(
                f"OpenRLHF make_experience{sfx} s",
                ph["make_experience"],
                "s (timing/make_experience: rewards, old/reference log-probs)",
            ),
            Row(
                f"OpenRLHF ppo_train{sfx} s",
                ph["ppo_train"],
                "s (timing/ppo_train: "
                + ("DeepSpeed reload + actor update + offload" if asleep else "actor update")
                + ")",
            ),
        ]
    if orl_ok and ours_ok and not asleep:
        problems.append(
            "OpenRLHF ran without sleep: its ratio is the protocol's median of >= 3 same-call ratios "
            "(bench/peer_ratio.py --openrlhf), not made from one call here"
        )
    elif orl_ok and ours_ok:
        name = "speedup vs OpenRLHF x" if size == "357m" else f"speedup vs OpenRLHF {size.upper()} x"
        if setup != "matched":
            name = name[:-2] + f" {setup} x"
        extra = [f for f in OUR_EXTRA_FLAGS if f in ours.get("command", "").split()]
        rows.append(
            Row(
                name,
                orl["step_s"] / ours["step_s"],
                f"x (OpenRLHF {orl['step_s']:.3f} s / ours {ours['step_s']:.3f} s, same call, same model "
                f"folder"
                + (f"; ours with {' '.join(extra)}" if extra else "")
                + f"; ours median of {ours.get('steady_steps', '?')} step(s) after warm-up; goal 1.5)",
            )
        )
        if ours["phases_s"].get("sync"):
            rows.append(
                Row(
                    f"weight sync speedup vs OpenRLHF{sfx} x",
                    ph["broadcast"] / ours["phases_s"]["sync"],
                    f"x (OpenRLHF {ph['broadcast']:.3f} s / ours {ours['phases_s']['sync']:.3f} s)",
                )
            )
    return rows, problems


def compare_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="openrlhf_peer.py compare")
    ap.add_argument("--openrlhf", required=True, help="JSON written by this script's run")
    ap.add_argument("--ours", required=True, help="bench/e2e_gpu.py's JSON of the same call")
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    ap.add_argument("--device", default=None, help="device label (default: the OpenRLHF JSON's)")
    a = ap.parse_args(argv)
    orl = json.load(open(a.openrlhf))
    ours = json.load(open(a.ours)) if os.path.exists(a.ours) else {"rc": None}
    rows, problems = compare(orl, ours)
    from _common import append_results, measured_code, print_table

    for p in problems:
        print("NOTE:", p)
    if rows:
        print_table(f"OpenRLHF 0.11.2 vs hybrid ({orl.get('size')}, {orl.get('setup')})", rows)
    if a.record and rows:
        device = a.device or orl.get("device") or "unknown device"
        print(f"appended {append_results(rows, device, code=measured_code(ours))} rows to bench/RESULTS.md")
    return 0 if not problems else 3


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        return compare_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(WORKLOADS), default="357m")
    ap.add_argument("--setup", choices=["matched", "zero3ref"], default="matched")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--micro",
        type=int,
        default=None,
        help="train micro-batch (default: 64 at 357m, 32 with zero3ref, 8 at 1.5b: as our runs)",
    )
    ap.add_argument("--zero_stage", type=int, default=None, help="override the set-up's ZeRO stage")
    ap.add_argument("--gpu_util", type=float, default=None, help="vLLM memory fraction (0.35 at 357m, 0.3 at 1.5b)")
    ap.add_argument("--ckpt", action="store_true", default=None, help="gradient checkpointing (always at 1.5b)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument(
        "--no_sleep",
        action="store_true",
        help="without --vllm.enable_sleep --ds.enable_sleep (OpenRLHF's default): all stays resident",
    )
    ap.add_argument("--enforce_eager", action="store_true")
    ap.add_argument("--workdir", default=None, help="default /tmp/peer (357m) or /tmp/peer-<size>: e2e_gpu.py's")
    ap.add_argument("--site", default=DEFAULT_SITE, help="where OpenRLHF and its carried packages are installed")
    ap.add_argument("--timeout", type=float, default=540, help="seconds before the run is stopped")
    ap.add_argument("--grace", type=float, default=60, help="seconds after the last step for the final save")
    ap.add_argument("--dry", action="store_true", help="print the command only")
    ap.add_argument("--check", action="store_true", help="only pass the command through OpenRLHF's parser")
    ap.add_argument("extra", nargs="*", help="more OpenRLHF flags, after --")
    args = ap.parse_args()
    if args.warmup < 1:
        ap.error("--warmup must be >= 1: the first step has no start on the step-end clock (bench/_common.py)")
    micro, ckpt, util = DEFAULTS[args.size]
    if args.setup == "zero3ref":
        micro = 32  # e2e_gpu.py's default --micro, which its ZeRO-3 + reference run (zero3ref) uses
    args.micro = args.micro or micro
    args.ckpt = ckpt if args.ckpt is None else args.ckpt
    args.gpu_util = args.gpu_util or util
    args.workdir = args.workdir or ("/tmp/peer" if args.size == "357m" else f"/tmp/peer-{args.size}")

    from peer_workload import build

    if args.dry or args.check:  # the parser does not open them: no need to build a model for that
        model, data = os.path.join(args.workdir, "model"), os.path.join(args.workdir, "prompts.jsonl")
    else:
        model, data = build(args.workdir, size=args.size)
    cmd = command(args, model, data)
    env = environment(args.site)
    print("command:", shlex.join(cmd), flush=True)
    print("PYTHONPATH:", env["PYTHONPATH"], flush=True)
    tag = f"openrlhf-{args.size}-{args.setup}{'-nosleep' if args.no_sleep else ''}"
    out_dir = os.environ.get("OUT")
    if args.dry:
        return 0
    if args.check:
        res = check(cmd, env)
        if res["ok"]:
            a = res["args"]
            keys = (
                "algo.advantage.estimator",
                "algo.kl.init_coef",
                "ds.zero_stage",
                "ds.attn_implementation",
                "ds.packing_samples",
                "ds.enable_sleep",
                "vllm.enable_sleep",
                "train.colocate_all",
                "train.micro_batch_size",
                "rollout.micro_batch_size",
                "actor.gradient_checkpointing_enable",
                "reward.remote_url",
            )
            picked = {}
            for key in keys:
                node = a
                for part in key.split("."):
                    node = node.get(part, {}) if isinstance(node, dict) else {}
                picked[key] = node
            print("OpenRLHF's parser and its checks accepted the command:", json.dumps(picked, default=str))
        else:
            print("OpenRLHF refused the command or failed to import:")
            print("\n".join(res["traceback"] or res["log_tail"]))
        return 0 if res["ok"] else 2

    log_path = os.path.join(args.workdir, f"{tag}.log")
    result = {
        "tag": tag,
        "size": args.size,
        "setup": args.setup,
        "warmup": args.warmup,
        "sleep": not args.no_sleep,
        "command": shlex.join(cmd),
        "openrlhf": installed_version("openrlhf", env),
        "device": gpu_name(),
    }
    r = run(cmd, env, log_path, args.timeout, args.steps, args.grace)
    result.update(rc=r["rc"], stopped=r["stopped"], wall_s=r["wall_s"], log=log_path)
    steps = parse_log(r["lines"])
    text = [line for _, line in r["lines"]]
    if len(steps) >= args.steps or (r["stopped"] == "timeout" and len(steps) > args.warmup):
        if len(steps) < args.steps:  # out of time: what ran is still a measurement, marked as partial
            result["partial"] = f"{len(steps)} of {args.steps} steps before the {args.timeout:.0f} s limit"
            print(f"\n{tag}: PARTIAL, {result['partial']}")
        result.update(summarize(steps, args.warmup))
    if result.get("step_s") is not None:
        prompts, samples = WORKLOADS[args.size][:2]
        result["tokens_per_s"] = prompts * samples * result["response_len"] / result["step_s"]
        print(
            f"\n{tag}: {result['steps']} steps, median step {result['step_s']:.3f} s (wall time between step ends, "
            f"{result['steady_steps']} after {args.warmup} warm-up; OpenRLHF's timing/step_total "
            f"{result['step_s_inside']:.3f} s), {result['tokens_per_s']:.0f} generated tokens/s, mean response "
            f"{result['response_len']:.0f} tokens"
        )
        print(f"{'phase':<16} {'s (median)':>10}")
        for p, v in result["phases_s"].items():
            print(f"{p:<16} {v:>10.3f}")
        print("reward per step:", " ".join(f"{x:.3f}" for x in result["rewards"] if x is not None))
        if r["rc"] not in (0, None) and r["stopped"] is None:
            result["note"] = f"exited {r['rc']} after the last step (the final save?): " + " | ".join(
                failure(text)["error_lines"]
            )
    elif "step_s" in result:  # it ran, but too few steps for the one clock: no figure, and what to change
        measured = result["steady_steps"]
        result["error"] = (
            f"{measured} measured step(s) after {args.warmup} warm-up: a figure needs >= "
            f"{MIN_MEASURED_STEPS} (run --steps >= {args.warmup + MIN_MEASURED_STEPS}"
            + (", or give it a longer --timeout)" if result.get("partial") else ")")
        )
        print(f"\n{tag}: FAILED: {result['error']}")
    else:
        result["steps"] = len(steps)
        result.update(failure(text))
        result["error"] = (
            result["error_lines"][-1]
            if result["error_lines"]
            else f"rc {r['rc']}, stopped {r['stopped']}, {len(steps)} of {args.steps} steps logged"
        )
        print(f"\n{tag}: FAILED after {len(steps)} of {args.steps} steps (rc {r['rc']}, stopped {r['stopped']})")
        print("---- last traceback ----")
        print("\n".join(result["traceback"]) or "(none in the log)")
        print("---- log tail ----")
        print("\n".join(result["log_tail"]))
    if out_dir:
        with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if "error" not in result else 3


if __name__ == "__main__":
    raise SystemExit(main())
