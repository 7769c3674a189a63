"""The built-in recipes -- PPO, GRPO, REINFORCE++ -- and the choice of one for a config (:func:`recipe_for`).

    PPO          actor, critic, reference?, reward model?, teacher?, rollout
    GRPO         actor, reference?, reward model?, teacher?, rollout            (no critic)
    REINFORCE++  actor, reference?, reward model?, teacher?, rollout            (no critic)

``?``: optional, dropped when the config does not ask for it -- no reference without a KL term (``init_kl_coef``
0), none loaded under LoRA (the ``reference_base`` phase asks the actor, its adapters off), no reward model with a
rule reward (no ``--reward_pretrain``), no teacher without on-policy distillation (no ``--teacher_pretrain``).
The step, phase by phase (roles absent from a run skip their phases; the reward phase then scores on the driver)::

    generate -> reward -> reference -> teacher -> critic_infer -> actor_train -> sync -> critic_train -> eval

(``eval`` only with ``--eval_dataset``, and then only at the steps ``--eval_steps`` names: :mod:`.evaluation`.)

GRPO and REINFORCE++ share their step's shape; what differs is the math the config chooses (estimator, KL as a loss
or in the reward). The recipe follows the estimator, as OpenRLHF's ``train_ppo_ray`` does: one that reads critic
values gets PPO's (``hybrid grpo --advantage_estimator gae`` trains a critic), one without gets no critic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .recipe import POLICY, PhaseSpec, Recipe, RoleSpec

WORKERS = "hybrid_algos.train.workers"

ACTOR = RoleSpec("actor", "trainer", f"{WORKERS}.policy:PolicyWorker")
CRITIC = RoleSpec(
    "critic",
    "trainer",
    f"{WORKERS}.critic:CriticWorker",
    model=("critic_pretrain", "reward_pretrain", POLICY),
    value_head=True,
)


def reference_is_base(config: Any) -> bool:
    """With LoRA on the actor the reference (the policy's folder, untouched) is the actor's own frozen base: its
    log-probs come from the actor with the adapters off, and no reference model is loaded."""
    return bool(config.uses_reference and config.lora_rank)


REFERENCE = RoleSpec(
    "reference",
    "frozen",
    f"{WORKERS}.frozen:ReferenceWorker",
    when=lambda config: config.uses_reference and not reference_is_base(config),
)
REWARD_MODEL = RoleSpec(
    "reward",
    "frozen",
    f"{WORKERS}.frozen:RewardModelWorker",
    model=("reward_pretrain",),
    value_head=True,
    when=lambda config: config.reward_pretrain is not None,
)
#: on-policy distillation: a frozen model of its own folder that scores the student's tokens (hybrid_algos.distillation)
TEACHER = RoleSpec(
    "teacher",
    "frozen",
    f"{WORKERS}.frozen:ReferenceWorker",
    model=("teacher_pretrain",),
    when=lambda config: config.teacher_pretrain is not None,
)
ROLLOUT = RoleSpec("rollout", "engine")

GENERATE = PhaseSpec("generate", "rollout", {"rollout": ("weights", "kv_cache")}, work=("generate",))
#: the reward model scores; without one the phase runs on the driver (a rule function, or the environment's rewards)
REWARD = PhaseSpec("reward", "reward", {"reward": ("params",)}, work=("infer",), driver=True)
REFERENCE_LOGPROBS = PhaseSpec("reference", "reference", {"reference": ("params",)}, work=("infer",))
#: the same log-probs under LoRA, from the actor's frozen base (adapters off): the actor's parameters are all it needs
REFERENCE_FROM_BASE = PhaseSpec(
    "reference_base", "actor", {"actor": ("params",)}, work=("infer",), when=reference_is_base
)
TEACHER_LOGPROBS = PhaseSpec("teacher", "teacher", {"teacher": ("params",)}, work=("infer",))
CRITIC_VALUES = PhaseSpec("critic_infer", "critic", {"critic": ("params",)}, work=("infer",))
#: the actor's old-log-prob pass (when needed) and its PPO epochs; the larger of the two is the phase's memory
ACTOR_TRAIN = PhaseSpec("actor_train", "actor", {"actor": ("params", "grads", "optimizer")}, work=("train", "infer"))
#: the one moment two roles share the GPU on purpose: the actor's weights stream into the engines' weights, which
#: must then stay until the next generate (a discard would lose them)
SYNC = PhaseSpec(
    "sync",
    "actor",
    {"actor": ("params",), "rollout": ("weights",)},
    work=("sync",),
    holds={("rollout", "weights"): "generate"},
)
CRITIC_TRAIN = PhaseSpec("critic_train", "critic", {"critic": ("params", "grads", "optimizer")}, work=("train",))
#: the held-out prompts, generated on with the weights just trained (after the sync) at the steps --eval_steps names:
#: a generate phase of the engines, the last of the step (step.py skips it, and its moves, at the other steps)
EVAL = PhaseSpec(
    "eval",
    "rollout",
    {"rollout": ("weights", "kv_cache")},
    work=("generate",),
    when=lambda config: config.eval_dataset is not None,
)

PPO = Recipe(
    "ppo",
    (ACTOR, CRITIC, REFERENCE, REWARD_MODEL, TEACHER, ROLLOUT),
    (
        GENERATE,
        REWARD,
        REFERENCE_LOGPROBS,
        REFERENCE_FROM_BASE,
        TEACHER_LOGPROBS,
        CRITIC_VALUES,
        ACTOR_TRAIN,
        SYNC,
        CRITIC_TRAIN,
        EVAL,
    ),
)
GRPO = Recipe(
    "grpo",
    (ACTOR, REFERENCE, REWARD_MODEL, TEACHER, ROLLOUT),
    (GENERATE, REWARD, REFERENCE_LOGPROBS, REFERENCE_FROM_BASE, TEACHER_LOGPROBS, ACTOR_TRAIN, SYNC, EVAL),
)
REINFORCE_PP = Recipe("reinforce++", GRPO.roles, GRPO.phases)

#: name -> recipe
RECIPES: dict[str, Recipe] = {r.name: r for r in (PPO, GRPO, REINFORCE_PP)}


def recipe_name(config: Any) -> str:
    """Which built-in recipe a config runs: PPO's when its estimator reads critic values, else GRPO's for an
    estimator that compares the samples of a prompt, REINFORCE++'s for one that does not."""
    from .config import estimator_needs_critic, estimator_needs_groups

    if estimator_needs_critic(config.advantage_estimator):
        return "ppo"
    return "grpo" if estimator_needs_groups(config.advantage_estimator) else "reinforce++"


def recipe_for(config: Any, recipes: Mapping[str, Recipe] | None = None) -> Recipe:
    """The recipe of a run of ``config``, its optional roles the config does not ask for dropped."""
    return (recipes or RECIPES)[recipe_name(config)].for_config(config)
