"""``--profile_step N``: step N of a real run (real Ray with a fake GPU, DeepSpeed, the built-in engine) under the
torch profiler in every trainer worker and cProfile on the driver; the tables and traces land in the run folder."""

from __future__ import annotations

import json
import os

import pytest
from tiny_runs import TINY

from hybrid_algos.train import GRPOConfig, train
from hybrid_core.errors import ConfigError


def test_a_negative_or_boolean_profile_step_is_refused():
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError, match="profile_step"):
            GRPOConfig(profile_step=bad).validate()


def test_a_profile_step_past_the_run_is_refused_before_ray(tmp_path):
    with pytest.raises(ConfigError, match="profile_step") as e:
        train(GRPOConfig(save_path=str(tmp_path / "run"), **{**TINY, "max_steps": 2}, profile_step=3))
    assert "last step (2)" in str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_profiled_step_leaves_tables_and_traces_of_every_trainer_worker(tmp_path, one_gpu_ray):
    summary = train(
        GRPOConfig(save_path=str(tmp_path / "run"), **{**TINY, "max_steps": 2}, init_kl_coef=0.01, profile_step=2)
    )
    folder = os.path.join(summary["run_dir"], "profile", "step2")
    names = sorted(os.listdir(folder))
    assert names == ["actor-0.trace.json", "actor-0.txt", "driver.txt", "reference-0.trace.json", "reference-0.txt"]
    actor = open(os.path.join(folder, "actor-0.txt")).read()
    assert "aten::" in actor and "by host time" in actor  # the actor's training ops of that step
    assert "aten::" in open(os.path.join(folder, "reference-0.txt")).read()
    assert "run_step" in open(os.path.join(folder, "driver.txt")).read()
    trace = json.load(open(os.path.join(folder, "actor-0.trace.json")))
    assert trace["traceEvents"]
    assert not os.path.exists(os.path.join(summary["run_dir"], "profile", "step1"))
    assert len(summary["history"]) == 2
