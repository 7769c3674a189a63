"""The built-in recipes: the one a config runs, its optional roles dropped as the config says, and a step that is
exactly the one the residency planner planned before recipes existed (the table below is that old hard-coded step)."""

import pytest

from hybrid_algos.train.config import GRPOConfig, PPOConfig, ReinforceConfig
from hybrid_algos.train.recipe import PhaseSpec, Recipe, RoleSpec
from hybrid_algos.train.recipes import GRPO, PPO, recipe_for
from hybrid_algos.train.step import PHASES, StepContext

#: the step as hybrid_core/residency/steps.py hard-coded it (STEP, HELD_UNTIL) before it became the recipe's
OLD_STEP = [
    ("generate", "rollout", {"rollout": ("weights", "kv_cache")}),
    ("reward", "reward", {"reward": ("params",)}),
    ("reference", "reference", {"reference": ("params",)}),
    ("critic_infer", "critic", {"critic": ("params",)}),
    ("actor_train", "actor", {"actor": ("params", "grads", "optimizer")}),
    ("sync", "actor", {"actor": ("params",), "rollout": ("weights",)}),
    ("critic_train", "critic", {"critic": ("params", "grads", "optimizer")}),
]
OLD_KINDS = {"actor": "trainer", "critic": "trainer", "reference": "frozen", "reward": "frozen", "rollout": "engine"}


def test_ppo_is_the_old_step():
    # the old step, with on-policy distillation's optional teacher (and its phase, after the reference's) beside it
    phases = [(p.name, p.role, p.needs) for p in PPO.residency_phases()]
    assert [p for p in phases if p[1] != "teacher" and p[0] not in ("eval", "reference_base")] == OLD_STEP
    # under LoRA the reference's phase is the actor's (its frozen base): right after the reference model's
    assert phases[3] == ("reference_base", "actor", {"actor": ("params",)})
    # and the evaluation's (with --eval_dataset): a generate phase of the engines, the step's last
    assert phases[-1] == ("eval", "rollout", {"rollout": ("weights", "kv_cache")})
    assert phases[4] == ("teacher", "teacher", {"teacher": ("params",)})
    assert PPO.kinds == {**OLD_KINDS, "teacher": "frozen"}
    sync = next(p for p in PPO.residency_phases() if p.name == "sync")
    assert sync.holds == {("rollout", "weights"): "generate"}


@pytest.mark.parametrize(
    "config, name, roles",
    [
        (PPOConfig(), "ppo", ["actor", "critic", "reference", "rollout"]),
        (PPOConfig(init_kl_coef=0.0), "ppo", ["actor", "critic", "rollout"]),
        (PPOConfig(reward_pretrain="/models/rm"), "ppo", ["actor", "critic", "reference", "reward", "rollout"]),
        (PPOConfig(advantage_estimator="group_norm"), "grpo", ["actor", "reference", "rollout"]),  # no critic
        (GRPOConfig(), "grpo", ["actor", "reference", "rollout"]),
        (GRPOConfig(advantage_estimator="gae"), "ppo", ["actor", "critic", "reference", "rollout"]),
        (ReinforceConfig(), "reinforce++", ["actor", "reference", "rollout"]),
        (GRPOConfig(teacher_pretrain="/models/t"), "grpo", ["actor", "reference", "teacher", "rollout"]),
        (PPOConfig(init_kl_coef=0.0, teacher_pretrain="/t"), "ppo", ["actor", "critic", "teacher", "rollout"]),
    ],
)
def test_the_recipe_follows_the_config(config, name, roles):
    recipe = recipe_for(config)
    assert recipe.name == name and [r.name for r in recipe.roles] == roles
    assert config.uses_critic == recipe.has("critic") and config.uses_reference == recipe.has("reference")
    # the reward phase stays (on the driver without a reward model); the others go with their role
    assert [p.name for p in recipe.phases if p.role not in roles] == ["reward"] * (not recipe.has("reward"))
    assert all(set(p.needs) <= set(roles) for p in recipe.phases)
    old_step = [*OLD_STEP[:3], ("teacher", "teacher", {}), *OLD_STEP[3:]]
    assert [p.name for p in recipe.residency_phases()] == [n for n, role, _ in old_step if role in roles]


def test_every_phase_of_the_built_in_recipes_has_its_function():
    for recipe in (PPO, GRPO):
        assert all(p.function in PHASES for p in recipe.phases[1:]) and recipe.phases[0].function == "generate"
    assert PPO.train_phase("actor") == "actor_train" and PPO.train_phase("critic") == "critic_train"


def test_a_recipes_mistakes_are_refused():
    with pytest.raises(ValueError, match="needs a worker class"):
        RoleSpec("teacher", "frozen")
    with pytest.raises(ValueError, match="no role judge"):
        Recipe("x", GRPO.roles, (*GRPO.phases, PhaseSpec("judging", "judge", {"judge": ("params",)})))
    with pytest.raises(ValueError, match="cannot train"):
        Recipe(
            "x", GRPO.roles, (*GRPO.phases, PhaseSpec("t", "reference", {"reference": ("params",)}, work=("train",)))
        )
    odd = Recipe("x", GRPO.roles, (*GRPO.phases, PhaseSpec("t", "reference", {"reference": ("params",)}, run="nope")))
    with pytest.raises(ValueError, match="no phase function 'nope'"):
        StepContext(
            settings=GRPOConfig().settings(),
            actor=None,
            engines=None,
            weight_sync=None,
            reward=None,
            residency=None,
            pad_id=0,
            recipe=odd.for_config(GRPOConfig()),
        )
