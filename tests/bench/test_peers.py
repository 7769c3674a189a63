"""bench/peers.py on CPU (issue 38's benchmark a user can run): ``--dry`` of G7 and P8 prints every side's command
with the workload's shape (4 GPUs, 64 x 8 / 256 x 1, <= 1024 new tokens) and each peer's script composes that shape
from it; the environment block prints absent packages as None; a peer that is not installed is listed so and the
run goes on; and a whole run through real subprocesses with stand-ins (``--script``, as tests/bench/
test_peer_ratio.py does) for ours, OpenRLHF and verl, each reporting in its program's own format."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import e2e_gpu  # noqa: E402
import peer_ratio as pr  # noqa: E402
import peers  # noqa: E402
import verl_peer  # noqa: E402


def _sides(printed: str) -> dict[str, list[list[str]]]:
    """The ``[side] ENV... command`` lines of a --dry plan, per side (one command per turn)."""
    out: dict[str, list[list[str]]] = {}
    for line in printed.splitlines():
        line = line.strip()
        if line.startswith("[") and "] OUT=" in line:
            side, _, rest = line[1:].partition("] ")
            out.setdefault(side, []).append(shlex.split(rest)[1:])  # OUT=... dropped
    return out


def _value(cmd, flag, default=None):
    """The value of the last ``flag`` in ``cmd`` (a peer's parser: the last of a name wins)."""
    idx = [i for i, c in enumerate(cmd) if c == flag]
    return type(default)(cmd[idx[-1] + 1]) if idx and default is not None else (cmd[idx[-1] + 1] if idx else default)


def _launched_dry(cmd: list[str]) -> list[str]:
    """The peer's own command as its script composes it (``--dry``: nothing runs; no torch needed)."""
    proc = subprocess.run(
        [*cmd, "--dry"] if "--" not in cmd else [*cmd[: cmd.index("--")], "--dry", *cmd[cmd.index("--") :]],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("command: "))
    return shlex.split(line[len("command: ") :])


def _e2e_command(ours: list[str]) -> list[str]:
    """The `hybrid` command e2e_gpu.py makes of our side's flags (its own parser's defaults, as its main() sees)."""
    args = argparse.Namespace(
        algo=_value(ours, "--algo"),
        size=_value(ours, "--size"),
        backend=_value(ours, "--backend"),
        micro=_value(ours, "--micro", 32),
        steps=_value(ours, "--steps", 8),
        lr=1e-6,
        kl=_value(ours, "--kl", 0.001),
        residency="auto",
        trainer="deepspeed",
        zero_stage=_value(ours, "--zero_stage", 3),
        gpu_util=_value(ours, "--gpu_util", 0.35),
        sleep_level=0,
        ckpt=False,
        split=False,
        enforce_eager=False,
        extra=[],
        gpus=_value(ours, "--gpus", 1),
        tp=_value(ours, "--tp", 1),
        engines=None,
    )
    args.engines = _value(ours, "--engines", 0) or args.gpus // args.tp
    return e2e_gpu.command(args, "/w/model", "/w/prompts.jsonl", "/w/runs/x")


def test_dry_g7_prints_every_sides_command_with_the_workloads_shape(capsys):
    assert peers.main(["G7", "--dry", "--turns", "1", "--peers", "openrlhf,verl,trl"]) == 0
    printed = capsys.readouterr().out
    sides = _sides(printed)
    assert set(sides) == {"ours", "trl-default", "trl-sleep", "openrlhf-nosleep", "openrlhf-sleep", "verl"}
    assert "64 prompts x 8" in printed and "<= 1024 new tokens" in printed and "4 GPUs" in printed
    assert e2e_gpu.WORKLOADS["qwen2.5-7b"][:4] == (64, 8, 1024, 512)

    (ours,) = sides["ours"]
    assert _value(ours, "--algo") == "grpo" and _value(ours, "--size") == "qwen2.5-7b"
    hybrid = _e2e_command(ours)
    for flag, want in (
        ("--actor_num_gpus_per_node", "4"),
        ("--ref_num_gpus_per_node", "4"),
        ("--vllm_num_engines", "4"),
        ("--vllm_tensor_parallel_size", "1"),
        ("--rollout_batch_size", "64"),
        ("--n_samples_per_prompt", "8"),
        ("--train_batch_size", "512"),
        ("--generate_max_len", "1024"),
        ("--prompt_max_len", "512"),
        ("--zero_stage", "3"),
        ("--init_kl_coef", "0.001"),
    ):
        assert _value(hybrid, flag) == want, flag
    assert "--colocate_all_models" in hybrid and "--gradient_checkpointing" in hybrid

    for side in ("trl-default", "trl-sleep"):  # accelerate's 4 processes x 16 prompts x 8 = the step's 64 x 8
        (cmd,) = sides[side]
        assert cmd[1:3] == ["-m", "accelerate.commands.launch"] and _value(cmd, "--num_processes") == "4"
        assert int(_value(cmd, "--prompts")) * 4 == 64 and _value(cmd, "--max_new") == "1024"
        assert ("--sleep" in cmd) == (side == "trl-sleep")

    for side in ("openrlhf-nosleep", "openrlhf-sleep"):
        (cmd,) = sides[side]
        assert cmd[1].endswith("openrlhf_peer.py")
        orl = _launched_dry(cmd)
        for flag, want in (
            ("--rollout.batch_size", "64"),
            ("--rollout.n_samples_per_prompt", "8"),
            ("--rollout.max_new_tokens", "1024"),
            ("--train.batch_size", "512"),
            ("--actor.num_gpus_per_node", "4"),
            ("--ref.num_gpus_per_node", "4"),
            ("--vllm.num_engines", "4"),
            ("--vllm.tensor_parallel_size", "1"),
            ("--ds.zero_stage", "3"),
            ("--algo.advantage.estimator", "group_norm"),
        ):
            assert _value(orl, flag) == want, (side, flag)
        assert "--train.colocate_all" in orl and ("--vllm.enable_sleep" in orl) == (side == "openrlhf-sleep")
        assert _value(orl, "--data.max_samples") == str(8 * 64)  # every step a fresh batch

    (cmd,) = sides["verl"]
    assert cmd[1].endswith("verl_peer.py") and _value(cmd, "--setup") == "lowvar"
    ns = argparse.Namespace(
        size=_value(cmd, "--size"),
        setup="lowvar",
        micro=int(_value(cmd, "--micro")),
        ckpt=True,
        gpu_util=float(_value(cmd, "--gpu_util")),
        lr=1e-6,
        enforce_eager=False,
        legacy=False,
        steps=int(_value(cmd, "--steps")),
        workdir=_value(cmd, "--workdir"),
        extra=cmd[cmd.index("--") + 1 :],
    )
    hydra = dict(o.split("=", 1) for o in verl_peer.overrides(ns, "/w/model", "/w/data.parquet"))  # last wins
    assert hydra["data.train_batch_size"] == "64" and hydra["actor_rollout_ref.rollout.n"] == "8"
    assert hydra["data.max_response_length"] == "1024" and hydra["data.max_prompt_length"] == "512"
    assert (
        hydra["trainer.n_gpus_per_node"] == "4" and hydra["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    )
    assert hydra["actor_rollout_ref.actor.use_kl_loss"] == "true"  # verl's GRPO recipe: reference + low_var_kl


@pytest.mark.parametrize("workload, engines, tp", [("P8", 4, 1), ("P8-tp2", 2, 2)])
def test_dry_p8_runs_ppo_on_four_gpus_and_says_what_cannot_run_it(capsys, workload, engines, tp):
    assert peers.main([workload, "--dry", "--turns", "2", "--peers", "openrlhf,verl,trl"]) == 0
    printed = capsys.readouterr().out
    sides = _sides(printed)
    assert set(sides) == {"ours", "openrlhf-nosleep", "openrlhf-sleep"} and len(sides["ours"]) == 2
    assert "256 prompts x 1" in printed and "<= 1024 new tokens" in printed
    assert "not run: bench/trl_grpo_peer.py runs TRL's GRPOTrainer only" in printed
    assert "not run: bench/verl_peer.py runs verl's GRPO only" in printed
    hybrid = _e2e_command(sides["ours"][0])
    for flag, want in (
        ("--actor_num_gpus_per_node", "4"),
        ("--ref_num_gpus_per_node", "4"),
        ("--critic_num_gpus_per_node", "4"),
        ("--vllm_num_engines", str(engines)),
        ("--vllm_tensor_parallel_size", str(tp)),
        ("--rollout_batch_size", "256"),
        ("--n_samples_per_prompt", "1"),
        ("--generate_max_len", "1024"),
        ("--zero_stage", "3"),
    ):
        assert _value(hybrid, flag) == want, flag
    assert hybrid[3] == "ppo" and "--colocate_all_models" in hybrid
    cmd = sides["openrlhf-sleep"][0]
    orl = _launched_dry(cmd)
    for flag, want in (
        ("--rollout.batch_size", "256"),
        ("--rollout.n_samples_per_prompt", "1"),
        ("--rollout.max_new_tokens", "1024"),
        ("--ds.zero_stage", "3"),
        ("--algo.advantage.estimator", "gae"),  # after the script's group_norm: OpenRLHF's parser keeps the last
        ("--critic.num_gpus_per_node", "4"),
        ("--actor.num_gpus_per_node", "4"),
        ("--vllm.num_engines", str(engines)),
        ("--vllm.tensor_parallel_size", str(tp)),
    ):
        assert _value(orl, flag) == want, flag
    assert _value(orl, "--critic.model_name_or_path") == os.path.join(_value(cmd, "--workdir"), "model")
    assert "--vllm.enable_sleep" in orl and "--ds.enable_sleep" in orl


def test_a_ppo_workload_refuses_the_peers_that_cannot_run_it(capsys):
    with pytest.raises(SystemExit):
        pr.parse(["--workload", "P8", "--peers", "trl-default"])
    assert "P8 cannot run trl-default: bench/trl_grpo_peer.py" in capsys.readouterr().err


def test_the_environment_block_prints_absent_packages_as_none(monkeypatch, capsys):
    got = peers.versions(["pytest", "surely-no-such-package-xyz"])
    assert got["pytest"] and got["surely-no-such-package-xyz"] is None
    monkeypatch.setattr(peers, "_smi", lambda query: [])
    monkeypatch.setattr(peers, "_driver_cuda", lambda: None)
    monkeypatch.setattr(peers, "_torch_cuda", lambda: None)
    monkeypatch.setattr(peers, "versions", lambda names, env=None: dict.fromkeys(names))
    args, _ = peers.parse(["G7"])
    env = peers.environment(args, {"openrlhf": None, "verl": None, "trl": None})
    peers.print_environment(env)
    printed = capsys.readouterr().out
    for key in (
        "gpu",
        "driver",
        "cuda_driver",
        "cuda_torch",
        *peers.PACKAGES,
        "peer openrlhf",
        "peer verl",
        "peer trl",
    ):
        assert env[key] is None, key
        assert any(line.split() == [*key.split(), "None"] for line in printed.splitlines()), key
    assert env["gpu_count"] == 0 and env["python"] and env["hybrid_code"]


def test_without_a_gpu_the_run_stops_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(peers, "_smi", lambda query: [])
    assert peers.main(["G7", "--peers", "trl"]) == 2
    assert "no GPU here" in capsys.readouterr().err


def test_runs_as_a_module_from_the_repo_root():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers", "P8", "--dry", "--turns", "1", "--peers", "openrlhf"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "environment" in proc.stdout and "[openrlhf-sleep]" in proc.stdout


# Stand-ins for ours, OpenRLHF and verl (ROLE set per file): each reports fake steps in its program's own format --
# ours e2e_gpu.py's JSON (fake step-end wall times), OpenRLHF openrlhf_peer.py's JSON (steady times on its clock),
# verl its echoed step lines (really SLEEP_S apart: peer_ratio times their arrival) and verl_peer.py's JSON.
STANDIN = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, os.environ["STANDIN_BENCH"])
    argv = sys.argv[1:]
    value = lambda flag: argv[argv.index(flag) + 1]
    steps, warmup, out = int(value("--steps")), int(value("--warmup")), os.environ["OUT"]
    open(os.environ["STANDIN_LOG"], "a").write(ROLE + " " + " ".join(argv) + "\\n")
    if ROLE == "ours":
        import e2e_gpu
        ends = [100.0 + k for k in range(steps)]  # 1.0 s a step
        metrics = os.path.join(out, "fake-metrics.jsonl")
        with open(metrics, "w") as f:
            for end in ends:
                f.write(json.dumps({"time/step": 0.5, "wall_time": end, "reward": 0.0, "response_len": 4}) + "\\n")
        name = f"e2e-{value('--algo')}-{value('--size')}-colocated-{value('--tag')}.json"
        json.dump({"rc": 0, **e2e_gpu.summarize(metrics, warmup)}, open(os.path.join(out, name), "w"))
    elif ROLE == "openrlhf":
        sleep = "--no_sleep" not in argv
        res = {"openrlhf": "standin", "warmup": warmup, "sleep": sleep,
               "steady_step_s": [1.5 if sleep else 1.25] * (steps - warmup)}
        json.dump(res, open(os.path.join(out, f"openrlhf-{value('--size')}-x.json"), "w"))
    else:
        for k in range(1, steps + 1):
            time.sleep(float(os.environ["SLEEP_S"]))
            print(f"(TaskRunner pid=1) step:{k} - timing_s/step:9.0 - timing_s/gen:1.0", flush=True)
        res = {"verl": "standin", "warmup": warmup, "step_s": 9.0, "steps": steps}
        json.dump(res, open(os.path.join(out, f"verl-{value('--size')}-{value('--setup')}.json"), "w"))
""")


def test_a_whole_run_through_peers_py_with_stand_ins_lists_the_missing_peer_and_makes_the_rows(
    tmp_path, capsys, monkeypatch
):
    scripts = []
    for role in ("ours", "openrlhf", "verl"):
        path = tmp_path / f"standin_{role}.py"
        path.write_text(f"ROLE = {role!r}\n" + STANDIN)
        scripts.append(f"--script={role}={path}")
    workdir = tmp_path / "wd"
    (workdir / "model").mkdir(parents=True)
    (workdir / "model" / "config.json").write_text("{}")  # the folder exists: only the prompts are written
    monkeypatch.setenv("STANDIN_BENCH", str(BENCH))
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "calls.log"))
    monkeypatch.setenv("SLEEP_S", "0.2")
    real = peers.versions
    monkeypatch.setattr(  # TRL absent here, whatever this Python holds
        peers, "versions", lambda names, env=None: {**real(names, env), **({"trl": None} if "trl" in names else {})}
    )
    results = tmp_path / "RESULTS.md"
    monkeypatch.setenv("BENCH_RESULTS", str(results))
    out = tmp_path / "out"
    argv = ["G7", "--peers", "openrlhf,verl,trl", "--small", "--backend", "hf", "--workdir", str(workdir)]
    argv += ["--out", str(out), "--run_timeout", "120", *scripts]
    rc = peers.main(argv)
    printed = capsys.readouterr().out

    assert rc == 0, printed
    calls = [line.split()[0] for line in (tmp_path / "calls.log").read_text().splitlines()]
    sides = ["ours", "openrlhf", "openrlhf", "verl"]
    assert calls == sides + sides[::-1] + sides  # three turns, the order alternating; TRL never started
    assert sum(1 for _ in open(workdir / "prompts.jsonl")) == 8 * 64  # prompts for every step of 64
    listed = printed.split("\npeers\n")[1].split("\n\n")[0].splitlines()  # the peers list above the plan
    assert [ln.split()[0] for ln in listed] == ["openrlhf", "verl", "trl"]
    assert listed[2].split()[1:] == ["-", "not", "installed"] and "openrlhf-nosleep, openrlhf-sleep" in listed[0]
    env_at = printed.rindex("\nenvironment")
    table_at = printed.index("peer ratios, G7")
    assert env_at < table_at and "peer trl" in printed[env_at:table_at]  # the environment right above the table

    data = json.loads((out / "peer_ratio-G7.json").read_text())
    assert data["sides"] == ["ours", "openrlhf-nosleep", "openrlhf-sleep", "verl"]
    assert data["peers_status"] == {"trl": "not installed"} and data["environment"]["peer verl"] == "stand-in"
    assert data["command"].startswith("python bench/peers.py G7")
    rows = {r.metric: r for r in pr.ratio_rows(data)[0]}
    assert rows["speedup vs OpenRLHF G7 nosleep x"].value == pytest.approx(1.25)
    assert rows["speedup vs OpenRLHF G7 sleep x"].value == pytest.approx(1.5)
    best = rows["speedup vs OpenRLHF G7 x"]
    assert best.value == pytest.approx(1.25) and "OpenRLHF nosleep x3" in best.unit  # the faster setting each turn
    assert rows["speedup vs verl G7 x"].value == pytest.approx(0.2, abs=0.05)  # step lines' arrival, not its 9.0
    trl_line = next(ln for ln in printed.splitlines() if ln.startswith("speedup vs TRL G7 x"))
    assert "not installed" in trl_line and "(not recorded)" in trl_line
    assert peers.main([*argv, "--record"]) == 2  # stand-ins and --small: never recorded
    assert not results.exists()
