"""``--trainer fsdp2``: DeepSpeed-only settings are refused under it (never accepted and ignored), the precision flags
map onto FSDP2's dtypes, and the registry refuses a DeepSpeed-only value that reaches it anyway (the residency
planner turns CPU Adam on for DeepSpeed runs)."""

from __future__ import annotations

import pytest
import torch

from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.trainer_backends.registry import make_training_engine, model_dtype
from hybrid_algos.train.workers.settings import TrainerSettings
from hybrid_core.errors import ConfigError


@pytest.mark.parametrize("flag, value", [("zero_stage", 3), ("zero_stage", 0), ("adam_offload", True)])
def test_deepspeed_only_flags_are_refused_under_fsdp2_naming_the_flag(flag: str, value) -> None:
    with pytest.raises(ConfigError, match=rf"--{flag}.*--trainer deepspeed") as e:
        GRPOConfig(trainer="fsdp2", **{flag: value}).validate()
    assert e.value.field == flag
    GRPOConfig(trainer="deepspeed", **{flag: value}).validate()  # DeepSpeed's own, accepted there


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match="deepspeed, fsdp2") as e:
        GRPOConfig(trainer="megatron").validate()
    assert e.value.field == "trainer"


def test_bf16_master_weights_under_fsdp2_need_bf16_moments_too() -> None:
    # torch's AdamW steps its moments in the master dtype: fp32 moments beside bf16 master weights cannot be honoured
    with pytest.raises(ConfigError, match="--bf16_optimizer_states"):
        GRPOConfig(trainer="fsdp2", bf16=True, bf16_master_weights=True).validate()
    both = GRPOConfig(trainer="fsdp2", bf16=True, bf16_master_weights=True, bf16_optimizer_states=True).validate()
    assert model_dtype(both.trainer_settings()) == torch.bfloat16


def test_the_model_loads_in_the_master_dtype_under_fsdp2_and_the_model_dtype_under_deepspeed() -> None:
    # --bf16 alone: FSDP2 keeps fp32 master shards (bf16 compute), DeepSpeed loads the model in bf16
    assert model_dtype(TrainerSettings(backend="fsdp2", bf16=True)) == torch.float32
    assert model_dtype(TrainerSettings(backend="deepspeed", bf16=True)) == torch.bfloat16


def test_fsdp2_roles_always_move_their_states() -> None:
    # the residency plan may offload an FSDP2 role's states whatever zero_stage says (DeepSpeed: only ZeRO 1-3)
    assert TrainerSettings(backend="fsdp2").moves_states
    assert not TrainerSettings(backend="deepspeed", zero_stage=0).moves_states


def test_the_registry_refuses_cpu_adam_under_fsdp2_before_building_anything() -> None:
    trainer = TrainerSettings(backend="fsdp2", adam_offload=True)  # not validated: as the planner's change arrives
    shape = {"micro_batch": 1, "grad_accum": 1, "total_updates": 1}
    with pytest.raises(ConfigError, match=r"trainer\.adam_offload"):
        make_training_engine(trainer, torch.nn.Linear(2, 2), 1e-3, shape, torch.device("cpu"))


def test_the_residency_planner_sizes_fsdp2_by_its_own_bytes_and_never_plans_cpu_adam(tmp_path) -> None:
    """Under fsdp2 the plan's trainer bytes are FSDP2's (not DeepSpeed's), and a budget that drives a DeepSpeed run to
    CPU Adam (its optimizer living in host memory) never does so for FSDP2, which has none: it offloads instead."""
    from tiny_runs import tiny_config

    from hybrid_algos.train.placement import build_plan, build_residency, workload

    no_context = dict(gpu_context_gb=0.0, gpu_memory_usable=1.0)
    for backend in ("deepspeed", "fsdp2"):
        config = tiny_config(tmp_path / backend, trainer=backend, **no_context).validate()
        assert workload(config.settings(), 3, 2).trainer_backend == backend
    ds = tiny_config(tmp_path / "ds", **no_context).validate()
    fs = tiny_config(tmp_path / "fs", trainer="fsdp2", **no_context).validate()
    cpu_adam_seen = False
    for kib in range(4096, 0, -64):
        _, ds_run = build_residency(ds, build_plan(ds), None, prompt_len=3, generate_len=2, gpu_bytes=kib * 1024)
        plan, fs_run = build_residency(fs, build_plan(fs), None, prompt_len=3, generate_len=2, gpu_bytes=kib * 1024)
        cpu_adam_seen |= ds_run.adam_offload
        assert not fs_run.adam_offload and fs_run.trainer == "fsdp2"
        assert all(move != "host" for (_, state), move in plan.moves.items() if state == "optimizer")
    assert cpu_adam_seen  # the budgets were tight enough to matter


def test_a_checkpoint_of_one_backend_is_not_resumed_by_the_other(tmp_path) -> None:
    from tiny_runs import tiny_config

    from hybrid_algos.train.resume import check_compatible, essentials

    saved = {"essentials": essentials(tiny_config(tmp_path, trainer="deepspeed")), "config": {}}
    with pytest.raises(ConfigError, match=r"trainer: 'deepspeed' there, 'fsdp2' here"):
        check_compatible(tiny_config(tmp_path, trainer="fsdp2"), saved, "ckpt")
    check_compatible(tiny_config(tmp_path, trainer="deepspeed"), saved, "ckpt")
