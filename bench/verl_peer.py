"""Peer: verl 0.9.1 itself (``python -m verl.trainer.main_ppo``) on the workloads `bench/e2e_gpu.py` runs.

Same model folder and prompts (bench/peer_workload.py), same reward (``copy_first``, through verl's custom reward
function hook: bench/verl_reward.py), everything on one GPU in verl's hybrid engine: the FSDP actor and the vLLM
rollout server colocated, vLLM sleeping while the actor trains and woken for the weight update (verl's defaults:
``hybrid_engine``, ``rollout.free_cache_engine``, the ``naive`` checkpoint engine; no parameter / optimizer offload).
No flash-attn exists for the GPU image's torch: the runs ask for ``attn_implementation=sdpa`` and
``use_remove_padding=False`` (verl's padding helpers fall back to torch when flash_attn is missing).

verl 0.9.1's trainer is its V1 trainer (``trainer.use_v1=true``, its default: TransferQueue between the stages, the
``sync`` mode for colocated rollout); ``--legacy`` runs the deprecated ``main_ppo_v0`` task runner instead.

Prompts: verl's RLHFDataset hands each row's ``prompt`` (chat messages) to its agent loop, which renders it with the
tokenizer's chat template. Our word-level tokenizer has none, so the runs give verl a template that emits the user
message verbatim (``actor_rollout_ref.model.custom_chat_template``): the prompt tokens are exactly ours.

Set-ups (``--setup``), each the counterpart of one of our runs:
* ``matched`` -- ours ``--kl 0 --zero_stage 1 --micro 64``: no reference model, no KL.
* ``lowvar`` -- ours default (reference + KL 0.001): verl's GRPO recipe, a reference model and the low-variance KL
  loss (``actor.use_kl_loss``, ``kl_loss_coef 0.001``, ``kl_loss_type low_var_kl``).

    python bench/verl_peer.py --size 357m --setup matched --steps 10 --warmup 2   # runs it, table + JSON
    python bench/verl_peer.py --dry          # writes verl's data, prints the command, composes verl's config
    python bench/verl_peer.py compare --verl A.json --ours B.json [--record]      # the rows

Timing comes from verl's own per-step metrics (its ``console`` logger line ``step:N - key:value - ...`` and the same
dict in its ``file`` logger's JSONL): ``timing_s/step`` (the step time: everything below), ``timing_s/gen`` (rollout
through the agent loop, then vLLM put to sleep), ``timing_s/reward``, ``timing_s/old_log_prob``, ``timing_s/ref``,
``timing_s/adv``, ``timing_s/update_actor`` and ``timing_s/update_weights`` (vLLM woken + the actor's weights sent:
their weight sync). The step is the median after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _peer_process import (  # noqa: E402
    DEFAULTS,
    WORKLOADS,
    failure,
    gpu_name,
    installed_version,
    run_peer,
    summarize_steps,
)

REWARD_FILE = os.path.join(HERE, "verl_reward.py")
#: where bench/sessions/verl_session.sh installs verl and what it carries (its own target, beside /tmp/site)
DEFAULT_SITE = "/tmp/site-verl"
RELEASE = "0.9.1"
SETUPS = ("matched", "lowvar")
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights")
#: renders the chat messages' contents verbatim: the prompt's tokens are exactly the row's text, nothing added
CHAT_TEMPLATE = "{% for message in messages %}{{ message.content }}{% endfor %}"
DATA_SOURCE = "peer_copy_first"
STEP_LINE = re.compile(r"(?:^|[\s)])step:(\d+) - (.*)$")
NP_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")


# ---- the data -------------------------------------------------------------------------------------------------------


def rows(prompts: list[str]) -> list[dict]:
    """verl RL-dataset rows for our prompts: chat messages under ``prompt``, the reward's inputs beside them."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p}],
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": p.split()[0]},
            "extra_info": {"index": i, "prompt": p},
        }
        for i, p in enumerate(prompts)
    ]


def write_data(prompts_jsonl: str, out_dir: str, count: int) -> str:
    """The first ``count`` prompts of our workload as verl's parquet file; returns its path."""
    import pandas as pd

    prompts = [json.loads(line)["prompt"] for line in open(prompts_jsonl)]
    if len(prompts) < count:
        raise SystemExit(
            f"{prompts_jsonl} holds {len(prompts)} prompts, the run needs {count}: fewer --steps, or "
            f"rebuild it (bench/peer_workload.py)"
        )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"train-{count}.parquet")
    pd.DataFrame(rows(prompts[:count])).to_parquet(path, index=False)
    return path


# ---- the command ----------------------------------------------------------------------------------------------------


def overrides(args, model: str, data: str) -> list[str]:
    """verl 0.9.1's Hydra overrides for one run (see the module docstring for what each set-up means)."""
    prompts, samples, max_new, prompt_len, micro_rollout = WORKLOADS[args.size]
    per_step = prompts * samples
    micro = min(args.micro, per_step)
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    out = [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        "algorithm.use_kl_in_reward=false",
        # the data: our prompts in order, exactly `steps` steps of `prompts` prompts
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={prompts}",
        f"data.train_max_samples={args.steps * prompts}",
        f"data.val_max_samples={prompts}",
        f"data.max_prompt_length={prompt_len}",
        f"data.max_response_length={max_new}",
        "data.shuffle=false",
        "data.filter_overlong_prompts=false",
        "data.truncation=error",
        "data.seed=0",
        # the model: our folder, sdpa (no flash-attn on the device), padded batches, our prompt tokens verbatim
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(args.ckpt).lower()}",
        f"actor_rollout_ref.model.custom_chat_template='{CHAT_TEMPLATE}'",
        # the actor: one optimizer step of all `per_step` samples per step, in micro-batches of `micro`
        f"{a}.strategy=fsdp",
        f"{a}.optim.lr={args.lr}",
        f"{a}.ppo_mini_batch_size={prompts}",
        f"{a}.ppo_micro_batch_size_per_gpu={micro}",
        f"{a}.ppo_epochs=1",
        f"{a}.use_dynamic_bsz=false",
        f"{a}.entropy_coeff=0",
        # the rollout: vLLM in verl's hybrid engine, `samples` per prompt, sampling as ours (temperature 1, top-p 1)
        f"{r}.name=vllm",
        f"{r}.n={samples}",
        f"{r}.tensor_model_parallel_size=1",
        f"{r}.gpu_memory_utilization={args.gpu_util}",
        f"{r}.temperature=1.0",
        f"{r}.top_p=1.0",
        f"{r}.top_k=-1",
        f"{r}.log_prob_micro_batch_size_per_gpu={micro_rollout}",
        f"{r}.enforce_eager={str(args.enforce_eager).lower()}",
        f"{r}.seed=0",
        "actor_rollout_ref.hybrid_engine=true",
        # one GPU, no validation, no checkpoint: only the training steps
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=hybrid_peer",
        f"trainer.experiment_name=verl-{args.size}-{args.setup}",
        f"trainer.default_local_dir={os.path.join(args.workdir, 'verl-ckpt')}",
        f"trainer.use_v1={'false' if args.legacy else 'true'}",
        # the reward: copy_first through verl's custom reward function hook
        f"reward.custom_reward_function.path={REWARD_FILE}",
        "reward.custom_reward_function.name=compute_score",
        f"hydra.run.dir={os.path.join(args.workdir, 'verl-hydra')}",
    ]
    if args.setup == "lowvar":  # verl's GRPO recipe: reference model, low-variance KL as a loss term
        out += [
            f"{a}.use_kl_loss=true",
            f"{a}.kl_loss_coef=0.001",
            f"{a}.kl_loss_type=low_var_kl",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_rollout}",
        ]
    else:
        out += [f"{a}.use_kl_loss=false"]
    return out + list(args.extra)


def command(args, model: str, data: str) -> list[str]:
    return [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(args, model, data)]


def without_trl(entry: str) -> str:
    """``entry`` itself, or where it holds a ``trl`` package, a view of it without trl (a folder of links beside it).

    verl 0.9.1 patches trl's value-head model whenever trl is importable (``models/transformers/monkey_patch.py``),
    and the trl the TRL peer carries (1.16) has none: verl's workers died at start-up with an ImportError on the GPU
    (2026-11-24). verl does not need trl for GRPO, so its processes do not see it."""
    if not os.path.isfile(os.path.join(entry, "trl", "__init__.py")):
        return entry
    view = entry.rstrip(os.sep) + "-without-trl"
    os.makedirs(view, exist_ok=True)
    for name in os.listdir(entry):
        link = os.path.join(view, name)
        hidden = name == "trl" or (name.startswith("trl-") and name.endswith(".dist-info"))
        if hidden or os.path.lexists(link):
            continue
        os.symlink(os.path.join(entry, name), link)
    return view


def environment(site: str, metrics_path: str | None = None) -> dict:
    """The run's environment: verl's packages first, then what the session already set (trl hidden: see
    :func:`without_trl`)."""
    env = dict(os.environ)
    rest = [without_trl(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([site, *rest] if site else rest)
    # verl drives vLLM's AsyncLLM as its authors run it: the engine core in its own process.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        PYTHONIOENCODING="utf-8",
        RAY_DEDUP_LOGS="0",
    )
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # else FlashInfer JIT-compiles its sampler for minutes
    if metrics_path:
        env["VERL_FILE_LOGGER_PATH"] = metrics_path  # verl's `file` logger: one JSON line of metrics per step
    return env


# ---- verl's log ----------------------------------------------------------------------------------------------------


def _number(text: str) -> float | None:
    text = text.strip()
    m = NP_SCALAR.match(text)  # numpy 2 scalars print as np.float64(0.5)
    if m:
        text = m.group(1)
    try:
        return float(text)
    except ValueError:
        return None


def parse_metrics_line(text: str) -> dict[str, float]:
    """``key:value - key:value ...`` as verl's console logger prints a step's metrics (numbers only)."""
    out = {}
    for item in text.split(" - "):
        key, sep, value = item.partition(":")
        v = _number(value) if sep else None
        if v is not None:
            out[key.strip()] = v
    return out


def parse_log(lines) -> list[dict]:
    """Every training-step line of a log: ``[{"step": n, "status": {...}, "t": arrival time or None}]``.

    ``lines`` holds strings or ``(arrival_time, string)`` pairs; Ray's ``(TaskRunner pid=...)`` prefix is fine.
    Only lines that carry ``timing_s/step`` count (validation prints the same format without it).
    """
    steps = []
    for item in lines:
        t, line = item if isinstance(item, tuple) else (None, item)
        m = STEP_LINE.search(line)
        if m:
            status = parse_metrics_line(m.group(2))
            if "timing_s/step" in status:
                steps.append({"step": int(m.group(1)), "status": status, "t": t})
    return steps


def parse_metrics_file(path: str) -> list[dict]:
    """verl's ``file`` logger JSONL (``{"step": n, "data": {...}}`` per line), training steps only."""
    steps = []
    if not path or not os.path.exists(path):
        return steps
    for line in open(path):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the stop
        data = {
            k: float(v)
            for k, v in rec.get("data", {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if "timing_s/step" in data:
            steps.append({"step": int(rec["step"]), "status": data, "t": None})
    return steps


def summarize(steps: list[dict], warmup: int) -> dict:
    """Median per-step times after ``warmup`` steps (all steps if there are no more than that)."""
    return summarize_steps(
        steps,
        warmup,
        step="timing_s/step",
        phase="timing_s/{}",
        phases=PHASES,
        response_len="response_length/mean",
        reward="critic/score/mean",
    )


# ---- running it ----------------------------------------------------------------------------------------------------


def run(cmd: list[str], env: dict, log_path: str, timeout: float, expected_steps: int, grace: float) -> dict:
    """Run verl in its own process group, teeing its output to ``log_path`` with arrival times of the step lines.

    Once every expected step is logged it gets ``grace`` seconds to exit; after that (or at ``timeout``) the whole
    group is stopped: the timing is already in the log.
    """
    return run_peer(
        cmd,
        env,
        log_path,
        timeout=timeout,
        expected_steps=expected_steps,
        grace=grace,
        count_steps=lambda lines: len(parse_log(lines)),
        echo=("timing_s/step", "Error", "Traceback"),
        echo_width=400,
    )


COMPOSE_CHECK = r"""
import json, os, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
import verl.trainer.main_ppo  # what `python -m verl.trainer.main_ppo` imports before it parses
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

config_dir = os.path.join(os.path.dirname(verl.trainer.main_ppo.__file__), "config")
overrides = [o for o in sys.argv[1:] if not o.startswith("hydra.")]  # hydra.* belong to the launcher, not the job
with initialize_config_dir(config_dir=config_dir, version_base=None):
    cfg = compose(config_name="ppo_trainer", overrides=overrides)
ref, critic = need_reference_policy(cfg), need_critic(cfg)
validate_config(config=cfg, use_reference_policy=ref, use_critic=critic)
OmegaConf.resolve(cfg)
rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
algo = omega_conf_to_dataclass(cfg.algorithm)
keys = ["data.train_batch_size", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.response_length",
        "actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.mode",
        "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.free_cache_engine",
        "actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.checkpoint_engine.backend",
        "actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.use_remove_padding",
        "actor_rollout_ref.model.override_config.attn_implementation", "actor_rollout_ref.model.custom_chat_template",
        "actor_rollout_ref.model.enable_gradient_checkpointing", "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload", "actor_rollout_ref.actor.use_kl_loss",
        "actor_rollout_ref.actor.kl_loss_type", "actor_rollout_ref.actor.kl_loss_coef", "algorithm.adv_estimator",
        "actor_rollout_ref.hybrid_engine", "trainer.use_v1", "trainer.v1.trainer_mode",
        "trainer.total_training_steps", "trainer.n_gpus_per_node", "trainer.logger",
        "reward.custom_reward_function.path", "reward.custom_reward_function.name"]
picked = {k: OmegaConf.select(cfg, k) for k in keys}
# What verl's agent loop sends to vLLM for the first row: its dataset's messages through the model's chat template
# (our custom one), as the rollout renders them; checked against our tokenizer's encoding of the prompt.
tokenizer_model = os.environ.get("VERL_PEER_TOKENIZER_MODEL") or cfg.actor_rollout_ref.model.path
prompt_check = None
if os.path.exists(os.path.join(tokenizer_model, "tokenizer_config.json")):
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    model_cfg = cfg.actor_rollout_ref.model.copy()
    model_cfg.path = tokenizer_model
    model = omega_conf_to_dataclass(model_cfg)
    dataset = RLHFDataset(data_files=cfg.data.train_files, tokenizer=model.tokenizer, config=cfg.data,
                          processor=model.processor, max_samples=cfg.data.train_max_samples)
    row = dataset[0]
    builder = create_continuous_token_builder(model.tokenizer, hf_model_type=model.hf_config.model_type,
                                              processor=model.processor)
    ids = list(builder.build_initial_tokens(list(row["raw_prompt"])))
    ours = model.tokenizer(row["extra_info"]["prompt"], add_special_tokens=False)["input_ids"]
    prompt_check = {"rows": len(dataset), "prompt_tokens": len(ids), "equal_to_ours": ids == ours,
                    "attn_implementation": model.hf_config._attn_implementation}
picked = {k: (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v) for k, v in picked.items()}
print("COMPOSED " + json.dumps({"reference": ref, "critic": critic, "values": picked, "prompt_check": prompt_check},
                              default=str))
"""


def check(cmd: list[str], env: dict) -> dict:
    """Compose verl's own config with the overrides (its ``ppo_trainer`` defaults) and run its ``validate_config``:
    ``{"ok": bool, "values": the settings that matter, "reference": bool, ...}`` (no Ray, no GPU)."""
    proc = subprocess.run(
        [sys.executable, "-c", COMPOSE_CHECK, *cmd[3:]], env=env, capture_output=True, text=True, timeout=600
    )
    for line in proc.stdout.splitlines():
        if line.startswith("COMPOSED "):
            return {"ok": True, **json.loads(line[len("COMPOSED ") :])}
    out = (proc.stdout + proc.stderr).splitlines()
    return {"ok": False, "rc": proc.returncode, **failure(out, keep=40)}


# ---- the comparison rows -------------------------------------------------------------------------------------------


def compare(peer: dict, ours: dict) -> tuple[list, list[str]]:
    """Rows for bench/RESULTS.md from one verl JSON and our e2e JSON of the same call; the speedup only when both
    runs completed. Returns ``(rows, problems)``."""
    from _common import Row

    problems = []
    peer_ok = peer.get("step_s") is not None and not peer.get("error")
    ours_ok = ours.get("rc") == 0 and ours.get("step_s") is not None
    if not peer_ok:
        problems.append(f"verl run did not complete: {peer.get('error') or 'no step timings'}")
    if not ours_ok:
        problems.append(f"our run did not complete (rc {ours.get('rc')}, step {ours.get('step_s')})")
    size, setup = peer.get("size", "357m"), peer.get("setup", "matched")
    sfx = "" if size == "357m" else f" {size.upper()}"
    sfx += "" if setup == "matched" else f" {setup}"
    what = (
        f"{size}, {WORKLOADS[size][0]} x {WORKLOADS[size][1]}, <= {WORKLOADS[size][2]} new tokens, FSDP + vLLM "
        f"colocated with sleep, sdpa, no remove-padding, "
        f"{'no reference' if setup == 'matched' else 'reference + low_var_kl loss 0.001'}"
        + (", legacy trainer" if peer.get("legacy") else "")
        + (f"; partial: {peer['partial']}" if peer.get("partial") else "")
    )
    rows = []
    if peer_ok:
        ph = peer["phases_s"]
        rows += [
            Row(
                f"verl grpo step{sfx} s",
                peer["step_s"],
                f"s (verl {peer.get('verl') or RELEASE} timing_s/step, median after {peer['warmup']} warm-up; {what})",
            ),
            Row(
                f"verl weight sync{sfx} s",
                ph["update_weights"],
                "s (timing_s/update_weights: vLLM woken + actor weights sent"
                + (f"; ours {ours['phases_s']['sync']:.3f} s same call)" if ours_ok else ")"),
            ),
            Row(f"verl gen{sfx} s", ph["gen"], "s (timing_s/gen: rollout through the agent loop + vLLM sleep)"),
            Row(f"verl update_actor{sfx} s", ph["update_actor"], "s (timing_s/update_actor: FSDP update)"),
            Row(
                f"verl old_log_prob{sfx} s",
                ph["old_log_prob"] + ph["ref"],
                "s (timing_s/old_log_prob + timing_s/ref: log-prob passes)",
            ),
        ]
    if peer_ok and ours_ok:
        name = "speedup vs verl x" if size == "357m" else f"speedup vs verl {size.upper()} x"
        if setup != "matched":
            name = name[:-2] + f" {setup} x"
        rows.append(
            Row(
                name,
                peer["step_s"] / ours["step_s"],
                f"x (verl {peer['step_s']:.3f} s / ours {ours['step_s']:.3f} s, same call, same model folder)",
            )
        )
    return rows, problems


def compare_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="verl_peer.py compare")
    ap.add_argument("--verl", required=True, help="JSON written by this script's run")
    ap.add_argument("--ours", required=True, help="bench/e2e_gpu.py's JSON of the same call")
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md")
    ap.add_argument("--device", default=None, help="device label (default: the verl JSON's)")
    a = ap.parse_args(argv)
    peer = json.load(open(a.verl)) if os.path.exists(a.verl) else {"error": f"{a.verl} missing"}
    ours = json.load(open(a.ours)) if os.path.exists(a.ours) else {"rc": None}
    rows, problems = compare(peer, ours)
    from _common import append_results, measured_code, print_table

    for p in problems:
        print("NOTE:", p)
    if rows:
        print_table(f"verl {peer.get('verl') or RELEASE} vs hybrid ({peer.get('size')}, {peer.get('setup')})", rows)
    if a.record and rows:
        device = a.device or peer.get("device") or "unknown device"
        print(f"appended {append_results(rows, device, code=measured_code(ours))} rows to bench/RESULTS.md")
    return 0 if not problems else 3


# ---- main ----------------------------------------------------------------------------------------------------------


def _prompts_for(args) -> str:
    """Our prompts file; for --dry without a built workload, the same prompts from a tiny model's build (prompts do
    not depend on the model's width), so the real model folder is never made with the wrong shape."""
    from peer_workload import build

    data = os.path.join(args.workdir, "prompts.jsonl")
    if os.path.exists(data):
        return data
    scratch = os.path.join(args.workdir, "verl-dry-workload")
    return build(scratch, size=args.size, layers=1, hidden=112)[1]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        return compare_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(WORKLOADS), default="357m")
    ap.add_argument("--setup", choices=SETUPS, default="matched")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=None, help="train micro-batch (default: 64 at 357m, 8 at 1.5b)")
    ap.add_argument("--gpu_util", type=float, default=None, help="vLLM memory fraction (0.35 at 357m, 0.3 at 1.5b)")
    ap.add_argument("--ckpt", action="store_true", default=None, help="gradient checkpointing (always at 1.5b)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--enforce_eager", action="store_true")
    ap.add_argument(
        "--legacy", action="store_true", help="verl's deprecated main_ppo_v0 trainer (trainer.use_v1=false)"
    )
    ap.add_argument("--workdir", default=None, help="default /tmp/peer (357m) or /tmp/peer-<size>: e2e_gpu.py's")
    ap.add_argument("--site", default=DEFAULT_SITE, help="where verl and its carried packages are installed")
    ap.add_argument("--timeout", type=float, default=540, help="seconds before the run is stopped")
    ap.add_argument("--grace", type=float, default=20, help="seconds after the last step before it is stopped")
    ap.add_argument("--dry", action="store_true", help="write the data, print the command, compose verl's config")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides, after --")
    args = ap.parse_args()
    micro, ckpt, util = DEFAULTS[args.size]
    args.micro = args.micro or micro
    args.ckpt = ckpt if args.ckpt is None else args.ckpt
    args.gpu_util = args.gpu_util or util
    args.workdir = args.workdir or ("/tmp/peer" if args.size == "357m" else f"/tmp/peer-{args.size}")
    prompts = WORKLOADS[args.size][0]

    if args.dry:
        model, prompts_jsonl = os.path.join(args.workdir, "model"), _prompts_for(args)
    else:
        from peer_workload import build

        model, prompts_jsonl = build(args.workdir, size=args.size)
    data = write_data(prompts_jsonl, os.path.join(args.workdir, "verl-data"), args.steps * prompts)
    tag = f"verl-{args.size}-{args.setup}"
    metrics_path = os.path.join(args.workdir, f"{tag}.metrics.jsonl")
    cmd = command(args, model, data)
    env = environment(args.site, metrics_path)
    print("command:", shlex.join(cmd), flush=True)
    print("PYTHONPATH:", env["PYTHONPATH"], flush=True)
    print("data:", data, flush=True)
    out_dir = os.environ.get("OUT")
    if args.dry:
        if not os.path.exists(os.path.join(model, "tokenizer_config.json")):  # the same tokenizer, in the scratch build
            env["VERL_PEER_TOKENIZER_MODEL"] = os.path.join(os.path.dirname(prompts_jsonl), "model")
        res = check(cmd, env)
        if res["ok"]:
            print(
                f"verl composed and validated the config (reference model: {res['reference']}):",
                json.dumps(res["values"], default=str),
            )
            pc = res.get("prompt_check")
            print("prompt as verl's agent loop renders it:", json.dumps(pc) if pc else "not checked (no tokenizer)")
            if pc and not pc["equal_to_ours"]:
                print("the rendered prompt differs from our tokenization: the chat template adds tokens")
                return 2
        else:
            print("verl's config refused the overrides, or verl failed to import:")
            print("\n".join(res["traceback"] or res["log_tail"]))
        return 0 if res["ok"] else 2

    log_path = os.path.join(args.workdir, f"{tag}.log")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)  # this call's run only
    result = {
        "tag": tag,
        "size": args.size,
        "setup": args.setup,
        "warmup": args.warmup,
        "legacy": args.legacy,
        "command": shlex.join(cmd),
        "verl": installed_version("verl", env),
        "device": gpu_name(),
    }
    r = run(cmd, env, log_path, args.timeout, args.steps, args.grace)
    result.update(rc=r["rc"], stopped=r["stopped"], wall_s=r["wall_s"], log=log_path)
    steps, result["metrics_source"] = parse_log(r["lines"]), "console"
    from_file = parse_metrics_file(metrics_path)
    if len(from_file) > len(steps):  # the file logger's JSONL is complete even when Ray drops a forwarded line
        steps, result["metrics_source"] = from_file, "file"
    text = [line for _, line in r["lines"]]
    if len(steps) >= args.steps or (r["stopped"] == "timeout" and len(steps) > args.warmup):
        if len(steps) < args.steps:
            result["partial"] = f"{len(steps)} of {args.steps} steps before the {args.timeout:.0f} s limit"
            print(f"\n{tag}: PARTIAL, {result['partial']}")
        result.update(summarize(steps, args.warmup))
        samples = WORKLOADS[args.size][1]
        result["tokens_per_s"] = prompts * samples * result["response_len"] / result["step_s"]
        print(
            f"\n{tag}: {result['steps']} steps, median step {result['step_s']:.3f} s (timing_s/step, after "
            f"{args.warmup} warm-up; wall between step lines {result.get('wall_step_s', float('nan')):.3f} s), "
            f"{result['tokens_per_s']:.0f} generated tokens/s, mean response {result['response_len']:.0f} tokens"
        )
        print(f"{'phase':<16} {'s (median)':>10}")
        for p, v in result["phases_s"].items():
            print(f"{p:<16} {v:>10.3f}")
        print("reward per step:", " ".join(f"{x:.3f}" for x in result["rewards"] if x is not None))
        if r["rc"] not in (0, None) and r["stopped"] is None:
            result["note"] = f"exited {r['rc']} after the last step: " + " | ".join(failure(text)["error_lines"])
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
        print("\n".join(line[:600] for line in result["log_tail"]))
    if out_dir:
        with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if "error" not in result else 3


if __name__ == "__main__":
    raise SystemExit(main())
