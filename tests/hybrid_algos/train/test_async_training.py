"""Asynchronous training end to end on a real local Ray cluster (two fake GPUs), the built-in engine and DeepSpeed:
one-step-off-policy on shared GPUs, the staleness bound, N-step-off with partial rollouts on split GPUs, a resumed
run that continues exactly, and learning parity with the synchronous loop."""

from __future__ import annotations

import math
import os
import statistics
import time

import pytest
from tiny_runs import tiny_config

from hybrid_algos.train import CONFIGS, train
from hybrid_algos.train.checkpoint import CheckpointManager
from hybrid_algos.train.config import DEMO_SETTINGS
from hybrid_core import runtime_env
from hybrid_engines import registry
from timing_bounds import RUN_HANG_S

pytestmark = pytest.mark.usefixtures("two_gpu_ray")


def _comparable(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and k != "async/wait_s"}


def test_one_step_off_on_shared_gpus_keeps_the_bound_and_corrects_the_gap(tmp_path):
    summary = train(tiny_config(tmp_path / "run", max_steps=4, async_train=True))
    assert summary["async"]["mode"] == "shared"  # the tiny run fits: engine and trainer together on the GPU
    assert not summary["residency"].sleeps("rollout")
    history = summary["history"]
    for step, m in enumerate(history):
        # batch k+1 is generated with the weights of step k's start: version max(0, step - 1), one version old
        assert m["async/generation_version"] == max(0, step - 1)
        assert m["async/staleness_max"] == min(step, 1) <= 1
    # one version old, the trainer's log-probs are not the engine's: the correction sees (and weights) the gap
    assert history[0]["mismatch/ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert any(abs(m["mismatch/ratio_max"] - 1.0) > 0.01 for m in history[1:])


def test_shared_gpus_where_the_engine_must_sleep_take_turns_and_say_so(tmp_path):
    summary = train(tiny_config(tmp_path / "run", max_steps=2, async_train=True, vllm_enable_sleep=True))
    assert summary["async"]["mode"] == "sync" and "synchronous turns" in summary["async"]["note"]
    assert any("synchronous turns" in n for n in summary["residency"].notes)  # in residency.json too
    assert summary["residency"].sleeps("rollout")
    assert all("async/staleness_max" not in m and m["bytes/sleep"] > 0 for m in summary["history"])


@pytest.fixture
def paced_engine(monkeypatch):
    """The ``hf-paced`` backend (paced_engine.py), importable by the engine actor; the registry as it was after."""
    monkeypatch.setattr(registry, "BACKENDS", dict(registry.BACKENDS))
    monkeypatch.setattr(runtime_env, "_extra", dict(runtime_env._extra))
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    registry.register_engine("hf-paced", "paced_engine:PacedHFEngine")
    return "hf-paced"


def test_partial_rollouts_on_split_gpus_with_two_steps_of_staleness(tmp_path, paced_engine):
    """Every generation after the first is still running when the trainer's weight update comes (the paced engine
    holds it after its first token until then, so the machine's speed does not decide): it is paused, the weights go
    over, and it resumes with them."""
    summary = train(
        tiny_config(
            tmp_path / "run",
            backend=paced_engine,
            max_steps=5,
            async_train=True,
            async_max_staleness=2,
            partial_rollout=True,
            colocate_all_models=False,
            vllm_num_engines=1,
            init_kl_coef=0.0,
            task_length=16,
        )
    )
    assert summary["async"]["mode"] == "split" and summary["plan"].num_gpus == 2
    history = summary["history"]
    ages = [m["async/staleness_max"] for m in history]
    assert ages[0] == 0 and max(ages) <= 2, ages  # the bound holds for the oldest token of every sample
    for step, m in enumerate(history):
        assert m["async/generation_version"] >= step - 2
    # the updates after steps 1..4 each found a generation running (batches 2..5) and paused it
    paused = [m["async/paused_generation"] for m in history]
    assert paused[:4] == [1.0] * 4, paused
    # batches 2..5 were finished with newer weights: every sample holds tokens of two versions
    mixed = [m["async/mixed_version_samples"] for m in history]
    assert mixed[0] == 0 and all(x > 0 for x in mixed[1:]), mixed


def test_resume_continues_exactly_as_the_uninterrupted_run(tmp_path):
    class Stop(Exception):
        pass

    class StopAfterCheckpoint:
        def on_step(self, metrics):
            if metrics["step"] == 2:  # the checkpoint after step 2 (next step 2) is saved: stop as if killed
                raise Stop

    settings = dict(max_steps=4, save_steps=2, async_train=True)
    straight = train(tiny_config(tmp_path / "straight", **settings))
    with pytest.raises(Stop):
        train(tiny_config(tmp_path / "cut", **settings), callbacks=[StopAfterCheckpoint()])
    ckpt = CheckpointManager(str(tmp_path / "cut" / "checkpoints"))
    path, next_step = ckpt.latest()
    queued = ckpt.load_driver_state(path)["async_queue"]
    assert next_step == 2 and [b["step"] for b in queued] == [2]  # batch 2, generated while step 1 trained
    resumed = train(tiny_config(tmp_path / "cut", **settings, resume=True))
    assert resumed["start_step"] == 2 and len(resumed["history"]) == 4
    for a, b in zip(resumed["history"], straight["history"]):
        assert _comparable(a) == _comparable(b)


#: The learning test's demo settings (GRPO on the copy task, cosine decay), shorter. Measured on 2 cores, the step
#: where two consecutive rewards first average >= 0.9 (sync / async): seed 2 13 / 13, seed 3 16 / 18 (the allowance
#: is 20); seed 1, the one tested, passes too.
PARITY = {**DEMO_SETTINGS, "max_steps": 24, "final_checkpoint": False, "call_timeout_s": 300}
BAR = 0.9


def _first_crossing(rewards, bar):
    """The first step (1-based) where the mean of two consecutive steps reaches ``bar`` (one lucky step is not it)."""
    return next((i + 1 for i in range(1, len(rewards)) if (rewards[i - 1] + rewards[i]) / 2 >= bar), None)


@pytest.mark.slow
def test_async_learns_as_fast_as_sync_within_a_fifth_more_steps(tmp_path):
    sync = train(CONFIGS["grpo"](save_path=str(tmp_path / "sync"), seed=1, **PARITY))
    run = train(CONFIGS["grpo"](save_path=str(tmp_path / "async"), seed=1, async_train=True, **PARITY))
    assert run["async"]["mode"] == "shared"
    rewards = {name: [m["reward"] for m in s["history"]] for name, s in (("sync", sync), ("async", run))}
    final = statistics.mean(rewards["sync"][-4:])  # the synchronous run's final reward
    bar = min(BAR, final - 0.03)
    crossed = {name: _first_crossing(r, bar) for name, r in rewards.items()}
    shown = {name: [round(x, 2) for x in r] for name, r in rewards.items()}
    assert crossed["sync"] is not None, shown
    assert crossed["async"] is not None and crossed["async"] <= math.ceil(1.2 * crossed["sync"]), (crossed, shown)
    assert all(m["async/staleness_max"] <= 1 for m in run["history"])


def test_a_stalled_producer_ends_the_run_naming_the_rollout_and_the_step(tmp_path, monkeypatch):
    from hybrid_core.errors import RemoteTimeout

    monkeypatch.setenv("HYBRID_FAULT", "rollout:generate:hang:3")  # the engine hangs generating batch 3 (step 3)
    budget = 12.0
    start = time.monotonic()
    with pytest.raises(RemoteTimeout) as info:
        train(tiny_config(tmp_path / "run", max_steps=4, async_train=True, step_timeout_s=budget, call_timeout_s=30))
    message = str(info.value)
    assert "rollout" in message and "step 3" in message and "generat" in message, message
    assert "stacks" in message  # every role's stacks, as for any late call
    assert time.monotonic() - start < RUN_HANG_S  # the budget ended it (above); this only catches a hang
