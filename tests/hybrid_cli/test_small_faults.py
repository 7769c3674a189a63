"""Smaller faults (issue 35, item 9), each checked on the function that decides:

* a reward function calling ``os._exit(0)`` ended the run with status 0 and no summary, as if it had completed;
* a symlink loop in a prompts folder read one file 41 times;
* ``--dry-run`` verdicts untrue to the numbers beside them ("peak 78.50 GiB ok" against 73.6 usable; "123.0 GiB of
  13.0 GiB available, tight");
* the install hint lost its ``[vllm]`` extra (rich markup);
* step numbers 0-based in the progress lines, 1-based in errors, checkpoint names and ``--profile_step``.
"""

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

from hybrid_algos.train.recipes import PPO
from hybrid_core.errors import PlacementError
from hybrid_core.residency import GiB, GpuShare, HostBudget, RoleSize
from hybrid_core.residency import plan_residency as core_plan_residency


def plan_residency(layout, gpu_bytes, **kw):  # PPO's step (core takes the phases as input)
    return core_plan_residency(layout, gpu_bytes, phases=PPO.residency_phases(), **kw)


# ---- a reward function that calls os._exit ---------------------------------------------------------------------------
REWARD_EXITS = textwrap.dedent("""
    import multiprocessing, os, sys
    from types import SimpleNamespace as NS
    from hybrid_algos.train.rewards import RewardError, RewardScorer

    def child():
        pass

    def forks(prompts, completions, **kwargs):  # multiprocessing's child ends with os._exit: that still works
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
        process.join()
        return [float(process.exitcode)] * len(completions)

    def exits(prompts, completions, **kwargs):
        os._exit(0)

    prompts, outputs = [NS(text="p", prompt_ids=[1], label=None)], [[NS(token_ids=[2, 3])]]
    decode = lambda ids: " ".join(map(str, ids))
    print("scores", RewardScorer(forks, decode).score(prompts, outputs).tolist(), flush=True)
    try:
        RewardScorer(exits, decode, name="my_reward.exits").score(prompts, outputs)
    except RewardError as e:
        print("RewardError:", e, flush=True)
        os._exit(3)  # the driver's own os._exit still ends the process
""")


def test_a_reward_function_calling_os_exit_is_an_error_not_the_end_of_the_run():
    proc = subprocess.run([sys.executable, "-c", REWARD_EXITS], capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 3, out + proc.stderr  # before: 0, the run gone as if complete
    assert "scores [0.0]" in out  # the forked child exited normally (status 0)
    assert "RewardError: the reward function my_reward.exits called os._exit(0) (at <string>:" in out
    assert "with status 0 (0 reads as a completed run), without its checkpoint or summary" in out


# ---- a symlink loop in a prompts folder ------------------------------------------------------------------------------
def _prompts_folder(folder):
    (folder / "part").mkdir(parents=True)
    with open(folder / "part" / "train.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"s{i}"}) + "\n")
    return [f"s{i}" for i in range(64)]


def test_a_prompts_folder_with_a_symlink_loop_is_read_once(tmp_path):
    from hybrid_algos.train.data import read_records

    looped = tmp_path / "looped"
    prompts = _prompts_folder(looped)
    os.symlink("..", looped / "part" / "loop")  # part/loop/part/loop/...: glob went 40 levels deep (41 reads)
    (looped / ".hidden").mkdir()
    (looped / ".hidden" / "old.jsonl").write_text('{"prompt": "not read"}\n')  # hidden: left out, as before
    assert [r["prompt"] for r in read_records(str(looped))] == prompts
    twice = tmp_path / "twice"
    prompts = _prompts_folder(twice)
    os.symlink(twice / "part", twice / "same")  # the same folder under another name: its file read once
    assert [r["prompt"] for r in read_records(str(twice))] == prompts


# ---- dry-run verdicts true to their numbers --------------------------------------------------------------------------
def _size(role, kind, states, exact=()):
    return RoleSize(role, kind, {k: v * GiB for k, v in states.items()}, {}, 0.0, exact=frozenset(exact))


def test_a_gpu_line_shows_the_number_its_verdict_is_for():
    actor = _size("actor", "trainer", {"params": 2, "grads": 2, "optimizer": 4, "cache": 0})
    engine = _size("rollout", "engine", {"weights": 14.5, "kv_cache": 64}, exact=("kv_cache",))  # an exact pool
    plan = plan_residency({0: (GpuShare(actor), GpuShare(engine))}, 80 * GiB, usable=0.92)
    plan.check()  # it fits: the margin is for estimates, not for the pool
    text = plan.render()
    assert "usable 73.6;" in text
    (line,) = [line for line in text.splitlines() if line.strip().startswith("generate")]
    assert "peak   78.50 GiB, counted 73.38 ok" in line  # before: "peak 78.50 GiB ok", over the 73.6 shown
    (train,) = [line for line in text.splitlines() if line.strip().startswith("actor_train")]
    assert "counted" not in train  # no exact pool there: the peak is the number judged
    assert "counted: what the ok / OVER beside it is for, held against the usable 73.6 GiB" in text


def test_a_host_line_over_its_capacity_never_says_tight():
    tiny = _size("actor", "trainer", {"params": 0.1, "grads": 0.1, "optimizer": 0.2, "cache": 0})
    engine = _size("rollout", "engine", {"weights": 0.1, "kv_cache": 0.1})
    layout = {g: (GpuShare(tiny, workers=4), GpuShare(engine, workers=6)) for g in range(4)}  # 41 with the driver
    plan = plan_residency(layout, 80 * GiB, host=HostBudget(13 * GiB, "--host_memory_gb"))
    plan.check()  # the process estimate alone never refuses a plan (hybrid_core.residency.host)
    text = plan.render()
    assert "host (node 0): 123.0 GiB of 13.0 GiB available, over by the process estimate (not refused):" in text
    assert "tight" not in text
    assert "= 123.0 GiB, more than the 13.0 GiB available (--host_memory_gb)" in text  # not "over 90 % of"
    # states that count and the processes over the capacity: refused, and the line says OVER (it said "tight")
    big = _size("actor", "trainer", {"params": 2, "grads": 2, "optimizer": 4, "cache": 0})
    engine = _size("rollout", "engine", {"weights": 14.5, "kv_cache": 64}, exact=("kv_cache",))
    refused = plan_residency(
        {0: (GpuShare(big), GpuShare(engine))}, 80 * GiB, usable=0.92, host=HostBudget(13 * GiB, "--host_memory_gb")
    )
    assert "host (node 0): 17.0 GiB of 13.0 GiB available, OVER:" in refused.render()
    with pytest.raises(PlacementError, match=r"17.0 GiB > 13.0 GiB available") as e:
        refused.check()
    assert e.value.field == "residency.host_memory_gb"  # core's words (the run's boundary says the flag)


# ---- the install hint keeps its extra --------------------------------------------------------------------------------
def test_dry_run_install_hint_keeps_the_vllm_extra(capsys):
    from hybrid_cli.main import main

    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: no hint to print")
    assert main(["grpo", "--dry-run", "--backend", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "warning: the vllm backend needs the 'vllm' package: pip install 'hybrid-engines[vllm]'" in out


# ---- step numbers: 1-based wherever a user reads one -----------------------------------------------------------------
def test_progress_shows_steps_one_based_like_errors_and_checkpoints():
    from hybrid_cli.progress import ProgressDisplay

    console = Console(file=io.StringIO(), width=200)
    display = ProgressDisplay(console)
    display.on_start({"total_steps": 2})
    for step in (0, 1):  # the loop's metrics carry its 0-based index
        display.on_step({"step": step, "reward": 0.5})
    out = console.file.getvalue()
    assert "step 1/2  reward 0.500" in out and "step 2/2  reward 0.500" in out and "step 0/" not in out

    live = ProgressDisplay(Console(file=io.StringIO(), width=200, force_terminal=True), live=True)
    live.on_start({"total_steps": 2})
    for step in (0, 1):
        live.on_step({"step": step, "reward": 0.5})
    assert live._progress.tasks[0].completed == 2  # the bar full after the last step (it stopped at 1 of 2)
    live.close()
