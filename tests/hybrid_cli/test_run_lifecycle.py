"""A run's life as the command line sees it: never silently destroyed, continued as the README says, and every way
it can end after the start -- a reward function that raises or hangs, SIGTERM, the Ray GCS dying -- ends with one
``hybrid:`` line naming what happened and the checkpoint to continue from, and nothing left running.

Real runs of ``hybrid grpo`` (the built-in demo model, one local Ray with a fake GPU); SIGTERM and the GCS kill are
sent to a driver started as a subprocess, whose processes are found by a tag in their environment.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from hybrid_cli.main import main
from timing_bounds import HANG_S, RUN_HANG_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SMALL = [
    "--task_length",
    "1",
    "--rollout_batch_size",
    "4",
    "--n_samples_per_prompt",
    "2",
    "--train_batch_size",
    "8",
    "--micro_train_batch_size",
    "8",
    "--seed",
    "7",
    "--no_use_tensorboard",
]


@pytest.fixture(scope="module", autouse=True)
def _ops_built():
    from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

    ensure_cpu_ops_built()  # a fresh clone compiles DeepSpeed's CPU ops once: not these tests' subject


def _steps(run):
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line)["step"] for line in f]


def _checkpoints(run):
    folder = run / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_run_is_continued_as_the_readme_says_and_never_silently_replaced(tmp_path, capsys):
    run = tmp_path / "demo"
    # OpenRLHF's --load_checkpoint on a first launch: nothing to load, so a fresh start (not an error)
    assert main(["grpo", "--max_steps", "2", "--save_path", str(run), "--load_checkpoint", *SMALL]) == 0
    assert _steps(run) == [0, 1]
    assert _checkpoints(run) == ["latest.json", "step-00000002"]  # resumable by default (no --save_steps given)
    summary = json.loads((run / "summary.json").read_text())
    assert os.path.isdir(summary["checkpoint_dir"]) and os.path.isdir(summary["last_checkpoint"])
    capsys.readouterr()

    # the same command again: refused, the earlier run untouched
    before = (run / "metrics.jsonl").read_text()
    assert main(["grpo", "--max_steps", "2", "--save_path", str(run), *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid: error: save_path:") and "--resume" in err and "--overwrite" in err
    assert (run / "metrics.jsonl").read_text() == before and _checkpoints(run) == ["latest.json", "step-00000002"]

    # the README's next line: continue to a later step
    assert main(["grpo", "--max_steps", "3", "--save_path", str(run), "--resume", *SMALL]) == 0
    assert _steps(run) == [0, 1, 2]
    assert _checkpoints(run) == ["latest.json", "step-00000002", "step-00000003"]

    # --overwrite: the old run is removed first, nothing of it mixes with the new one
    assert (
        main(["grpo", "--max_steps", "1", "--save_path", str(run), "--overwrite", "--no_final_checkpoint", *SMALL]) == 0
    )
    assert _steps(run) == [0] and _checkpoints(run) == []
    assert "checkpoint_dir" not in json.loads((run / "summary.json").read_text())


def _reward_file(tmp_path, body):
    """A reward file whose ``score`` runs ``body`` from its 2nd call (step 2) on; before that it scores 0."""
    path = tmp_path / "my_reward.py"
    counter = tmp_path / "calls"
    path.write_text(
        "import os, time\n"
        "def score(prompts, completions, **kwargs):\n"
        f"    with open({str(counter)!r}, 'a') as f:\n"
        "        f.write('x')\n"
        f"    if os.path.getsize({str(counter)!r}) >= 2:\n"
        f"        {body}\n"
        "    return [0.0] * len(completions)\n"
    )
    return f"{path}:score"


def test_a_reward_function_that_raises_ends_the_run_with_the_checkpoint_to_resume(tmp_path, capsys):
    run = tmp_path / "run"
    reward = _reward_file(tmp_path, "return [1.0 / 0 for c in completions]")
    assert (
        main(["grpo", "--max_steps", "3", "--save_steps", "1", "--save_path", str(run), "--reward_fn", reward, *SMALL])
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hybrid: RewardError: step 2 failed: the reward function") and "ZeroDivisionError" in err
    assert "my_reward.py:6" in err  # where it raised
    assert "step-00000001 (step 1): continue with --resume" in err


def test_a_reward_function_that_hangs_is_caught_by_the_step_budget(tmp_path, capsys):
    run = tmp_path / "run"
    reward = _reward_file(tmp_path, "time.sleep(3600)")
    start = time.monotonic()
    assert (
        main(
            [
                "grpo",
                "--max_steps",
                "3",
                "--save_steps",
                "1",
                "--save_path",
                str(run),
                "--reward_fn",
                reward,
                "--step_timeout_s",
                "20",
                *SMALL,
            ]
        )
        == 1
    )
    took = time.monotonic() - start
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hybrid: RewardTimeout: step 2 failed: the reward function")
    assert "within the 20 s budget of step 2" in err and "my_reward.py:6 in score" in err
    assert "stacks-driver.txt" in err or "stacks-*.txt" in err
    assert "my_reward.py" in (run / "logs" / "stacks-driver.txt").read_text()
    assert "step-00000001 (step 1)" in err
    assert took < RUN_HANG_S, f"{took:.0f} s"  # the 20 s step budget ended it (above)


# ---- signals and a lost cluster, on a driver in its own process ------------------------------------------------------
def _start(run, tag, *extra):
    env = {**os.environ, "HYBRID_TEST_TAG": tag, "PYTHONUNBUFFERED": "1"}
    # a tiny step takes ~0.1 s on CPU: enough steps that the run is still going when the signal is sent
    argv = [
        sys.executable,
        "-m",
        "hybrid_cli",
        "grpo",
        "--max_steps",
        "1000000",
        "--save_steps",
        "1",
        "--save_path",
        str(run),
        *SMALL,
        *extra,
    ]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _wait_for_checkpoint(proc, run, timeout=300):
    # any finished checkpoint: with --save_steps 1 and 3 kept, step 1's is pruned ~0.3 s after it is written
    deadline = time.monotonic() + timeout
    while not list((run / "checkpoints").glob("step-*/COMPLETE.json")):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)


def _tagged(tag, name=b""):
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                tagged = f"HYBRID_TEST_TAG={tag}".encode() in f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if tagged and name in cmdline and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def _kill_tagged(tag):
    for pid in _tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigterm_ends_the_run_like_ctrl_c(tmp_path):
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = _start(run, tag)
    try:
        _wait_for_checkpoint(proc, run)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode == 143, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("hybrid: terminated (SIGTERM): the run stopped") and "--resume" in last, err
        assert "SIGTERM received" not in err and "*** " not in err  # no C++ crash dump from Ray
        deadline = time.monotonic() + 30
        while _tagged(tag) and time.monotonic() < deadline:  # Ray's processes end with the driver
            time.sleep(0.5)
        assert not _tagged(tag), "processes of the run are still alive"
        assert not [p for p in os.listdir(run / "checkpoints") if p.startswith(".tmp")]
        assert not [p for p in os.listdir(run) if ".tmp-" in p]
    finally:
        _kill_tagged(tag)


def test_a_dead_gcs_ends_the_run_at_once_with_a_hybrid_line(tmp_path):
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = _start(run, tag)
    try:
        _wait_for_checkpoint(proc, run)
        (gcs,) = _tagged(tag, b"gcs_server")
        os.kill(gcs, signal.SIGKILL)
        killed = time.monotonic()
        err = proc.communicate(timeout=120)[1]
        took = time.monotonic() - killed
        assert proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("hybrid: ClusterLost: Ray's GCS") and "--resume" in last, err
        assert took < HANG_S, f"{took:.0f} s"  # ClusterLost: the watch ended it (Ray alone gives up after 60 s)
    finally:
        _kill_tagged(tag)
