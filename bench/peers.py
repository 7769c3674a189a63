"""The benchmark a user can run (issue 38): ours against whichever peers are installed, on the same GPUs, under the
fair protocol of bench/peer_ratio.py, with the machine's environment printed above the table.

    python bench/peers.py G7 --peers openrlhf,verl,trl        # GRPO 7B on 4 GPUs: ours | OpenRLHF | verl | TRL
    python -m bench.peers P8 --peers openrlhf                 # the same, from the repo root: PPO 8B, vLLM 4 x TP1
    python bench/peers.py P8-tp2                              # PPO 8B, vLLM 2 x TP2
    python bench/peers.py G7 --dry                            # the plan and every turn's commands; runs nothing
    python bench/peers.py G7 --record                         # append the rows to bench/RESULTS.md

What it does, in order: (1) checks which of the named peers can run here -- importable where its script runs it
(TRL in this Python, OpenRLHF in ``--openrlhf_site``, verl in ``--verl_site``) and able to express the workload
(a peer that is not is listed ``not installed`` / ``not run: <why>``, and the run goes on without it); (2) prints
the environment (GPUs, driver, CUDA, the packages' and each peer's versions); (3) builds the workload folder
(bench/peer_workload.py: a random-weight model of the workload's shape and its prompts; nothing is downloaded);
(4) runs bench/peer_ratio.py's protocol: ours (bench/e2e_gpu.py) and each peer's settings (OpenRLHF without and
with sleep, TRL at its default and with sleep, verl at its GRPO recipe) in turns whose order alternates, on one
clock (wall time between step ends, the same warm-up dropped, >= 5 measured steps); (5) prints the turns, then the
table: per peer setting the median of >= 3 turns' ratios (peer's step / ours), and per peer its best setting.

Workloads (bench/peer_ratio.py's WORKLOADS): ``G7`` GRPO, Qwen2.5-7B-shaped policy + reference, 64 prompts x 8,
512-token prompts, <= 1024 new tokens, 4 GPUs, every role colocated; ``P8`` PPO, Llama-3-8B-shaped actor, critic
and reference, 256 prompts x 1, <= 1024 new tokens, 4 GPUs, ZeRO-3, vLLM 4 x TP1 (``P8-tp2``: 2 x TP2); the
one-GPU ``357m-matched``, ``357m-zero3ref``, ``1.5b``. The reward is the rule ``copy_first`` on every side.

It needs the GPUs (exit 2 without one, except ``--dry`` / ``--small``); it does not need the lent-machine session
scripts (bench/sessions/), which may call it. ``--script PROGRAM=PATH`` puts a stand-in with the same arguments in
place of ours / trl / openrlhf / verl (the CPU check of this orchestration, tests/bench/test_peers.py); a run with
stand-ins, ``--small`` or another backend than vLLM is never recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:  # the bench scripts import each other by name (`from _common import ...`)
    sys.path.insert(0, HERE)

import peer_ratio as pr  # noqa: E402
from _common import Row, code_id  # noqa: E402

PROGRAM_NAMES = ("openrlhf", "verl", "trl")
#: the packages whose versions the environment block prints (None where absent), in this Python
PACKAGES = ("torch", "transformers", "vllm", "deepspeed", "ray", "accelerate")
#: the package that must be importable for each peer program (in the environment its script gives it)
PEER_PACKAGE = {"openrlhf": "openrlhf", "verl": "verl", "trl": "trl"}

VERSIONS = r"""
import importlib.metadata as m, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def versions(names: list[str], env: dict | None = None) -> dict[str, str | None]:
    """The installed versions of ``names`` as a Python with ``env`` sees them (None where absent), read from the
    packages' metadata in one subprocess: nothing is imported, no CUDA context is made."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", VERSIONS, *names],
            env=dict(env if env is not None else os.environ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        return {**dict.fromkeys(names), **json.loads(proc.stdout.strip().splitlines()[-1])}
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return dict.fromkeys(names)


def peer_env(prog: str, args) -> dict:
    """The environment in which ``prog``'s script runs its peer (its own site folder first)."""
    if prog == "openrlhf":
        from openrlhf_peer import environment

        return environment(args.openrlhf_site)
    if prog == "verl":
        from verl_peer import environment as verl_environment

        return verl_environment(args.verl_site)
    return dict(os.environ)


def _smi(query: str) -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _driver_cuda() -> str | None:
    """The CUDA version the driver supports (nvidia-smi's header), None without one."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for part in out.split("|"):
        if "CUDA Version:" in part:
            return part.split("CUDA Version:")[1].split()[0]
    return None


def _torch_cuda() -> str | None:
    """The CUDA torch was built with (``torch.version.cuda``; no device touched), None without torch."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.version.cuda)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None
    return None if value in (None, "None") else value


def environment(args, peer_versions: dict[str, str | None]) -> dict:
    """The machine and software a run measured on: GPUs (names, count, driver), CUDA, Python, our code's id, the
    packages' versions (None where absent) and each peer's (as its own environment sees it)."""
    gpus = _smi("name,driver_version,memory.total")
    names = [g.split(",")[0].strip() for g in gpus]
    return {
        "gpu": names[0] if len(set(names)) == 1 else (", ".join(names) or None),
        "gpu_count": len(names),
        "gpu_memory": gpus[0].split(",")[2].strip() if gpus else None,
        "driver": gpus[0].split(",")[1].strip() if gpus else None,
        "cuda_driver": _driver_cuda(),
        "cuda_torch": _torch_cuda(),
        "python": platform.python_version(),
        "hybrid_code": code_id(),
        **versions(list(PACKAGES)),
        **{f"peer {prog}": v for prog, v in peer_versions.items()},
    }


def print_environment(env: dict) -> None:
    print("\nenvironment")
    width = max(len(k) for k in env)
    for key, value in env.items():
        print(f"  {key:<{width}}  {value}")


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(pr.WORKLOADS), help="G7, P8, P8-tp2 (issue 38) or a one-GPU one")
    ap.add_argument(
        "--peers",
        default=",".join(PROGRAM_NAMES),
        help="comma-separated: openrlhf, verl, trl (each with all its settings) or settings by name "
        f"({', '.join(pr.PEERS)}); default: all three",
    )
    ap.add_argument("--turns", type=int, default=pr.MIN_TURNS, help=f"turns (a row needs >= {pr.MIN_TURNS})")
    ap.add_argument("--steps", type=int, default=None, help="steps of every side (default: warm-up + 6)")
    ap.add_argument("--warmup", type=int, default=pr.WARMUP_STEPS, help="steps dropped on every side")
    ap.add_argument(
        "--run_timeout",
        type=float,
        default=None,
        help="seconds one side may run (default 900; 1800 on the 4-GPU workloads)",
    )
    ap.add_argument("--workdir", default=None, help="the workload folder (default /tmp/peer-<size>)")
    ap.add_argument("--out", default=None, help="the run's JSON and logs (default /tmp/peer_ratio/<workload>)")
    ap.add_argument("--openrlhf_site", default="/tmp/site-orl", help="where OpenRLHF is installed")
    ap.add_argument("--verl_site", default="/tmp/site-verl", help="where verl is installed")
    ap.add_argument("--backend", default="vllm", help="our engine (hf with --small: a CPU check)")
    ap.add_argument("--small", action="store_true", help="a 2-layer model of the workload's shape (not recorded)")
    ap.add_argument(
        "--script", action="append", default=[], metavar="PROGRAM=PATH", help="a stand-in (a CPU check, not recorded)"
    )
    ap.add_argument("--record", action="store_true", help="append the rows to bench/RESULTS.md (or $BENCH_RESULTS)")
    ap.add_argument("--dry", action="store_true", help="print the plan and every turn's commands; run nothing")
    args = ap.parse_args(argv)
    args.argv = argv
    wanted = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [p for p in wanted if p not in PROGRAM_NAMES and p not in pr.PEERS]
    if bad:
        ap.error(f"--peers {','.join(bad)}: name {', '.join(PROGRAM_NAMES)} or settings of {', '.join(pr.PEERS)}")
    args.wanted = wanted
    return args, ap


def plan(args) -> tuple[list[str], dict[str, str], dict[str, str | None]]:
    """``(sides, status, versions)``: the peer settings that run; per named program not running, why (``not
    installed`` / ``not run: ...``); each named program's version (None where absent; ``stand-in`` for --script)."""
    wl = pr.WORKLOADS[args.workload]
    stand_ins = {item.partition("=")[0] for item in args.script}
    programs = sorted({w if w in PROGRAM_NAMES else pr.program(w) for w in args.wanted}, key=PROGRAM_NAMES.index)
    sides: list[str] = []
    status: dict[str, str] = {}
    found: dict[str, str | None] = {}
    for prog in programs:
        settings = _settings(args, prog)
        found[prog] = "stand-in" if prog in stand_ins else versions([PEER_PACKAGE[prog]], peer_env(prog, args))[prog]
        if prog in wl.not_run:
            status[prog] = f"not run: {wl.not_run[prog]}"
        elif prog == "verl" and wl.verl_setup is None:
            status[prog] = "not run: verl runs GRPO workloads only"
        elif found[prog] is None:
            where = {"openrlhf": f" in {args.openrlhf_site}", "verl": f" in {args.verl_site}"}.get(prog, "")
            status[prog] = f"not installed{where}"
        elif (
            prog == "trl"
            and wl.trl_processes > 1
            and prog not in stand_ins
            and not versions(["accelerate"])["accelerate"]
        ):
            status[prog] = "not installed: accelerate (TRL's multi-GPU launcher)"
        else:
            sides += settings
    return [s for s in pr.PEERS if s in sides], status, found


def _settings(args, prog: str) -> list[str]:
    """The settings of ``prog`` that --peers names: all of them for the program's name, else those named."""
    return [s for s in pr.PEERS if pr.program(s) == prog and (prog in args.wanted or s in args.wanted)]


def status_rows(wl, status: dict[str, str]) -> list[Row]:
    """The table's line for each named peer that did not run (printed, never recorded)."""
    rows = []
    for prog, why in status.items():
        metric = wl.best.get(prog) or next(
            (m for s, m in wl.metrics.items() if pr.program(s) == prog), f"{prog} {wl.size}"
        )
        rows.append(Row(metric, why.split(":")[0], f"x ({pr.PROGRAM_LABELS[prog]} {why})", record=False))
    return rows


def main(argv: list[str] | None = None) -> int:
    args, _ = parse(sys.argv[1:] if argv is None else argv)
    wl = pr.WORKLOADS[args.workload]
    sides, status, found = plan(args)
    env = environment(args, found)
    print(f"workload {args.workload}: {wl.what}")
    print_environment(env)
    print("\npeers")
    for prog in found:
        ran = [s for s in sides if pr.program(s) == prog]
        print(f"  {prog:<9} {found[prog] or '-':<10} {', '.join(ran) if ran else status[prog]}")
    if args.dry and any(why.startswith("not installed") for why in status.values()):
        print("  (--dry: the plan below holds the peers not installed here too)")
    if not args.dry and not args.small and env["gpu_count"] == 0:
        print(
            "\nno GPU here (nvidia-smi found none): the benchmark runs on the GPUs it compares "
            f"({wl.gpus} for {args.workload}). --dry prints the plan; --small --backend hf checks the orchestration "
            "on CPU.",
            file=sys.stderr,
        )
        return 2
    if args.dry:  # the plan shows the peers this machine lacks too: what a machine with them would run
        missing = {p for p, why in status.items() if why.startswith("not installed")}
        sides = [
            s for s in pr.PEERS if s in sides or (pr.program(s) in missing and s in _settings(args, pr.program(s)))
        ]
    if not sides:
        print("\nnothing to compare: none of the named peers can run here (see above)", file=sys.stderr)
        return 2
    pr_argv = ["--workload", args.workload, "--peers", *sides, "--turns", str(args.turns), "--warmup", str(args.warmup)]
    pr_argv += ["--steps", str(args.steps)] if args.steps is not None else []
    timeout = args.run_timeout or (1800 if wl.gpus > 1 else 900)
    pr_argv += ["--run_timeout", str(timeout), "--openrlhf_site", args.openrlhf_site, "--verl_site", args.verl_site]
    pr_argv += ["--backend", args.backend, *(["--small"] if args.small else [])]
    pr_argv += [*(["--workdir", args.workdir] if args.workdir else []), *(["--out", args.out] if args.out else [])]
    pr_argv += [f"--script={s}" for s in args.script] + (["--record"] if args.record else [])
    try:
        pr_args, _ = pr.parse(pr_argv)
    except SystemExit as e:  # peer_ratio's refusal (printed by its parser) is ours
        return int(e.code or 2)
    pr_args.argv = pr_argv
    if args.dry:
        print(
            f"\nplan: {len(sides) + 1} sides x {pr_args.turns} turns, {pr_args.steps} steps each "
            f"({pr_args.warmup} warm-up), workload folder {pr_args.workdir}, results {pr_args.out}"
        )
        pr.dry(pr_args)
        return 0
    pr.build_workload(pr_args)
    data = pr.run(pr_args)
    data.update(
        environment=env,
        peers_status=status,
        peer_ratio_command=data["command"],
        command=shlex.join(["python", "bench/peers.py", *args.argv]),
    )
    with open(data["json"], "w") as f:
        json.dump(data, f, indent=1)
    print(f"\nJSON: {data['json']}")
    print_environment(env)
    return pr.report(data, args.record, extra=status_rows(wl, status))


if __name__ == "__main__":
    raise SystemExit(main())
