"""PPO with ``--trainer fsdp2`` through the real loop on 2 fake GPUs (local Ray, gloo): the actor and the critic each
sharded over 2 ranks, the reference too (fully_shard, no optimizer), every role moving its states between phases
(the critic's value pass runs with its gradients and optimizer offloaded), the weights synced to 2 engines from the
shards, DCP checkpoints for both trained roles, and a resume from them that carries on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybrid_algos.train import CONFIGS, train
from hybrid_algos.train.config import DEMO_SETTINGS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("two_gpu_ray")]

TWO_RANKS = dict(actor_num_gpus_per_node=2, critic_num_gpus_per_node=2, ref_num_gpus_per_node=2, vllm_num_engines=2)
SETTINGS = {**DEMO_SETTINGS, "call_timeout_s": 300, "residency": "all-sleep", "save_steps": 1, **TWO_RANKS}


def test_ppo_trains_actor_and_critic_under_fsdp2_checkpoints_and_resumes(tmp_path) -> None:
    run = dict(save_path=str(tmp_path), seed=1, trainer="fsdp2", **SETTINGS)
    first = train(CONFIGS["ppo"](**{**run, "max_steps": 2}))
    for m in first["history"]:
        assert math.isfinite(m["critic/value_loss"]) and math.isfinite(m["actor/pg_loss"])
        assert m["bytes/sync"] > 0 and m["bytes/sleep"] > 0 and m["bytes/wake"] > 0
    assert first["residency"].sleeps("actor") and first["residency"].sleeps("critic")
    # the 2-rank reference is planned (and built) as FSDP2 shards, and the owner moves them like the trainers' states
    plan = first["residency"]
    reference = [share for shares in plan.layout.values() for share in shares if share.role == "reference"]
    assert len(reference) == 2 and all(
        "fsdp2_gather" in items for share in reference for items in share.size.working.values()
    )
    assert plan.sleeps("reference")
    # each trained role's checkpoint is DCP's: the .metadata its coordinator writes after every rank's shards
    for role in ("actor", "critic"):
        saved = list((tmp_path / "checkpoints").glob(f"step-*/{role}/**/.metadata"))
        assert len(saved) == 2, sorted(str(p) for p in Path(tmp_path).rglob("*"))
        assert list(saved[0].parent.glob("*.distcp"))  # the ranks' shards beside it

    resumed = train(CONFIGS["ppo"](**{**run, "max_steps": 3, "resume": True}))
    assert len(resumed["history"]) == 3  # the two saved steps, then the one trained after loading the shards
    assert math.isfinite(resumed["history"][-1]["critic/value_loss"])
