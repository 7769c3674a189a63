"""Under --trainer fsdp2 the reference and the reward model of a role with several ranks are sharded by fully_shard
(trainer_backends/fsdp2_frozen.py), chosen by the trainer-backend registry: on 2 real gloo ranks
(fsdp2_frozen_worker.py), in fp32 and bf16, each rank holds half of the parameters in the dtype asked for (what the
memory model counts), scores what the unsharded model scores (1e-5), keeps only its shards between passes, and its
shards sleep and wake bit-identically through the workers' offload / reload."""

from __future__ import annotations

from pathlib import Path

import pytest
from fsdp2_launch import run_ranks

from hybrid_algos.train.trainer_backends.registry import frozen_sharded
from hybrid_algos.train.workers.settings import TrainerSettings

WORKER = Path(__file__).with_name("fsdp2_frozen_worker.py")
pytestmark = pytest.mark.timeout(600)
PRECISIONS = {"fp32": (4, "torch.float32"), "bf16": (2, "torch.bfloat16")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from hybrid_algos.train.tiny import save_tiny_model, tiny_model_config

    folder = tmp_path_factory.mktemp("fsdp2-frozen")
    policy = save_tiny_model(str(folder / "policy"))
    torch.manual_seed(1)
    LlamaForSequenceClassification(tiny_model_config(num_labels=1)).save_pretrained(folder / "reward")
    AutoTokenizer.from_pretrained(policy).save_pretrained(folder / "reward")
    return run_ranks("run", 2, folder, worker=WORKER, timeout_s=500)


def test_the_registry_shards_frozen_roles_where_the_trainers_parameters_are_sharded() -> None:
    assert frozen_sharded(TrainerSettings(backend="fsdp2"), 2)
    assert not frozen_sharded(TrainerSettings(backend="fsdp2"), 1)  # one rank: nothing to split
    assert frozen_sharded(TrainerSettings(backend="deepspeed", zero_stage=3), 2)
    assert not frozen_sharded(TrainerSettings(backend="deepspeed", zero_stage=2), 2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_rank_holds_half_of_each_frozen_model_in_the_dtype_asked(ranks, precision) -> None:
    from hybrid_algos.train.recipes import PPO
    from hybrid_algos.train.tiny import tiny_model_config
    from hybrid_core.residency.memory import Workload, model_shape, size_role

    b, dtype = PRECISIONS[precision]
    results = [r[precision] for r in ranks]
    for r in results:
        assert r["sharded"] == [True, True]
        assert r["shard_dtypes"] == [dtype]
        assert r["only_shards_after_forward"]
    for i in range(2):  # FSDP2 splits each parameter's first dimension: the ranks' shards add up to the model
        assert sum(r["held"][i] for r in results) == results[0]["total"][i]
        assert all(abs(r["held"][i] - results[0]["total"][i] / 2) <= 256 for r in results)
    # the plan's bytes for one of these ranks: the same half, and the weights the forward gathers
    work = Workload(trainer_backend="fsdp2", bf16=b == 2, zero_stage=2)
    size = size_role(
        "reference",
        model_shape(tiny_model_config()),
        work,
        kind="frozen",
        phases=PPO.residency_phases(),
        ranks=2,
        tp=1,
        gpu_bytes=80 * 2**30,
    )
    assert size.states["params"] == b * results[0]["total"][0] / 2
    assert any("fsdp2_gather" in items for items in size.working.values())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sharded_models_score_what_the_whole_models_score(ranks, precision) -> None:
    for r in ranks:
        assert r[precision]["logprob_gap"] < 1e-5 and r[precision]["score_gap"] < 1e-5, r[precision]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("role", ["reference", "reward"])
def test_the_shards_sleep_and_wake_bit_identically(ranks, precision, role) -> None:
    b, _ = PRECISIONS[precision]
    for r in ranks:
        sleep = r[precision][f"{role}_sleep"]
        held = r[precision]["held"][0 if role == "reference" else 1]
        assert sleep["moved"] >= b * held and sleep["reloaded"] == sleep["moved"]
        assert sleep["left_on_device"] == 0
        assert sleep["refused_asleep"] == "AsleepError"  # not a gather from freed memory
        assert sleep["identical_shards"]
        assert sleep["after_wake_gap"] == 0.0
