"""LoRA on the actor (hybrid_algos.train.lora; the critic's: test_critic_lora.py): its settings refused where wrong,
the adapters counted exactly (the memory model's input: gradients and moments for them alone), the plan's actor
sized so, and OpenRLHF's LoRA flags (dotted and flat, several target words) meaning the same settings."""

from __future__ import annotations

import os

import pytest

from hybrid_algos.train.config import DEMO_SETTINGS, GRPOConfig, PPOConfig
from hybrid_algos.train.lora import adapter_param_count
from hybrid_algos.train.tiny import tiny_model_config
from hybrid_algos.train.workers.settings import TrainerSettings
from hybrid_core.errors import ConfigError


def _peft_count(config, **lora) -> int:
    """The real model's trainable parameters once PEFT wrapped it (on the CPU, allocated)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(task_type="CAUSAL_LM", **lora))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_the_adapters_are_counted_exactly_without_allocating(targets):
    config = tiny_model_config()
    trainer = TrainerSettings(lora_rank=4, lora_target_modules=targets)
    expected = _peft_count(config, r=4, target_modules="all-linear" if targets == "all-linear" else targets.split(","))
    assert adapter_param_count(config, trainer) == expected > 0
    # one q_proj of a 64-wide layer: A (4 x 64) + B (out x 4); all-linear counts every projection of both layers
    if targets == "q_proj,v_proj":
        assert expected < adapter_param_count(config, TrainerSettings(lora_rank=4))


def test_a_target_the_model_lacks_is_refused_naming_it():
    with pytest.raises(ConfigError, match="lora_target_modules") as e:
        adapter_param_count(tiny_model_config(), TrainerSettings(lora_rank=4, lora_target_modules="no_such_proj"))
    assert "q_proj" in (e.value.fix or "")


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"lora_rank": -1}, "lora_rank"),
        ({"lora_rank": 8, "lora_alpha": 0}, "lora_alpha"),
        ({"lora_rank": 8, "lora_dropout": 1.0}, "lora_dropout"),
        ({"lora_rank": 8, "lora_target_modules": " , "}, "lora_target_modules"),
    ],
)
def test_bad_lora_settings_name_the_flag(kw, field):
    with pytest.raises(ConfigError) as e:
        GRPOConfig(**kw).validate()
    assert e.value.field == field


def test_lora_with_a_critic_adapts_the_critic_too():
    """OpenRLHF's meaning: one --lora_rank for the actor and the critic (test_critic_lora.py trains it)."""
    cfg = PPOConfig(lora_rank=8).validate()
    assert cfg.uses_critic and cfg.trainer_settings().lora


def test_the_plan_gives_the_actor_gradients_and_moments_for_its_adapters_only(tmp_path):
    from hybrid_algos.train.placement import build_plan, build_residency
    from hybrid_core.residency import GiB, HostBudget

    def actor(**kw):
        cfg = GRPOConfig(save_path=str(tmp_path / str(len(kw))), **kw).validate()
        plan, _ = build_residency(
            cfg, build_plan(cfg), None, prompt_len=8, generate_len=8, gpu_bytes=80 * GiB, host=HostBudget(None, "-")
        )
        return next(s.size for s in plan.layout[0] if s.role == "actor")

    full, lora = actor(), actor(lora_rank=4, lora_target_modules="q_proj,v_proj")
    adapters = adapter_param_count(
        tiny_model_config(), TrainerSettings(lora_rank=4, lora_target_modules="q_proj,v_proj")
    )
    assert lora.states["params"] == full.states["params"]  # the frozen base stays whole
    assert lora.states["grads"] == pytest.approx(full.states["grads"] * adapters / _total())
    assert lora.states["optimizer"] == pytest.approx(full.states["optimizer"] * adapters / _total())


def _total() -> int:
    from hybrid_core.residency.memory import count_params

    return count_params(tiny_model_config())


def test_openrlhf_lora_flags_are_the_settings():
    from hybrid_cli.main import load_config as load

    def load_config(command, argv):
        return load(command, [*argv, "--n_samples_per_prompt", "4"])

    dotted, _, _ = load_config(
        "grpo", ["--ds.lora.rank", "16", "--ds.lora.alpha", "32", "--ds.lora.target_modules", "q_proj", "v_proj"]
    )
    assert (dotted.lora_rank, dotted.lora_alpha, dotted.lora_target_modules) == (16, 32, "q_proj,v_proj")
    flat, _, _ = load_config("grpo", ["--lora_rank", "8", "--lora_dropout", "0.05", "--target_modules", "o_proj"])
    assert (flat.lora_rank, flat.lora_dropout, flat.lora_target_modules) == (8, 0.05, "o_proj")
    without, _, notes = load_config("grpo", ["--target_modules", "q_proj", "k_proj"])
    assert without.lora_rank == 0 and any("no LoRA adapters" in n for n in notes)  # OpenRLHF reads none either


#: The demo on a tiny model whose random head is not tiny: its logits are bounded by the frozen head and final norm
#: (every row ~0.02 x sqrt(64) at the default initializer_range), which caps what adapters alone can reach -- a
#: pretrained model's head has no such cap. LoRA's usual higher learning rate. Measured on 2 cores (seed 1): 0.12 at
#: step 1, >= 0.9 from step 7, 0.96-0.98 at the end.
LORA_RUN = {
    **DEMO_SETTINGS,
    "max_steps": 16,
    "call_timeout_s": 300,
    "seed": 1,
    "lora_rank": 8,
    "lora_alpha": 16,
    "actor_learning_rate": 5e-3,
    "tiny_model": {"initializer_range": 0.1},
}


@pytest.mark.slow
@pytest.mark.usefixtures("one_gpu_ray")
def test_a_lora_adapter_learns_the_copy_task_and_is_saved_beside_the_merged_model(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybrid_algos.train import CONFIGS, train

    said: list[str] = []

    class Lines:
        def on_start(self, info):
            said.extend(info["lines"])

    summary = train(CONFIGS["grpo"](save_path=str(tmp_path / "run"), **LORA_RUN), callbacks=[Lines()])
    rewards = [m["reward"] for m in summary["history"]]
    print("rewards", [round(r, 2) for r in rewards])
    assert rewards[0] <= 0.2
    crossed = next((i + 1 for i, r in enumerate(rewards) if r >= 0.9), None)
    assert crossed is not None and crossed <= 12, rewards
    assert sum(rewards[-4:]) / 4 >= 0.9, rewards
    assert any("LoRA: rank 8" in line and "no reference model is loaded" in line for line in said)
    # the built-in engine takes the adapter alone: every sync carries its fp32 tensors and nothing else
    assert any("LoRA weight sync: adapter only" in line for line in said), said
    adapter_bytes = 4 * adapter_param_count(tiny_model_config(), TrainerSettings(lora_rank=8, lora_alpha=16))
    assert [m["bytes/sync"] for m in summary["history"]] == [adapter_bytes] * len(rewards)
    # the KL's reference is the actor's base with the adapters off: equal to the policy before the first update
    # (PEFT starts B at zero), apart from it once the adapters learned (a reference that kept them on stays at 0)
    kls = [m["kl"] for m in summary["history"]]
    assert abs(kls[0]) < 1e-6 and max(abs(k) for k in kls[-4:]) > 1e-4, kls
    import json

    plan = json.load(open(tmp_path / "run" / "residency.json"))
    text = json.dumps(plan)
    assert '"reference"' not in text and '"reference_base"' in text  # no reference model: the actor's phase

    final = summary["final_model"]
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "tiny-model"))
    merged = AutoModelForCausalLM.from_pretrained(final)  # a plain folder: the engines and transformers load it
    ids = torch.tensor([[1, 5, 3], [1, 9, 3]])
    with torch.no_grad():
        want = merged(input_ids=ids).logits
        changed = any(not torch.equal(a, b) for a, b in zip(base.parameters(), merged.parameters()))
        base_head = base.lm_head.weight.clone()
        adapted = PeftModel.from_pretrained(base, os.path.join(final, "adapter"))(input_ids=ids).logits
    assert changed and torch.allclose(adapted, want, atol=1e-5)  # the adapter over the base is the merged model
    assert torch.equal(merged.lm_head.weight, base_head)  # only adapted layers moved: the frozen head did not


def test_a_lora_checkpoint_resumes_only_a_lora_run_of_the_same_adapters():
    from hybrid_algos.train.resume import check_compatible, essentials

    lora = GRPOConfig(lora_rank=8).validate()
    state = {"essentials": essentials(lora), "config": {}}
    check_compatible(GRPOConfig(lora_rank=8).validate(), state, "ckpt")  # the same adapters: continues
    for other in (GRPOConfig(), GRPOConfig(lora_rank=16)):
        with pytest.raises(ConfigError, match="lora"):
            check_compatible(other.validate(), state, "ckpt")


def test_the_dry_run_says_what_trains(tmp_path, capsys):
    from hybrid_cli.main import main

    argv = ["grpo", "--dry-run", "--lora_rank", "4", "--lora_target_modules", "q_proj,v_proj"]
    assert main([*argv, "--save_path", str(tmp_path)]) == 0
    adapters = adapter_param_count(
        tiny_model_config(), TrainerSettings(lora_rank=4, lora_target_modules="q_proj,v_proj")
    )
    assert f"LoRA: rank 4, alpha 16, targets q_proj,v_proj: {adapters / 1e6:.2f}M" in capsys.readouterr().out


def test_under_lora_the_reference_is_the_actors_frozen_base_not_a_second_model(tmp_path):
    from hybrid_algos.train.placement import build_plan, build_residency
    from hybrid_algos.train.recipes import recipe_for
    from hybrid_core.residency import GiB, HostBudget

    def plan_of(**kw):
        settings = {k: v for k, v in {**DEMO_SETTINGS, **kw}.items() if v is not None}
        cfg = GRPOConfig(save_path=str(tmp_path / str(len(kw))), **settings).validate()
        recipe = recipe_for(cfg)
        plan, _ = build_residency(
            cfg, build_plan(cfg), None, prompt_len=8, generate_len=8, gpu_bytes=80 * GiB, host=HostBudget(None, "-")
        )
        return cfg, recipe, {s.role for s in plan.layout[0]}

    cfg, full, roles = plan_of()
    assert cfg.uses_reference and full.has("reference") and "reference" in roles
    assert [p.name for p in full.phases if "reference" in p.name] == ["reference"]
    cfg, lora, roles = plan_of(lora_rank=4)
    assert cfg.uses_reference and not lora.has("reference") and "reference" not in roles  # one copy of the weights
    phase = next(p for p in lora.phases if p.name == "reference_base")
    assert phase.role == "actor" and dict(phase.needs) == {"actor": ("params",)}
    _, no_kl, _ = plan_of(lora_rank=4, init_kl_coef=0.0, use_kl_loss=None, kl_estimator=None)
    assert not any("reference" in p.name for p in no_kl.phases)  # no KL term: neither phase


def test_reference_placement_flags_under_lora_are_refused_on_hybrids_line_and_noted_on_openrlhfs(tmp_path):
    from hybrid_algos.train.tiny import save_tiny_model
    from hybrid_cli.main import load_config

    model = save_tiny_model(str(tmp_path / "model"))

    with pytest.raises(ConfigError, match="frozen base") as e:
        GRPOConfig(lora_rank=4, ref_num_gpus_per_node=2).record_given({"ref_num_gpus_per_node"}).validate()
    assert e.value.field.endswith("ref_num_gpus_per_node")
    argv = ["--pretrain", model, "--actor_num_gpus_per_node", "1", "--ref_num_nodes", "1", "--ref_num_gpus_per_node"]
    _, _, notes = load_config("grpo", [*argv, "2", "--lora_rank", "4", "--n_samples_per_prompt", "4"])
    assert any("frozen base" in n and "ref_num_gpus_per_node" in n for n in notes), notes
