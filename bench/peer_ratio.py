"""The fair protocol of issue 34 (section 5): ours against each peer at its default and at its best documented
setting for the workload, on one clock, in alternating turns within one call; the ratio rows of bench/RESULTS.md.

    python bench/peer_ratio.py --workload 357m-matched --record             # ours | TRL default | TRL sleep, 3 turns
    python bench/peer_ratio.py --workload 357m-zero3ref --peers trl-default --record
    python bench/peer_ratio.py --workload 1.5b --peers trl-default --record
    python bench/peer_ratio.py --workload 1.5b --peers openrlhf-nosleep --record
    python bench/peer_ratio.py --workload 357m-matched --openrlhf --dry      # every turn's commands, nothing run
    python bench/peer_ratio.py report /tmp/peer_ratio/1.5b/peer_ratio-1.5b.json --record   # rows from a run's JSON

* Sides: ours (bench/e2e_gpu.py); TRL at its default, without sleep, and with ``vllm_enable_sleep_mode``
  (bench/trl_grpo_peer.py [--sleep]); with ``--openrlhf``, OpenRLHF without and with ``--vllm.enable_sleep
  --ds.enable_sleep`` (bench/openrlhf_peer.py [--no_sleep]); ``verl`` at its GRPO recipe (bench/verl_peer.py, its
  ``--setup`` of the workload; timed on the arrival of its step lines, as OpenRLHF's).
* Issue 38's four-GPU workloads (``G7``: GRPO 7B, ``P8`` / ``P8-tp2``: PPO 8B; bench/peers.py runs them with every
  installed peer): ours with ``--gpus 4``, TRL through ``accelerate launch --num_processes 4``, OpenRLHF and verl
  with their multi-GPU flags after ``--`` (the sizes are in bench/_peer_process.py's shapes); a peer that cannot
  express a workload is refused with why (``Workload.not_run``). Where a peer has two settings, a row ``speedup vs
  <peer> <workload> x`` also takes its faster setting of each turn. Each runs as a subprocess of its own (its own
  process group, stopped with everything it started, then the GPU's memory waited for), on the workload's model
  folder and batch shape (``--workload``: the e2e_gpu.py flags it implies, and the peers' counterparts).
* One clock (bench/_common.py): wall time between step ends, the same ``--warmup`` steps dropped on every side,
  >= 5 measured steps; ours read off metrics.jsonl's ``wall_time``, so a step holds everything it cost (callbacks,
  metrics, the plan's refinement, checkpoints).
* Turns: ``--turns`` (default 3) in this one process, the sides in an order that alternates from turn to turn
  (ABC, CBA, ABC, ...) so that a machine drifting during the call favours no side.
* A turn's ratio = the peer's median step / ours, both of that turn. A row = the median of >= 3 turns' ratios, with
  their min-max and both sides' medians in its unit column.
* A side that fails (out of memory without sleep, fewer than 5 measured steps, a crash, ``--run_timeout``) is kept
  as failed with its error, and the turn gives that peer no ratio: nothing is replaced or retried. A peer that failed
  and is left with fewer than 3 ratios gets the row ``failed`` (the fact, recorded); too few turns without a failure
  (or our side failing) give a printed row that is not recorded. Exit status 0 only when every row is a figure.

The JSON of the run (``--out``, written after every side) holds each side's command, log, steady step times and
error; ``report`` makes the rows from it again (on this machine, after a run on a lent one). ``--script
PROGRAM=PATH`` runs a stand-in that takes the same arguments in place of ours / trl / openrlhf (the CPU check of
this orchestration, tests/bench/test_peer_ratio.py: TRL and OpenRLHF with vLLM cannot run without a GPU); rows of
such a run, of ``--small`` or of another backend than vLLM are never recorded.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import (  # noqa: E402  # noqa: E402
    MIN_MEASURED_STEPS,
    RESULTS,
    WARMUP_STEPS,
    Row,
    append_results,
    code_id,
    free_port,
    measured_code,
    print_table,
    steady_step_times,
)
from _peer_process import failure, gpu_name, installed_version, stop_group  # noqa: E402

#: a ratio row is the median of at least this many same-call ratios
MIN_TURNS = 3
SIDES = ("ours", "trl-default", "trl-sleep", "openrlhf-nosleep", "openrlhf-sleep", "verl")
PEERS = SIDES[1:]
PROGRAMS = {"ours": "e2e_gpu.py", "trl": "trl_grpo_peer.py", "openrlhf": "openrlhf_peer.py", "verl": "verl_peer.py"}
LABELS = {
    "ours": "ours",
    "trl-default": "TRL default",
    "trl-sleep": "TRL sleep",
    "openrlhf-nosleep": "OpenRLHF nosleep",
    "openrlhf-sleep": "OpenRLHF sleep",
    "verl": "verl",
}
#: a peer program's name as the tables print it
PROGRAM_LABELS = {"trl": "TRL", "openrlhf": "OpenRLHF", "verl": "verl"}


def program(side: str) -> str:
    return side.split("-")[0]


@dataclass(frozen=True)
class Workload:
    """One comparison: the model size (bench/peer_workload.py), what it is (for the unit column), our e2e_gpu.py
    flags beyond ``--size``, TRL's beyond the model folder, OpenRLHF's ``--setup``, and each peer's metric name.

    Issue 38's multi-GPU workloads add: ``algo`` (our ``--algo``), ``gpus`` (every side on that many GPUs),
    ``trl_processes`` (TRL through ``accelerate launch --num_processes``), OpenRLHF's and verl's flags after their
    scripts' own (``openrlhf_extra``: dotted flags, the last of a name wins; ``verl_extra``: Hydra overrides, the last
    wins), verl's ``--setup`` (None: verl does not run it), ``best`` (program -> the row of the peer at its faster
    setting of each turn) and ``not_run`` (program -> why the peer cannot run the workload)."""

    size: str
    what: str
    ours: tuple[str, ...]
    trl: tuple[str, ...]
    openrlhf_setup: str
    metrics: dict[str, str] = field(default_factory=dict)
    algo: str = "grpo"
    gpus: int = 1
    trl_processes: int = 1
    openrlhf_extra: tuple[str, ...] = ()
    verl_setup: str | None = None
    verl_extra: tuple[str, ...] = ()
    best: dict[str, str] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)
    default_peers: tuple[str, ...] = ("trl-default", "trl-sleep")

    def runs(self, side: str) -> bool:
        return program(side) not in self.not_run


def _openrlhf_gpus(gpus: int, engines: int, tp: int) -> tuple[str, ...]:
    """OpenRLHF's flags for every role on ``gpus`` GPUs of one node and ``engines`` x TP ``tp`` vLLM engines."""
    out: list[str] = []
    for role in ("actor", "ref", "reward"):
        out += [f"--{role}.num_nodes", "1", f"--{role}.num_gpus_per_node", str(gpus)]
    return (*out, "--vllm.num_engines", str(engines), "--vllm.tensor_parallel_size", str(tp))


#: OpenRLHF's PPO (GAE with a critic initialised from the actor's folder; the critic's learning rate = ours)
def _openrlhf_ppo(model: str, gpus: int) -> tuple[str, ...]:
    return (
        "--algo.advantage.estimator",
        "gae",
        "--critic.model_name_or_path",
        model,
        "--critic.num_nodes",
        "1",
        "--critic.num_gpus_per_node",
        str(gpus),
        "--critic.adam.lr",
        "1e-6",
    )


#: where the TRL and verl lines of a PPO workload stop
NO_PPO = {
    "trl": "bench/trl_grpo_peer.py runs TRL's GRPOTrainer only (no PPO-with-critic script for TRL here); issue 38 "
    "names TRL for G7",
    "verl": "bench/verl_peer.py runs verl's GRPO only (no critic set-up); issue 38 names verl for G7",
}


WORKLOADS = {
    # TRL's defaults on our side: no reference (TRL's beta 0), ZeRO-1, one micro-batch of the whole step (TRL: 64)
    "357m-matched": Workload(
        "357m",
        "357M, 8 prompts x 8, <= 128 new tokens, TRL-matched: no reference, ZeRO-1, one micro-batch of 64",
        ours=("--kl", "0", "--zero_stage", "1", "--micro", "64"),
        trl=(),
        openrlhf_setup="matched",
        metrics={
            "trl-default": "speedup vs TRL default x",
            "trl-sleep": "speedup vs TRL sleep x",
            "openrlhf-nosleep": "speedup vs OpenRLHF nosleep x",
            "openrlhf-sleep": "speedup vs OpenRLHF sleep x",
            "verl": "speedup vs verl 357M matched x",
        },
        verl_setup="matched",
    ),
    # the issue's set-up on our side (ZeRO-3 actor + reference, KL 0.001, micro-batches of 32); TRL at its own
    "357m-zero3ref": Workload(
        "357m",
        "357M, 8 prompts x 8, <= 128 new tokens; ours ZeRO-3 + reference (KL 0.001), micro-batches of 32; "
        "TRL at its own set-up (no reference)",
        ours=(),
        trl=(),
        openrlhf_setup="zero3ref",
        metrics={
            "trl-default": "speedup vs TRL ZeRO-3+ref default x",
            "trl-sleep": "speedup vs TRL ZeRO-3+ref sleep x",
            "openrlhf-nosleep": "speedup vs OpenRLHF zero3ref nosleep x",
            "openrlhf-sleep": "speedup vs OpenRLHF zero3ref sleep x",
            "verl": "speedup vs verl 357M lowvar x",
        },
        verl_setup="lowvar",
        verl_extra=("--micro", "32"),
    ),
    "1.5b": Workload(
        "1.5b",
        "1.3B Qwen2-1.5B-shaped, 32 prompts x 8, 256-token prompts, <= 1024 new tokens, no reference, "
        "ZeRO-1, micro-batches of 8, gradient checkpointing, vLLM at 0.3 of the GPU",
        ours=("--kl", "0", "--zero_stage", "1", "--micro", "8", "--gpu_util", "0.3"),
        trl=("--prompts", "32", "--max_new", "1024", "--micro", "8", "--ckpt", "--gpu_util", "0.3"),
        openrlhf_setup="matched",
        metrics={
            "trl-default": "speedup vs TRL 1.5B default x",
            "trl-sleep": "speedup vs TRL 1.5B sleep x",
            "openrlhf-nosleep": "speedup vs OpenRLHF 1.5B nosleep x",
            "openrlhf-sleep": "speedup vs OpenRLHF 1.5B sleep x",
            "verl": "speedup vs verl 1.5B matched x",
        },
        verl_setup="matched",
    ),
    # issue 38: a 7B GRPO run on 4 GPUs, every role colocated; each side with a reference model where it has one
    "G7": Workload(
        "qwen2.5-7b",
        "G7: GRPO, Qwen2.5-7B-shaped policy + reference (vocabulary 1024), 64 prompts x 8, 512-token prompts, "
        "<= 1024 new tokens, 4 GPUs, every role colocated, vLLM 4 x TP1 at 0.3 of each GPU, ZeRO-3 (ours, "
        "OpenRLHF) / FSDP (verl) / DDP (TRL: no reference, its beta 0), KL 0.001, micro-batches of 8, gradient "
        "checkpointing, reward copy_first",
        ours=("--gpus", "4", "--tp", "1", "--micro", "8", "--gpu_util", "0.3"),
        # accelerate's 4 processes each take a quarter of the step: 16 prompts x 8, micro 8 x 16 accumulation
        trl=("--prompts", "16", "--max_new", "1024", "--micro", "8", "--ckpt", "--gpu_util", "0.3"),
        trl_processes=4,
        openrlhf_setup="zero3ref",
        openrlhf_extra=("--micro", "8", "--gpu_util", "0.3", "--ckpt", "--", *_openrlhf_gpus(4, 4, 1)),
        verl_setup="lowvar",
        verl_extra=(
            "--micro",
            "8",
            "--gpu_util",
            "0.3",
            "--ckpt",
            "--",
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        ),
        gpus=4,
        metrics={
            "trl-default": "speedup vs TRL G7 default x",
            "trl-sleep": "speedup vs TRL G7 sleep x",
            "openrlhf-nosleep": "speedup vs OpenRLHF G7 nosleep x",
            "openrlhf-sleep": "speedup vs OpenRLHF G7 sleep x",
            "verl": "speedup vs verl G7 x",
        },
        best={"trl": "speedup vs TRL G7 x", "openrlhf": "speedup vs OpenRLHF G7 x"},
        default_peers=("openrlhf-nosleep", "openrlhf-sleep", "verl", "trl-default", "trl-sleep"),
    ),
}


def _p8(engines: int, tp: int) -> Workload:
    """issue 38's P8 (the seeds' PPO line): actor, critic and reference on 4 GPUs, ``engines`` x TP ``tp``."""
    layout = "" if (engines, tp) == (4, 1) else f" {engines}xTP{tp}"
    model = "<workdir>/model"  # replaced by the workload's folder in side_command
    return Workload(
        "llama3-8b",
        f"P8{layout}: PPO (GAE), Llama-3-8B-shaped actor, critic and reference (vocabulary 1024), 256 prompts x 1, "
        f"512-token prompts, <= 1024 new tokens, 4 GPUs, every role colocated, ZeRO-3, vLLM {engines} x TP{tp} at "
        "0.3 of each GPU, KL 0.001, micro-batches of 4, gradient checkpointing; reward copy_first (a rule: no "
        "reward model on either side)",
        ours=("--gpus", "4", "--engines", str(engines), "--tp", str(tp), "--micro", "4", "--gpu_util", "0.3"),
        trl=(),
        openrlhf_setup="zero3ref",
        openrlhf_extra=(
            "--micro",
            "4",
            "--gpu_util",
            "0.3",
            "--ckpt",
            "--",
            *_openrlhf_gpus(4, engines, tp),
            *_openrlhf_ppo(model, 4),
        ),
        algo="ppo",
        gpus=4,
        metrics={
            "trl-default": f"speedup vs TRL P8{layout} default x",
            "trl-sleep": f"speedup vs TRL P8{layout} sleep x",
            "openrlhf-nosleep": f"speedup vs OpenRLHF P8{layout} nosleep x",
            "openrlhf-sleep": f"speedup vs OpenRLHF P8{layout} sleep x",
            "verl": f"speedup vs verl P8{layout} x",
        },
        best={"openrlhf": f"speedup vs OpenRLHF P8{layout} x"},
        not_run=NO_PPO,
        default_peers=("openrlhf-nosleep", "openrlhf-sleep"),
    )


WORKLOADS["P8"] = _p8(4, 1)
WORKLOADS["P8-tp2"] = _p8(2, 2)


def turn_order(sides: list[str], turns: int, offset: int = 0) -> list[list[str]]:
    """ABC, CBA, ABC, ...: each side runs early in one turn and late in the next (``offset``: the turns of earlier
    calls, so that a call of one turn continues the alternation)."""
    return [list(sides) if (t + offset) % 2 == 0 else list(reversed(sides)) for t in range(turns)]


# ---- the sides' commands -------------------------------------------------------------------------------------------


def _split(flags: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """A peer script's own flags and, after ``--``, those it passes on to the peer."""
    if "--" not in flags:
        return list(flags), []
    i = flags.index("--")
    return list(flags[:i]), list(flags[i + 1 :])


def side_command(side: str, turn: int, args, scripts: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command of ``side`` in ``turn`` (1-based) and what it adds to the environment."""
    wl = WORKLOADS[args.workload]
    stand_in = scripts.get(program(side))
    script = stand_in or os.path.join(HERE, PROGRAMS[program(side)])
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    model = os.path.join(args.workdir, "model")
    if side == "ours":
        cmd = [
            sys.executable,
            script,
            "--algo",
            wl.algo,
            "--size",
            wl.size,
            *common,
            "--workdir",
            args.workdir,
            "--tag",
            our_tag(args.workload, turn),
            "--backend",
            args.backend,
            *wl.ours,
        ]
        return cmd + (["--small"] if args.small else []), {}
    if program(side) == "trl":
        rest = [model, "vllm", *common, *wl.trl, *(["--sleep"] if side == "trl-sleep" else [])]
        if wl.trl_processes > 1 and not stand_in:  # TRL's multi-GPU runs: one process per GPU, as its docs launch
            launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(wl.trl_processes)]
            launch += ["--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no"]
            return [*launch, "--main_process_port", str(free_port()), script, *rest], {}
        # one process of torch.distributed's env:// world (what `accelerate launch` would set)
        env = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        return [sys.executable, script, *rest], env
    # OpenRLHF and verl stop themselves inside our limit (their logs then still give the steps they made)
    if program(side) == "openrlhf":
        own, passed = _split(wl.openrlhf_extra)
        flags = ["--setup", wl.openrlhf_setup, "--site", args.openrlhf_site, "--grace", "30", *own]
        flags += ["--no_sleep"] if side == "openrlhf-nosleep" else []
    else:
        own, passed = _split(wl.verl_extra)
        flags = ["--setup", str(wl.verl_setup), "--site", args.verl_site, "--grace", "20", *own]
    passed = [model if p == "<workdir>/model" else p for p in passed]
    flags += ["--size", wl.size, *common, "--workdir", args.workdir, "--timeout", str(max(60, args.run_timeout - 60))]
    return [sys.executable, script, *flags, *(["--", *passed] if passed else [])], {}


def our_tag(workload: str, turn: int) -> str:
    return f"pr-{workload}-t{turn}"


# ---- running one side ----------------------------------------------------------------------------------------------


def run_side(cmd: list[str], env: dict, log_path: str, timeout: float, stamp: str | None = None) -> dict:
    """``cmd`` in a process group of its own, its output to ``log_path``; stopped at ``timeout``; whatever it left
    in its group (Ray's workers, vLLM's engine core) is killed afterwards so that nothing holds the GPU. ``stamp``:
    the lines holding it are also written with their arrival times to ``<log_path>.times`` (``[t, line]`` JSON
    lines: the step-end clock of a peer whose script keeps none, verl)."""
    start = time.time()
    stopped = None
    with open(log_path, "w") as log:
        out = subprocess.PIPE if stamp else log
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        reader = None
        if stamp:
            reader = threading.Thread(target=_tee, args=(proc, log, log_path + ".times", stamp), daemon=True)
            reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped = "timeout"
            stop_group(proc)
        except BaseException:  # interrupted: the side must not outlive us
            stop_group(proc)
            raise
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if reader is not None:
                reader.join(timeout=10)
    return {"rc": proc.returncode, "stopped": stopped, "wall_s": round(time.time() - start, 1)}


def _tee(proc: subprocess.Popen, log, times_path: str, stamp: str) -> None:
    with open(times_path, "w") as times:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            log.write(line)
            log.flush()
            if stamp in line:
                times.write(json.dumps([time.time(), line.rstrip("\n")]) + "\n")
                times.flush()


def gpu_used_mib() -> int | None:
    """Memory in use on the machine's GPUs (all processes), or None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    values = [int(v) for v in out.split() if v.strip().isdigit()]
    return sum(values) if values else None


def wait_gpu_quiet(limit_mib: int = 2000, wait_s: float = 60) -> int | None:
    """Wait until the GPUs hold less than ``limit_mib`` (a side's processes exit a little after it); the memory
    left is returned and kept in the run's JSON (a side that starts beside leftovers says so there)."""
    deadline = time.time() + wait_s
    used = gpu_used_mib()
    while used is not None and used >= limit_mib and time.time() < deadline:
        time.sleep(2)
        used = gpu_used_mib()
    return used


# ---- reading one side ----------------------------------------------------------------------------------------------


def measurement(steady: list[float], error: str | None = None, **info) -> dict:
    """A side's figure from its steady step times (after the warm-up, on the one clock): the median, or an error."""
    steady = [float(s) for s in steady]
    if error is None and len(steady) < MIN_MEASURED_STEPS:
        error = (
            f"{len(steady)} measured step(s) after the warm-up: the clock needs >= {MIN_MEASURED_STEPS} (raise --steps)"
        )
    return {
        "ok": error is None,
        "median_s": statistics.median(steady) if error is None else None,
        "steady_s": steady,
        "error": error,
        **info,
    }


def _log_lines(log_path: str) -> list[str]:
    try:
        with open(log_path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _why(run: dict, lines: list[str]) -> str:
    """How a side ended without a result: its time limit, or its exit status and the last error line of its log."""
    if run.get("stopped") == "timeout":
        return "stopped at its time limit (--run_timeout)"
    errors = failure(lines)["error_lines"]
    last = errors[-1].strip() if errors else next((ln.strip() for ln in reversed(lines) if ln.strip()), "no output")
    return f"exit {run.get('rc')}: {last[:300]}"


def read_ours(side_dir: str, run: dict, warmup: int) -> dict:
    """e2e_gpu.py's JSON (``$OUT/e2e-*.json``): the step-end times of metrics.jsonl on the one clock."""
    files = sorted(glob.glob(os.path.join(side_dir, "e2e-*.json")))
    lines = _log_lines(run["log"])
    if not files:
        return measurement([], error=f"no result: {_why(run, lines)}")
    res = json.load(open(files[-1]))
    ends = res.get("step_ends") or []
    if res.get("rc") != 0:
        return measurement([], error=_why({**run, "rc": res.get("rc")}, lines))
    if not ends:
        return measurement([], error=f"no step in its metrics.jsonl: {_why({**run, 'rc': res.get('rc')}, lines)}")
    if None in ends:
        return measurement([], error="its metrics.jsonl lacks wall_time for some step (the step-end clock)")
    return measurement(steady_step_times(ends, warmup) if len(ends) > warmup else [], version="hybrid")


def read_trl(side_dir: str, run: dict, warmup: int) -> dict:
    """trl_grpo_peer.py's ``RESULT {json}`` line: its steady step times (step-end callback, same warm-up)."""
    lines = _log_lines(run["log"])
    results = [ln.split("RESULT ", 1)[1] for ln in lines if ln.startswith("RESULT ")]
    if not results:
        return measurement([], error=f"no RESULT line: {_why(run, lines)}")
    res = json.loads(results[-1])
    if res.get("error"):
        return measurement([], error=res["error"], version=res.get("trl"))
    if res.get("warmup") != warmup:
        return measurement([], error=f"ran with warm-up {res.get('warmup')}, not {warmup}")
    return measurement(res.get("step_s") or [], version=res.get("trl"), peak_gib=res.get("peak_gib"))


def read_openrlhf(side_dir: str, run: dict, warmup: int) -> dict:
    """openrlhf_peer.py's JSON (``$OUT/openrlhf-*.json``): the steady times between its step lines."""
    files = sorted(glob.glob(os.path.join(side_dir, "openrlhf-*.json")))
    if not files:
        return measurement([], error=f"no result: {_why(run, _log_lines(run['log']))}")
    res = json.load(open(files[-1]))
    info = {"version": res.get("openrlhf"), **({"partial": res["partial"]} if res.get("partial") else {})}
    if res.get("error"):
        return measurement([], error=res["error"], **info)
    if res.get("warmup") != warmup:
        return measurement([], error=f"ran with warm-up {res.get('warmup')}, not {warmup}", **info)
    return measurement(res.get("steady_step_s") or [], **info)


#: the step lines of verl's console logger as bench/verl_peer.py echoes them (only lines holding timing_s/step)
VERL_STAMP = "timing_s/step"
VERL_STEP = re.compile(r"(?:^|[\s)])step:(\d+) - ")


def read_verl(side_dir: str, run: dict, warmup: int) -> dict:
    """verl_peer.py's JSON (``$OUT/verl-*.json``) for its error and version; its steps on the one clock from the
    arrival times of the step lines it echoes (``log.txt.times``, run_side's ``stamp``): verl_peer.py's own figure is
    verl's ``timing_s/step``, another clock."""
    files = sorted(glob.glob(os.path.join(side_dir, "verl-*.json")))
    if not files:
        return measurement([], error=f"no result: {_why(run, _log_lines(run['log']))}")
    res = json.load(open(files[-1]))
    info = {"version": res.get("verl"), **({"partial": res["partial"]} if res.get("partial") else {})}
    if res.get("error"):
        return measurement([], error=res["error"], **info)
    if res.get("warmup") != warmup:
        return measurement([], error=f"ran with warm-up {res.get('warmup')}, not {warmup}", **info)
    ends: dict[int, float] = {}
    for line in _log_lines(run["log"] + ".times"):
        t, text = json.loads(line)
        m = VERL_STEP.search(text)
        if m:
            ends.setdefault(int(m.group(1)), t)  # a step's first arrival
    times = [ends[k] for k in sorted(ends)]
    if times and sorted(ends) != list(range(min(ends), min(ends) + len(times))):
        return measurement([], error=f"verl's step lines skip a step ({sorted(ends)}): no step-end clock", **info)
    info["verl_timing_step_s"] = res.get("step_s")  # verl's own timer, kept beside the wall figure
    return measurement(steady_step_times(times, warmup) if len(times) > warmup else [], **info)


READERS = {"ours": read_ours, "trl": read_trl, "openrlhf": read_openrlhf, "verl": read_verl}


# ---- the rows ------------------------------------------------------------------------------------------------------


def ratio_rows(data: dict) -> tuple[list[Row], list[str]]:
    """One row per peer from the run's JSON: the median of its turns' ratios (>= MIN_TURNS), ``failed`` when the
    peer failed and too few ratios are left, else printed only. Returns ``(rows, problems)``."""
    wl = WORKLOADS[data["workload"]]
    by = {(r["turn"], r["side"]): r for r in data["runs"]}
    turns = sorted({r["turn"] for r in data["runs"]})
    ours_ok = {t for t in turns if by.get((t, "ours"), {}).get("ok")}
    ours_failed = [t for t in turns if (t, "ours") in by and not by[(t, "ours")]["ok"]]
    rows, problems = [], []
    for peer in [s for s in data["sides"] if s != "ours"]:
        metric, label = wl.metrics[peer], LABELS[peer]
        ran = [t for t in turns if (t, peer) in by]
        failed = [t for t in ran if not by[(t, peer)]["ok"]]
        pairs = [
            (by[(t, peer)]["median_s"], by[(t, "ours")]["median_s"])
            for t in ran
            if t in ours_ok and by[(t, peer)]["ok"]
        ]
        ratios = [p / o for p, o in pairs]
        notes = []
        if failed:
            notes.append(
                f"{label} failed in {len(failed)} of {len(ran)} turns: {_cell(by[(failed[0], peer)]['error'])}"
            )
        if ours_failed:
            notes.append(
                f"ours failed in {len(ours_failed)} of {len(turns)} turns: "
                f"{_cell(by[(ours_failed[0], 'ours')]['error'])}"
            )
        versions = sorted({str(by[(t, peer)].get("version")) for t in ran if by[(t, peer)].get("version")})
        context = (
            f"{wl.what}; {label}{' ' + '/'.join(versions) if versions else ''}; one clock: wall time between "
            f"step ends, {data['warmup']} warm-up dropped, {data['steps'] - data['warmup']} measured steps "
            f"asked of each side; same model folder; order alternated ABC/CBA over turns"
        )
        if len(ratios) >= MIN_TURNS:
            peer_s, ours_s = statistics.median(p for p, _ in pairs), statistics.median(o for _, o in pairs)
            unit = (
                f"x ({min(ratios):.3f}-{max(ratios):.3f} min-max over {len(ratios)} turns, {label} {peer_s:.3f} s "
                f"/ ours {ours_s:.3f} s medians; " + "; ".join([*notes, context]) + ")"
            )
            rows.append(Row(metric, statistics.median(ratios), unit))
            problems += [f"{metric}: {n}" for n in notes]
            continue
        left = f"{len(ratios)} ratio(s) left" + (": " + ", ".join(f"{r:.3f}" for r in ratios) if ratios else "")
        if failed:  # the peer's failure is the result: recorded as such, never a figure from fewer turns
            rows.append(
                Row(metric, "failed", f"x ({'; '.join(notes)}; {left}, a figure needs >= {MIN_TURNS}; {context})")
            )
            problems.append(f"{metric}: {label} failed ({len(failed)} of {len(ran)} turns)")
        else:
            value = statistics.median(ratios) if ratios else float("nan")
            rows.append(
                Row(
                    metric,
                    value,
                    f"x ({left} of {len(turns)} turn(s): a row needs >= {MIN_TURNS} same-call "
                    f"ratios" + "".join(f"; {n}" for n in notes) + ")",
                    record=False,
                )
            )
            problems.append(f"{metric}: {left}, a row needs >= {MIN_TURNS}" + "".join(f"; {n}" for n in notes))
    for prog, metric in wl.best.items():
        row, problem = _best_row(data, prog, metric, by, turns, ours_ok)
        if row is not None:
            rows.append(row)
        problems += [problem] if problem else []
    return rows, problems


def _best_row(data: dict, prog: str, metric: str, by: dict, turns: list[int], ours_ok: set[int]):
    """The peer at its best: in each turn, the faster of its settings that completed (e.g. OpenRLHF without sleep,
    or with it where the run does not fit without) over ours of that turn; the row is the median of >= MIN_TURNS
    such ratios. None when fewer than two of its settings ran."""
    sides = [s for s in data["sides"] if s != "ours" and program(s) == prog]
    if len(sides) < 2:
        return None, None
    label = PROGRAM_LABELS[prog]
    ratios, picked, failed_turns = [], [], []
    for t in turns:
        done = [(by[(t, s)]["median_s"], s) for s in sides if by.get((t, s), {}).get("ok")]
        if not done and any((t, s) in by for s in sides):
            failed_turns.append(t)
        if done and t in ours_ok:
            best_s, best_side = min(done)
            ratios.append(best_s / by[(t, "ours")]["median_s"])
            picked.append(LABELS[best_side])
    which = ", ".join(f"{n} x{picked.count(n)}" for n in sorted(set(picked)))
    what = f"{label} at its faster setting of each turn ({which or 'none completed'}) over ours of that turn"
    if len(ratios) >= MIN_TURNS:
        span = f"{min(ratios):.3f}-{max(ratios):.3f} min-max over {len(ratios)} turns"
        unit = f"x ({span}; {what}; {data.get('what') or ''})"
        return Row(metric, statistics.median(ratios), unit), None
    if failed_turns:
        unit = f"x (every {label} setting failed in {len(failed_turns)} turn(s); {len(ratios)} ratio(s) left; {what})"
        return Row(metric, "failed", unit), f"{metric}: every {label} setting failed in {len(failed_turns)} turn(s)"
    value = statistics.median(ratios) if ratios else float("nan")
    unit = f"x ({len(ratios)} ratio(s): a row needs >= {MIN_TURNS}; {what})"
    return Row(metric, value, unit, record=False), f"{metric}: {len(ratios)} ratio(s) left, a row needs >= {MIN_TURNS}"


def _cell(text: str) -> str:
    """An error message as text of a RESULTS.md cell (one line, no column separator)."""
    return " ".join(str(text).split()).replace("|", "/")


def print_turns(data: dict) -> None:
    print(f"\n{'turn':>4}  {'#':>2}  {'side':<17} {'median s':>9} {'steps':>5}  note")
    for r in data["runs"]:
        median = f"{r['median_s']:.3f}" if r["ok"] else "-"
        note = r["error"] or (f"partial: {r['partial']}" if r.get("partial") else "")
        print(
            f"{r['turn']:>4}  {r['position']:>2}  {r['side']:<17} {median:>9} {len(r['steady_s']):>5}  "
            f"{r['wall_s']:.0f} s{'; ' + note if note else ''}"
        )


def report(data: dict, record: bool, device: str | None = None, extra: list[Row] | None = None) -> int:
    """Print the turns and the rows of a run's JSON; append the recordable rows when asked (and allowed). ``extra``:
    rows printed after them, never recorded (bench/peers.py: the peers not installed or not run)."""
    print_turns(data)
    rows, problems = ratio_rows(data)
    print_table(
        f"peer ratios, {data['workload']} ({len(sorted({r['turn'] for r in data['runs']}))} turn(s), {data['device']})",
        rows + [Row(r.metric, r.value, r.unit, record=False) for r in extra or []],
    )
    for p in problems:
        print("NOTE:", p)
    if record:
        if not data.get("recordable"):
            print(f"not recorded: {data.get('why_not_recordable')}")
            return 2
        n = append_results(rows, device or data["device"], command=data["command"], code=measured_code(data))
        print(f"appended {n} row(s) to {RESULTS}")
    return 0 if not problems else 3


# ---- the run -------------------------------------------------------------------------------------------------------


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="357m-matched")
    ap.add_argument("--turns", type=int, default=MIN_TURNS, help=f"turns in this call (rows need >= {MIN_TURNS})")
    ap.add_argument(
        "--turn_offset",
        type=int,
        default=0,
        help="turns already run in earlier calls: this call's turns continue their order and numbering (a call too "
        "short for three turns runs one; `report` joins the calls' JSONs, each turn's ratio still of one call)",
    )
    ap.add_argument(
        "--peers",
        nargs="+",
        choices=PEERS,
        default=None,
        help="the peers to run (default: trl-default trl-sleep; with --openrlhf also openrlhf-nosleep openrlhf-sleep; "
        "G7 / P8: every peer that can run it)",
    )
    ap.add_argument("--openrlhf", action="store_true", help="OpenRLHF without and with sleep among the default peers")
    ap.add_argument("--openrlhf_site", default="/tmp/site-orl", help="where OpenRLHF is installed (openrlhf_peer.py)")
    ap.add_argument("--verl_site", default="/tmp/site-verl", help="where verl is installed (verl_peer.py)")
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps dropped on every side")
    ap.add_argument(
        "--steps", type=int, default=None, help=f"steps of every side (default: warm-up + {MIN_MEASURED_STEPS + 1})"
    )
    ap.add_argument("--run_timeout", type=float, default=900, help="seconds one side may run before it is stopped")
    ap.add_argument(
        "--workdir",
        default=None,
        help="the model folder's parent (default /tmp/peer at 357m, /tmp/peer-<size>, with --small "
        "/tmp/peer-small-<size>), built first if missing",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="the run's JSON and logs (default /tmp/peer_ratio/<workload>; its earlier turn folders are replaced)",
    )
    ap.add_argument("--backend", default="vllm", help="our engine (vllm; hf with --small: a CPU check, not recorded)")
    ap.add_argument("--small", action="store_true", help="a 2-layer model of the workload's shape (not recorded)")
    ap.add_argument(
        "--script",
        action="append",
        default=[],
        metavar="PROGRAM=PATH",
        help="a stand-in with the same arguments for ours / trl / openrlhf (a CPU check, not recorded)",
    )
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md (or $BENCH_RESULTS)")
    ap.add_argument("--dry", action="store_true", help="print every turn's commands; build and run nothing")
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1: the first step has no start on the step-end clock (bench/_common.py)")
    args.steps = args.steps if args.steps is not None else args.warmup + MIN_MEASURED_STEPS + 1
    if args.steps < args.warmup + MIN_MEASURED_STEPS:
        ap.error(
            f"--steps {args.steps} leaves {args.steps - args.warmup} measured step(s) after --warmup "
            f"{args.warmup}: the clock needs >= {MIN_MEASURED_STEPS} "
            f"(--steps >= {args.warmup + MIN_MEASURED_STEPS})"
        )
    if args.turns < 1:
        ap.error("--turns must be >= 1")
    if args.peers is not None and args.openrlhf:
        ap.error("--peers names every peer: leave out --openrlhf, or name openrlhf-nosleep / openrlhf-sleep in --peers")
    wl = WORKLOADS[args.workload]
    default = list(wl.default_peers) + (["openrlhf-nosleep", "openrlhf-sleep"] if args.openrlhf else [])
    peers = args.peers or default
    cannot = [p for p in peers if not wl.runs(p)]
    if cannot:
        ap.error(f"{args.workload} cannot run {', '.join(cannot)}: {wl.not_run[program(cannot[0])]}")
    if "verl" in peers and wl.verl_setup is None:
        ap.error(f"{args.workload}: verl runs GRPO workloads only")
    args.sides = ["ours", *[p for p in PEERS if p in peers]]
    args.scripts = {}
    for item in args.script:
        name, _, path = item.partition("=")
        if name not in PROGRAMS or not path:
            ap.error(f"--script {item!r}: give PROGRAM=PATH with PROGRAM one of {', '.join(PROGRAMS)}")
        args.scripts[name] = os.path.abspath(path)
    size = wl.size
    args.workdir = args.workdir or (
        f"/tmp/peer-small-{size}" if args.small else "/tmp/peer" if size == "357m" else f"/tmp/peer-{size}"
    )
    args.out = args.out or os.path.join("/tmp/peer_ratio", args.workload)
    why = []
    if args.record and args.turns + args.turn_offset < MIN_TURNS:
        why.append(f"--turns {args.turns}: a ratio row is the median of >= {MIN_TURNS} same-call ratios")
    if args.small:
        why.append("--small: a 2-layer model")
    if args.backend != "vllm":
        why.append(f"--backend {args.backend}: the peers run vLLM")
    if args.scripts:
        why.append(f"stand-ins for {', '.join(sorted(args.scripts))} (--script)")
    args.why_not_recordable = "; ".join(why) or None
    if args.record and why:
        ap.error(f"--record refused: {args.why_not_recordable}")
    return args, ap


def check_installed(args, ap) -> None:
    """Refuse to start a long run whose peers cannot import (a stand-in of a program needs nothing)."""
    programs = {program(s) for s in args.sides} - {"ours"} - set(args.scripts)
    if "trl" in programs and installed_version("trl", os.environ) is None:
        ap.error(
            "TRL is not importable here (pip install trl; on a lent GPU bench/sessions/residency_session.sh stage "
            "carries it), or run without the TRL peers (--peers openrlhf-...)"
        )
    if "openrlhf" in programs:
        from openrlhf_peer import environment

        if installed_version("openrlhf", environment(args.openrlhf_site)) is None:
            ap.error(
                f"OpenRLHF is not installed in --openrlhf_site {args.openrlhf_site} "
                "(bench/sessions/openrlhf_session.sh stage), or run without the OpenRLHF peers"
            )
    if "verl" in programs:
        from verl_peer import environment as verl_environment

        if installed_version("verl", verl_environment(args.verl_site)) is None:
            ap.error(
                f"verl is not installed in --verl_site {args.verl_site} "
                "(bench/sessions/verl_session.sh stage), or run without the verl peer"
            )


def prompts_needed(args) -> int:
    """Prompts enough for every step of every side (each prompt is used once; OpenRLHF and verl stop at the end of
    their data)."""
    from e2e_gpu import WORKLOADS as SHAPES

    return max(256, args.steps * SHAPES[WORKLOADS[args.workload].size][0])


def build_workload(args) -> None:
    """The model folder and prompts every side loads, built once before the first turn (if missing; the prompts
    also when they are fewer than the steps need)."""
    from peer_workload import prompt_count, write_prompts

    model = os.path.join(args.workdir, "model")
    size, needed = WORKLOADS[args.workload].size, prompts_needed(args)
    if os.path.exists(os.path.join(model, "config.json")):
        if prompt_count(args.workdir) < needed:
            write_prompts(args.workdir, size=size, prompts=needed)
        return
    from peer_workload import build

    t0 = time.time()
    build(args.workdir, size=size, prompts=needed, **({"layers": 2, "hidden": 112} if args.small else {}))
    print(f"built {model} in {time.time() - t0:.0f} s", flush=True)


def run(args) -> dict:
    order = turn_order(args.sides, args.turns, args.turn_offset)
    data = {
        "workload": args.workload,
        "what": WORKLOADS[args.workload].what,
        "sides": args.sides,
        "turns": args.turns,
        "steps": args.steps,
        "warmup": args.warmup,
        "order": order,
        "runs": [],
        "device": gpu_name(),
        "command": shlex.join(["python", os.path.relpath(__file__, ROOT), *args.argv]),
        "code": code_id(),  # `report --record` names the code that measured, not the tree it runs in
        "recordable": args.why_not_recordable is None,
        "why_not_recordable": args.why_not_recordable,
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "workdir": args.workdir,
    }
    if data["device"] == "cpu" and data["recordable"]:
        data.update(recordable=False, why_not_recordable="no GPU (nvidia-smi) on the machine that ran it")
    os.makedirs(args.out, exist_ok=True)
    for old in glob.glob(os.path.join(args.out, "t*-*")):  # an earlier run's turns: this JSON describes this run
        shutil.rmtree(old, ignore_errors=True)
    json_path = os.path.join(args.out, f"peer_ratio-{args.workload}.json")
    for turn, sides in enumerate(order, start=1 + args.turn_offset):
        print(f"\nturn {turn}/{args.turns + args.turn_offset}: {', '.join(sides)}", flush=True)
        for position, side in enumerate(sides, start=1):
            side_dir = os.path.join(args.out, f"t{turn}-{side}")
            os.makedirs(side_dir)
            cmd, extra_env = side_command(side, turn, args, args.scripts)
            if side == "ours":  # a fresh run folder: its metrics.jsonl must hold this run's steps only
                shutil.rmtree(_our_save(args, turn), ignore_errors=True)
            entry = {
                "turn": turn,
                "position": position,
                "side": side,
                "command": shlex.join(cmd),
                "log": os.path.join(side_dir, "log.txt"),
                "gpu_mib_before": wait_gpu_quiet(),
                "load_before": _load(),
            }
            stamp = VERL_STAMP if program(side) == "verl" else None
            env = {**os.environ, **extra_env, "OUT": side_dir}
            entry.update(run_side(cmd, env, entry["log"], args.run_timeout, stamp=stamp))
            entry.update(READERS[program(side)](side_dir, entry, args.warmup))
            if side == "ours":
                _keep_our_run(args, turn, side_dir)
            data["runs"].append(entry)
            with open(json_path, "w") as f:
                json.dump(data, f, indent=1)
            what = (
                f"{entry['median_s']:.3f} s/step (median of {len(entry['steady_s'])})"
                if entry["ok"]
                else f"FAILED: {entry['error']}"
            )
            print(f"  [{position}] {side:<17} {what}  ({entry['wall_s']:.0f} s, log {entry['log']})", flush=True)
    data["json"] = json_path
    return data


def _our_save(args, turn: int) -> str:
    """e2e_gpu.py's run folder for our tag (its naming: <algo>-<size>-colocated-<tag>)."""
    return os.path.join(
        args.workdir,
        "runs",
        f"{WORKLOADS[args.workload].algo}-{WORKLOADS[args.workload].size}-colocated-{our_tag(args.workload, turn)}",
    )


def _keep_our_run(args, turn: int, side_dir: str) -> None:
    """Our run's metrics, timeline and plan into the turn's folder; the run folder (checkpoints) removed."""
    save = _our_save(args, turn)
    for name in ("metrics.jsonl", "timeline.jsonl", "residency.json"):
        if os.path.exists(os.path.join(save, name)):
            shutil.copy(os.path.join(save, name), side_dir)
    shutil.rmtree(save, ignore_errors=True)


def _load() -> str | None:
    """The machine's load averages before a side starts (a noisy neighbour shows in the JSON)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def dry(args) -> None:
    for turn, sides in enumerate(turn_order(args.sides, args.turns, args.turn_offset), start=1 + args.turn_offset):
        print(f"turn {turn}: {', '.join(sides)}")
        for side in sides:
            cmd, env = side_command(side, turn, args, args.scripts)
            env = {**env, "OUT": os.path.join(args.out, f"t{turn}-{side}")}
            print(f"  [{side}] " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd))


#: what the calls joined by `report` must share: one workload and protocol, measured by one code
JOINED_KEYS = ("workload", "sides", "steps", "warmup", "code", "device")


def join_calls(datas: list[dict]) -> dict:
    """The JSONs of several calls (``--turn_offset``) as one run: their turns in order. Each turn's ratio is of one
    call (both sides ran in it); the calls must share workload, sides, steps, warm-up, code and device, and each
    turn number may come from one call only."""
    first = datas[0]
    for d in datas[1:]:
        differ = [k for k in JOINED_KEYS if d.get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"report: the calls differ in {', '.join(differ)}: they cannot make one row")
    seen: set[int] = set()
    for d in datas:
        turns = {r["turn"] for r in d["runs"]}
        if turns & seen:
            raise SystemExit(f"report: turn {min(turns & seen)} is in two calls: run the later ones with --turn_offset")
        seen |= turns
    joined = dict(first)
    joined["runs"] = [r for d in datas for r in d["runs"]]
    joined["turns"] = sum(d["turns"] for d in datas)
    joined["command"] = " ; ".join(d["command"] for d in datas)
    why = [d["why_not_recordable"] for d in datas if not d.get("recordable")]
    joined.update(recordable=not why, why_not_recordable="; ".join(filter(None, why)) or None)
    return joined


def report_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="peer_ratio.py report", description="the rows of a run's JSON")
    ap.add_argument(
        "json", nargs="+", help="peer_ratio-<workload>.json of a run, or of each call of one (--turn_offset)"
    )
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md (or $BENCH_RESULTS)")
    ap.add_argument("--device", default=None, help="device label (default: the JSON's)")
    a = ap.parse_args(argv)
    datas = [json.load(open(path)) for path in a.json]
    return report(join_calls(datas) if len(datas) > 1 else datas[0], a.record, a.device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        return report_main(argv[1:])
    args, ap = parse(argv)
    args.argv = argv
    if args.dry:
        dry(args)
        return 0
    check_installed(args, ap)
    build_workload(args)
    data = run(args)
    print(f"\nJSON: {data['json']}")
    return report(data, args.record)


if __name__ == "__main__":
    raise SystemExit(main())
