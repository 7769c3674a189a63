"""SIGTERM is preemption, and a role that dies while the run starts ends it: real ``hybrid grpo`` runs (the demo's
tiny model, one local Ray with a fake GPU) in a driver of their own, whose processes are found by a tag in their
environment. Also what an interrupted run says it left (unit level)."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from test_run_lifecycle import SMALL, _kill_tagged, _tagged


def _driver(run, tag, *extra, fault=None):
    env = {**os.environ, "HYBRID_TEST_TAG": tag, "PYTHONUNBUFFERED": "1"}
    env.pop("HYBRID_FAULT", None)
    if fault:
        env["HYBRID_FAULT"] = fault
    argv = [sys.executable, "-m", "hybrid_cli", "grpo", "--save_path", str(run), *SMALL, *extra]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # its own process group, as under a shell or a scheduler


def _none_left(tag, seconds=20):
    deadline = time.monotonic() + seconds
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not _tagged(tag)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_the_process_group_saves_a_checkpoint_and_exits_143(tmp_path):
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    # no periodic checkpoint: the one found afterwards is the one SIGTERM saved
    proc = _driver(run, tag, "--max_steps", "1000000", "--save_steps", "100000")
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no step finished in time"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # what SLURM, systemd and `kill -- -PGID` send
        sent = time.monotonic()
        err = proc.communicate(timeout=120)[1]
        took = time.monotonic() - sent
        assert proc.returncode == 143, err
        assert took < 30, f"{took:.0f} s"
        last = err.strip().splitlines()[-1]
        assert last.startswith("hybrid: terminated (SIGTERM): the run stopped"), err
        steps = [p.name for p in (run / "checkpoints").glob("step-*") if (p / "COMPLETE.json").exists()]
        assert len(steps) == 1, steps
        step = int(steps[0][5:])
        assert step >= 1 and f"{steps[0]} (step {step}): continue with --resume" in last, last
        assert "Failed to connect to GCS" not in err and "*** " not in err
        assert _none_left(tag), f"processes of the run are still alive: {_tagged(tag)}"
    finally:
        _kill_tagged(tag)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_engine_that_dies_being_built_ends_the_run_naming_it_and_leaves_nothing(tmp_path):
    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    start = time.monotonic()
    proc = _driver(run, tag, "--max_steps", "2", fault="rollout:create:die")
    try:
        err = proc.communicate(timeout=400)[1]
        assert time.monotonic() - start < 300  # the whole start-up on 2 CPU cores; the death itself: seconds
        assert proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        # the role, its GPU, and the last line the dying process wrote
        assert last.startswith(
            "hybrid: RoleFailure: start-up failed: rollout engine 0: start on GPU 0: the actor died"
        ), last
        assert "injected fault (HYBRID_FAULT): rollout rank 0 exits in create" in last, last
        assert _none_left(tag), f"processes of the run are still alive: {_tagged(tag)}"
    finally:
        _kill_tagged(tag)


def test_an_interrupt_after_the_final_model_says_what_was_saved_and_where(tmp_path):
    from hybrid_algos.train.checkpoint import CheckpointManager
    from hybrid_algos.train.failures import saved_hint

    run = tmp_path / "run"
    started = time.time()
    ckpt = CheckpointManager(str(run / "checkpoints"))
    assert saved_hint(ckpt, str(run), since=started).startswith("No checkpoint was saved yet")
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    hint = saved_hint(ckpt, str(run), since=started)
    assert hint.startswith(f"The final model was saved: {run / 'final'}") and "No checkpoint was saved yet" not in hint
    assert saved_hint(ckpt, str(run), since=time.time() + 60).startswith("No checkpoint")  # an earlier run's final

    import hybrid_cli.main as cli

    class Config:
        checkpoint_dir = str(run / "checkpoints")
        save_path = str(run)

    old = cli._current_config, cli._started_at
    cli._current_config, cli._started_at = Config(), started
    try:
        assert f"The final model was saved: {run / 'final'}" in cli._resume_line()
    finally:
        cli._current_config, cli._started_at = old
