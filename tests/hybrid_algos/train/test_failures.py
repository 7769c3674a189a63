"""A run whose role hangs or dies ends with a named error, in time, with stacks and a checkpoint to resume from.

Real runs on one local Ray (a fake GPU): the hang and the trainer's death are injected with ``HYBRID_FAULT`` (the
worker itself hangs or exits in the named phase); the engine is SIGKILLed from here, found by a tag in its
environment so no other process is touched.
"""

import os
import signal
import threading
import time
import uuid

import pytest
from tiny_runs import tiny_config, worker_pids

from hybrid_algos.train import train
from hybrid_algos.train.checkpoint import CheckpointManager
from hybrid_core.errors import RemoteTimeout, RoleFailure
from timing_bounds import HANG_S, RUN_HANG_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.usefixtures("one_gpu_ray")]


class _StepTimes:
    def __init__(self):
        self.last = None

    def on_step(self, metrics):
        self.last = time.monotonic()


def test_hang_is_reported_within_the_step_budget_with_stacks(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_FAULT", "actor:train:hang:2")  # the actor hangs in step 2's update
    budget = 12.0
    steps = _StepTimes()
    with pytest.raises(RemoteTimeout) as info:
        train(tiny_config(tmp_path, max_steps=3, save_steps=1, step_timeout_s=budget), callbacks=[steps])
    waited = time.monotonic() - steps.last
    message = str(info.value)
    # role, phase and rank of the late call, the step and its budget, the stacks and the checkpoint
    assert "actor rank 0: train" in message and "step 2" in message and f"{budget:g} s budget" in message
    assert "stacks" in message and "step-00000001" in message and "--resume" in message
    assert waited < budget + HANG_S, f"reported {waited:.0f} s after the last good step"  # the budget fired (above)
    logs = tmp_path / "logs"
    actor_stacks = (logs / "stacks-actor-0.txt").read_text()
    assert "in maybe_inject" in actor_stacks  # the dump shows where the actor hangs
    assert (logs / "stacks-reference-0.txt").read_text().strip()  # every role's stacks, not only the late one
    engine_pid = int((logs / "stacks-index.txt").read_text().split("pid ")[1].split()[0])
    assert "File " in (logs / f"stacks-pid{engine_pid}.txt").read_text()  # the engine answered the signal
    _path, step = CheckpointManager(str(tmp_path / "checkpoints")).latest()
    assert step == 1


def test_trainer_death_ends_the_run_and_resume_continues(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_FAULT", "actor:train:die:2")  # the actor's process exits in step 2
    start = time.monotonic()
    with pytest.raises(RoleFailure) as info:
        train(tiny_config(tmp_path, max_steps=3, save_steps=1))
    message = str(info.value)
    assert "actor rank 0: train" in message and "died" in message and "step 2" in message
    assert time.monotonic() - start < RUN_HANG_S  # "died": the death ended it, not the step budget

    monkeypatch.delenv("HYBRID_FAULT")
    summary = train(tiny_config(tmp_path, max_steps=2, save_steps=1, resume=True))
    assert summary["start_step"] == 1 and len(summary["history"]) == 2
    assert CheckpointManager(str(tmp_path / "checkpoints")).latest()[1] == 2
    assert os.path.isfile(os.path.join(summary["final_model"], "config.json"))


def test_killed_engine_ends_the_run_within_60_s(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv("HYBRID_TEST_TAG", tag)  # forwarded to every worker (HYBRID_ prefix)
    killed = {}

    def saved_from_step_2():
        # any finished checkpoint of step >= 2: one exists only until 3 newer ones are saved (~0.3 s on CPU)
        return [p for p in (tmp_path / "checkpoints").glob("step-*/COMPLETE.json") if int(p.parent.name[5:]) >= 2]

    def kill_engine_after_second_checkpoint():
        deadline = time.monotonic() + 240
        while not saved_from_step_2() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = worker_pids(tag, "EngineActor")
        if len(pids) == 1:
            os.kill(pids[0], signal.SIGKILL)
            killed["at"] = time.monotonic()

    killer = threading.Thread(target=kill_engine_after_second_checkpoint, daemon=True)
    killer.start()
    with pytest.raises(RoleFailure) as info:
        train(tiny_config(tmp_path, max_steps=100000, save_steps=1))
    ended = time.monotonic()
    killer.join(timeout=5)
    assert "at" in killed, "the engine process was not found"
    assert ended - killed["at"] < HANG_S  # "died" (below): the death ended it, not the 120 s step budget
    assert "rollout engine 0" in str(info.value) and "died" in str(info.value)
    path, step = CheckpointManager(str(tmp_path / "checkpoints")).latest()
    assert step >= 2 and os.path.isfile(os.path.join(path, "actor", "state", "mp_rank_00_model_states.pt"))
