"""LoRA on PPO's critic (one ``--lora_rank`` for the actor and the critic, as OpenRLHF's): on 2 gloo ranks under
FSDP2 and DeepSpeed ZeRO-3 (critic_lora_worker.py) the critic built by ``CriticWorker.setup`` trains its adapters and
its value head only -- its values move, its base stays bit-identical, the optimizer holds state for the trained
parameters alone -- and a checkpoint restores exactly what it saved, with the adapters and head in ``adapter/`` in
PEFT's format. Then the memory model's count of them, the refusals left, and a short ``hybrid ppo --lora_rank``
run on the built-in CPU setup whose critic loss falls."""

from __future__ import annotations

from pathlib import Path

import pytest
from fsdp2_launch import run_ranks

from hybrid_algos.train.config import DEMO_SETTINGS, PPOConfig
from hybrid_algos.train.lora import adapter_param_count
from hybrid_algos.train.tiny import tiny_model_config
from hybrid_algos.train.workers.settings import TrainerSettings
from hybrid_core.errors import ConfigError

WORKER = Path(__file__).with_name("critic_lora_worker.py")
TRAINER = TrainerSettings(lora_rank=4, lora_alpha=8, lora_target_modules="q_proj,v_proj")


def _ranks(backend: str, folder: Path) -> list[dict]:
    from hybrid_algos.train.tiny import save_tiny_model

    save_tiny_model(str(folder / "policy"))
    return run_ranks(backend, 2, folder, worker=WORKER, timeout_s=400)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> list[dict]:
    return _ranks("fsdp2", tmp_path_factory.mktemp("critic_lora_fsdp2"))


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory) -> list[dict]:
    return _ranks("deepspeed", tmp_path_factory.mktemp("critic_lora_ds"))


def _is_trained(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".score.modules_to_save." in name


@pytest.mark.timeout(600)
def test_the_critic_trains_its_adapters_and_value_head_only(fsdp2, deepspeed) -> None:
    for r in fsdp2 + deepspeed:
        assert r["peft_class"].endswith("PeftModelForTokenClassification")  # FSDP2 prefixes its own class
        assert r["trainable"] and all(_is_trained(n) for n in r["trainable"]), r["trainable"]
        assert any(".score.modules_to_save." in n for n in r["trainable"])  # the head trains beside the adapters
        assert any(".lora_A." in n for n in r["trainable"])
        assert r["changed"] == r["trainable"]  # every adapter and the head moved, nothing else did
        assert r["frozen_identical"]  # the base (and the head's original copy) bit for bit
        assert r["values_moved"] > 1e-2
        assert r["losses"][-1] < r["losses"][0]  # towards the returns
        # the memory model's count is what trains
        assert r["trained_params"] == adapter_param_count(tiny_model_config(), TRAINER, value_head=True)
    for r in fsdp2:
        assert r["optimizer_params"] == r["trainable"]  # no Adam state for the frozen base


@pytest.mark.timeout(600)
def test_a_checkpoint_restores_the_critics_adapters_and_saves_them_in_pefts_format(fsdp2, deepspeed) -> None:
    for r in fsdp2 + deepspeed:
        assert r["moved_after_save"] > 1e-4  # the step after the save changed the values ...
        assert r["restored_gap"] == 0.0 and r["restored_params_identical"]  # ... and the load brought them back
    for r in (fsdp2[0], deepspeed[0]):
        assert "adapter_config.json" in r["adapter_files"] and "adapter_model.safetensors" in r["adapter_files"]
        assert r["adapter_values_gap"] < 1e-5  # PeftModel over load_critic's model computes the trained values


def test_the_plan_gives_the_critic_gradients_and_moments_for_its_adapters_and_head_only(tmp_path):
    from hybrid_algos.train.placement import build_plan, build_residency
    from hybrid_core.residency import GiB, HostBudget
    from hybrid_core.residency.memory import count_params

    def critic(**kw):
        cfg = PPOConfig(save_path=str(tmp_path / str(len(kw))), **kw).validate()
        plan, _ = build_residency(
            cfg, build_plan(cfg), None, prompt_len=8, generate_len=8, gpu_bytes=80 * GiB, host=HostBudget(None, "-")
        )
        return next(s.size for s in plan.layout[0] if s.role == "critic")

    full, lora = critic(), critic(lora_rank=4, lora_alpha=8, lora_target_modules="q_proj,v_proj")
    trained = adapter_param_count(tiny_model_config(), TRAINER, value_head=True)
    total = count_params(tiny_model_config(), value_head=True)
    hidden = tiny_model_config().hidden_size
    head = hidden + 1  # the one-output token head, weight and bias
    adapters = adapter_param_count(tiny_model_config(), TRAINER)  # the same backbone's adapters, as the actor's
    assert trained == adapters + head < total
    assert lora.states["params"] == full.states["params"]  # the frozen base stays whole
    assert lora.states["grads"] == pytest.approx(full.states["grads"] * trained / total)
    assert lora.states["optimizer"] == pytest.approx(full.states["optimizer"] * trained / total)


def test_lora_with_a_critic_runs_and_the_refusals_left_name_the_cause(tmp_path, capsys):
    from hybrid_cli.main import main

    PPOConfig(lora_rank=8).validate()  # no longer refused: the critic gets adapters too
    with pytest.raises(ConfigError, match="value head") as e:  # the head trains whole: it takes no adapter
        adapter_param_count(
            tiny_model_config(), TrainerSettings(lora_rank=4, lora_target_modules="q_proj,score"), value_head=True
        )
    assert e.value.field == "trainer.lora_target_modules" and "score" in (e.value.fix or "")
    # the actor's model has no value head: the same targets are fine there
    assert adapter_param_count(tiny_model_config(), TrainerSettings(lora_rank=4, lora_target_modules="q_proj"))

    assert main(["ppo", "--dry-run", "--lora_rank", "4", "--save_path", str(tmp_path)]) == 0
    trained = adapter_param_count(tiny_model_config(), TrainerSettings(lora_rank=4), value_head=True)
    out = " ".join(capsys.readouterr().out.split())
    assert f"the critic too (one --lora_rank for both, as OpenRLHF's): {trained / 1e6:.2f}M adapter and" in out


def test_a_critic_lora_checkpoint_resumes_only_a_run_of_the_same_adapters():
    from hybrid_algos.train.resume import check_compatible, essentials

    state = {"essentials": essentials(PPOConfig(lora_rank=8).validate()), "config": {}}
    check_compatible(PPOConfig(lora_rank=8).validate(), state, "ckpt")
    for other in (PPOConfig(), PPOConfig(lora_rank=16), PPOConfig(lora_rank=8, lora_target_modules="q_proj")):
        with pytest.raises(ConfigError, match="lora"):
            check_compatible(other.validate(), state, "ckpt")


#: the built-in demo, short, on test_lora.py's tiny model (initializer_range 0.1): the critic's new random head starts
#: far from the returns (values of either sign, returns near the chance reward), so its loss first falls by the head
#: and adapters learning the returns' level, before the policy's learning moves them
PPO_LORA_RUN = {
    **DEMO_SETTINGS,
    "max_steps": 6,
    "call_timeout_s": 300,
    "seed": 1,
    "lora_rank": 8,
    "lora_alpha": 16,
    "actor_learning_rate": 5e-3,
    "critic_learning_rate": 5e-3,
    "save_steps": 3,
    "tiny_model": {"initializer_range": 0.1},
}


@pytest.mark.slow
@pytest.mark.usefixtures("one_gpu_ray")
def test_a_short_ppo_run_with_lora_trains_the_critics_adapters(tmp_path):
    import os

    from hybrid_algos.train import CONFIGS, train

    said: list[str] = []

    class Lines:
        def on_start(self, info):
            said.extend(info["lines"])

    summary = train(CONFIGS["ppo"](save_path=str(tmp_path / "run"), **PPO_LORA_RUN), callbacks=[Lines()])
    losses = [m["critic/value_loss"] for m in summary["history"]]
    print("critic losses", [round(v, 4) for v in losses])
    assert len(losses) == 6 and max(losses[-2:]) < losses[0] / 2, losses
    assert any("LoRA: rank 8" in line and "the critic too" in line for line in said), said
    found = [root for root, _, files in os.walk(tmp_path / "run") if "adapter_config.json" in files]
    assert any(Path(root).parent.name == "critic" for root in found), found  # the checkpoint's critic/adapter
