"""The role workers are built from the run's sections (``TrainSettings``), not the flat config: what a worker reads is
the section it was given, so a section changed after the config (the planner's ``with_changes``) is what it runs."""

from __future__ import annotations

import torch

from hybrid_algos.train.config import PPOConfig
from hybrid_algos.train.workers.frozen import ReferenceWorker


def test_a_worker_reads_the_sections_it_is_given(tmp_path):
    settings = PPOConfig(zero_stage=2, seed=5).settings()
    changed = settings.with_changes(trainer={"zero_stage": 3}, run={"seed": 11})
    worker = ReferenceWorker("reference", 1, 2, changed, str(tmp_path))
    assert not hasattr(worker, "config")  # no flat config below the CLI
    assert worker.settings is changed and worker.trainer is changed.trainer and worker.algorithm is changed.algorithm
    assert worker.sharded  # ZeRO-3 over 2 ranks: the changed trainer section, not the config's stage 2
    assert torch.initial_seed() == 11 + 1  # the run section's seed, plus the rank
