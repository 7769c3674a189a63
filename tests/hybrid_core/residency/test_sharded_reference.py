"""Under ZeRO-3 the frozen models (reference, reward) are sharded over their role's GPUs, as OpenRLHF shards them (its
reference and reward models are DeepSpeed inference engines with the trainers' --zero_stage). Issue 34: a 70B
script with the reference and reward model on 4 GPUs each was refused for "reference params 131.4 GiB" on one GPU."""

import pytest
from ppo_phases import build_layout, plan_residency, size_role

from hybrid_core.placement import PlacementSpec
from hybrid_core.residency import GiB, ModelShape, Workload
from hybrid_core.residency.memory import frozen_shards

#: Llama-3-70B's shape (the parameter count as transformers counts it) and its reward model (a value head)
L70 = ModelShape(70_553_706_496, 8192, 80, 8, 128, 28672, 128256)
L70_RM = ModelShape(69_503_041_537, 8192, 80, 8, 128, 28672, 128256, value_head=True)
WORK = dict(
    bf16=True,
    micro_train_batch_size=1,
    micro_rollout_batch_size=2,
    prompt_len=1024,
    generate_len=1024,
    rollout_samples=1024,
    engine_pool=True,
    engine_memory_fraction=0.9,
)


@pytest.mark.parametrize("role, shape", [("reference", L70), ("reward", L70_RM)])
def test_zero3_shards_a_frozen_model_over_its_ranks(role, shape):
    size = size_role(role, shape, Workload(zero_stage=3, **WORK), ranks=4, tp=1, gpu_bytes=80 * GiB)
    assert size.states["params"] == 2 * shape.num_params / 4  # a quarter of the bf16 weights on each GPU
    assert size.states["params"] < 33 * GiB  # was 131.4 GiB, the whole model, on each
    # its forward gathers a layer while the next one is fetched, as a trainer's does
    assert size.working[role]["zero3_gather"] == 2 * 2 * shape.layer_params


@pytest.mark.parametrize("zero_stage, ranks", [(0, 4), (1, 4), (2, 4), (3, 1)])
def test_otherwise_a_frozen_model_is_whole_on_each_gpu(zero_stage, ranks):
    size = size_role("reference", L70, Workload(zero_stage=zero_stage, **WORK), ranks=ranks, tp=1, gpu_bytes=80 * GiB)
    assert size.states["params"] == 2 * L70.num_params
    assert "zero3_gather" not in size.working["reference"]  # one rank: the worker keeps the model whole, no gathers
    assert frozen_shards(zero_stage, ranks=ranks) == 1


def test_the_70b_layout_of_issue_34_fits_80_gib_gpus():
    """OpenRLHF's train_ppo_llama_ray_70b.sh: actor 8, four TP-2 engines, critic 8, reference 4, reward 4 GPUs."""
    placement = PlacementSpec.from_ranges(  # each role its own GPUs, in the order OpenRLHF's launcher gives them
        {"actor": "0-7", "rollout": "8-15", "critic": "16-23", "reference": "24-27", "reward": "28-31"},
        tp={"rollout": 2},
    ).plan()
    critic = ModelShape(L70_RM.num_params, 8192, 80, 8, 128, 28672, 128256, value_head=True)
    shapes = {"actor": L70, "rollout": L70, "critic": critic, "reference": L70, "reward": L70_RM}
    layout = build_layout(
        placement, shapes, Workload(zero_stage=3, adam_offload=True, gradient_checkpointing=True, **WORK), 80 * GiB
    )
    ref_gpus = placement.roles["reference"].gpus
    assert len(ref_gpus) == 4
    for gpu in ref_gpus:
        (share,) = layout[gpu]
        assert share.role == "reference" and share.size.states["params"] == 2 * L70.num_params / 4
    plan = plan_residency(layout, 80 * GiB)
    assert plan.fits()
    for gpu in ref_gpus:  # a quarter of the weights, one forward's activations and logits, a layer being gathered
        items = plan.breakdown(gpu, "reference")
        assert items[("reference", "params")] == 2 * L70.num_params / 4
        assert plan.peak(gpu, "reference") < 45 * GiB
