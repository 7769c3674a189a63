"""GRPO learns the copy task with ``--trainer fsdp2``: the actor trained by FSDP2 (gloo, CPU) lifts the reward from
chance to the bar test_learning.py sets for DeepSpeed, through the real loop (local Ray, a fake GPU, the built-in
engine, every role colocated and moving its states between phases). The reward rising proves each step's weights
reach the engine; the checkpoint is DCP's (only FSDP2 writes one), so the run really trained under FSDP2."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from test_learning import BAR, CROSS_BY, HOLD, SETTINGS

from hybrid_algos.train import CONFIGS, train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_gpu_ray")]


def test_grpo_under_fsdp2_learns_the_copy_task(tmp_path) -> None:
    steps = SETTINGS["max_steps"]
    config = CONFIGS["grpo"](save_path=str(tmp_path / "grpo"), seed=1, trainer="fsdp2", save_steps=steps, **SETTINGS)
    summary = train(config)

    rewards = [m["reward"] for m in summary["history"]]
    shown = [round(r, 2) for r in rewards]
    assert len(rewards) == steps and rewards[0] <= 0.2, shown
    crossed = next((i + 1 for i, r in enumerate(rewards) if r >= BAR), None)
    assert crossed is not None and crossed <= CROSS_BY, f"reward >= {BAR} first at step {crossed} ({shown})"
    assert statistics.mean(rewards[-HOLD:]) >= BAR, shown
    # the actor slept and woke every step (FSDP2Offloader), on the cosine schedule DeepSpeed would have run
    assert summary["residency"].sleeps("actor")
    assert all(m["bytes/sleep"] > 0 and m["bytes/wake"] > 0 for m in summary["history"])
    lrs = [m["actor/lr"] for m in summary["history"]]
    assert lrs[0] == pytest.approx(config.actor_learning_rate, rel=0.05)
    assert lrs[-1] == pytest.approx(config.actor_learning_rate * config.min_lr_ratio, rel=0.1)
    # the actor's checkpoint is torch.distributed.checkpoint's: shards plus the .metadata written last
    assert list(Path(config.save_path).rglob("actor/**/.metadata")), sorted(Path(config.save_path).rglob("*"))
