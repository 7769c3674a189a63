"""Settings that do nothing in some runs: one declared table, so none is accepted and silently ignored.

A rule says *when* a setting has no effect (a predicate on the config) and *why*, in words the user can act on.
:func:`check` applies the table in :meth:`RLConfig.validate`: a setting the user set (to something other than its
default) in a run where a rule says it does nothing is refused with a :class:`ConfigError` naming the flag, why it
would be ignored and what to do instead.

One exception keeps OpenRLHF scripts running unchanged: a rule marked ``openrlhf`` is about a flag OpenRLHF's
``train_ppo_ray`` also accepts and ignores in the same situation (``--critic_learning_rate`` in a GRPO script,
``--enforce_eager`` without vLLM engines). On an OpenRLHF command line
(:func:`hybrid_cli.openrlhf.is_openrlhf_command`) such a flag is a printed note instead of an error; hybrid's own
command lines and the Python API are refused.

What "the user set" means: the CLI records the fields its command line and ``--config`` file gave
(:meth:`RLConfig.record_given`); a config built in Python counts every field whose value differs from both the
algorithm's default and the demo preset (:data:`~hybrid_algos.train.demo.DEMO_SETTINGS`, which the CLI applies to
every algorithm: its critic learning rate is not a GRPO user's choice).

Every field of :class:`RLConfig` is either read by code whatever the other settings say, or covered here:
tests/hybrid_algos/train/test_inactive_fields.py enumerates the fields and flags and checks both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybrid_core.errors import ConfigError

from .demo import DEMO_SETTINGS

Text = str | Callable[[Any], str]


@dataclass(frozen=True)
class Rule:
    """``field`` has no effect in a config where ``when(config)`` holds."""

    field: str
    when: Callable[[Any], bool]
    reason: Text  # why it does nothing then (a clause; "so --FIELD would do nothing" is added)
    fix: Text
    openrlhf: bool = False  # OpenRLHF accepts the flag and ignores it here too: a note on an OpenRLHF command line

    def verdict(self, openrlhf_line: bool) -> str:
        """``"note"`` or ``"refuse"``."""
        return "note" if self.openrlhf and openrlhf_line else "refuse"

    def text(self, part: Text, config: Any) -> str:
        return part(config) if callable(part) else part


def _hf(cfg) -> bool:
    return cfg.backend == "hf"


def _no_critic(cfg) -> bool:
    return not cfg.uses_critic


def _critic_reason(cfg) -> str:
    return f"--advantage_estimator {cfg.advantage_estimator} trains no critic"


_CRITIC_FIX = "Drop it, or use an estimator with a critic (--advantage_estimator gae, PPO's)."
_NO_KL = "--init_kl_coef 0 turns the KL term off (no reference model runs)"
_NO_KL_FIX = "Drop it, or give --init_kl_coef > 0."


def _placement_rule(name: str) -> Rule:
    return Rule(
        name,
        lambda c: c.placement is not None,
        "--placement lays every role out by its GPU ranges, so the count and colocation flags are not read",
        "Drop it, or drop --placement (and place the roles with the count flags).",
    )


def _loss_has_no_dual_clip(cfg) -> bool:
    from hybrid_algos import get_policy_loss

    return "dual_clip" not in get_policy_loss(cfg.policy_loss_type).uses


#: The table, in the order the rules are checked (for a field with several, the first that applies speaks).
RULES: tuple[Rule, ...] = (
    # ---- inference engine -------------------------------------------------------------------------------------
    Rule(
        "vllm_gpu_memory_utilization",
        _hf,
        "the built-in engine (--backend hf) has no memory pool to size: it "
        "allocates as it generates, and the residency plan budgets what it holds",
        "Drop it, or use --backend vllm / sglang (whose pool it sizes).",
        openrlhf=True,
    ),
    Rule(
        "enforce_eager",
        _hf,
        "the built-in engine (--backend hf) never captures CUDA graphs (it always runs eagerly)",
        "Drop it, or use --backend vllm / sglang.",
        openrlhf=True,
    ),
    Rule(
        "enable_prefix_caching",
        _hf,
        "the built-in engine (--backend hf) has no prefix cache",
        "Drop it, or use --backend vllm / sglang.",
        openrlhf=True,
    ),
    Rule(
        "vllm_sync_backend",
        lambda c: c.weight_sync == "ipc",
        "--weight_sync ipc hands the engines CUDA IPC handles of the weights; no broadcast group is made",
        "Drop it, or use --weight_sync broadcast (or auto).",
    ),
    # ---- placement ------------------------------------------------------------------------------------------------
    _placement_rule("colocate_all_models"),
    Rule(
        "colocate_actor_ref",
        lambda c: c.placement is None and c.colocate_all_models,
        "--colocate_all_models (hybrid's default) already puts the reference model on the actor's GPUs",
        "Drop it, or add --no_colocate_all_models to pair only the actor and the reference.",
        openrlhf=True,
    ),
    _placement_rule("colocate_actor_ref"),
    Rule(
        "colocate_actor_ref",
        lambda c: not c.uses_reference,
        _NO_KL + ", so there is no reference to place",
        _NO_KL_FIX,
        openrlhf=True,
    ),
    Rule(
        "colocate_critic_reward",
        lambda c: c.placement is None and c.colocate_all_models,
        "--colocate_all_models (hybrid's default) already puts the reward model on the actor's GPUs",
        "Drop it, or add --no_colocate_all_models to pair only the critic and the reward model.",
        openrlhf=True,
    ),
    _placement_rule("colocate_critic_reward"),
    # ---- the critic -----------------------------------------------------------------------------------------------
    *(
        Rule(name, _no_critic, _critic_reason, _CRITIC_FIX, openrlhf=True)
        for name in (
            "critic_pretrain",
            "critic_learning_rate",
            "lambd",
            "value_clip",
            "critic_num_nodes",
            "critic_num_gpus_per_node",
            "colocate_critic_reward",
        )
    ),
    # ---- KL -------------------------------------------------------------------------------------------------------
    *(
        Rule(name, lambda c: not c.uses_reference, _NO_KL, _NO_KL_FIX, openrlhf=True)
        for name in ("kl_target", "kl_horizon", "kl_estimator", "use_kl_loss", "ref_num_nodes", "ref_num_gpus_per_node")
    ),
    Rule(
        "kl_horizon",
        lambda c: c.kl_target is None,
        "the KL coefficient is fixed (no --kl_target), and only the adaptive controller has a horizon",
        "Drop it, or add --kl_target to steer the coefficient.",
        openrlhf=True,
    ),
    # ---- reward model ---------------------------------------------------------------------------------------------
    *(
        Rule(
            name,
            lambda c: c.reward_pretrain is None,
            "no reward model runs (no --reward_pretrain)",
            "Drop it, or give --reward_pretrain DIR.",
            openrlhf=True,
        )
        for name in ("reward_num_nodes", "reward_num_gpus_per_node")
    ),
    # ---- LoRA -----------------------------------------------------------------------------------------------------
    *(
        Rule(
            name,
            lambda c: not c.lora_rank,
            "--lora_rank is 0: every weight trains, no adapters",
            "Drop it, or give --lora_rank R (e.g. 16).",
            # OpenRLHF's --target_modules: its translation drops it there; --lora_sync is hybrid's own
            openrlhf=name in ("lora_alpha", "lora_dropout"),
        )
        for name in ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_sync")
    ),
    *(
        Rule(
            name,
            lambda c: bool(c.lora_rank and c.uses_reference),
            "under LoRA the reference is the actor's own frozen base (its adapters off): no reference model is "
            "loaded or placed",
            "Drop it: the reference's log-probs come from the actor's GPUs.",
            openrlhf=True,  # OpenRLHF loads a second copy there; the log-probs are the same
        )
        for name in ("ref_num_nodes", "ref_num_gpus_per_node", "colocate_actor_ref")
    ),
    # ---- on-policy distillation ----------------------------------------------------------------------------------
    *(
        Rule(
            name,
            lambda c: c.teacher_pretrain is None,
            "there is no teacher (no --teacher_pretrain), so no distillation term",
            "Drop it, or give --teacher_pretrain DIR (a model with the policy's tokenizer).",
        )
        for name in ("distill_coef", "distill_task_coef")
    ),
    # ---- the policy loss ------------------------------------------------------------------------------------------
    Rule(
        "eps_clip",
        lambda c: c.eps_clip_low_high is not None,
        "--eps_clip_low_high gives both clip bounds",
        "Keep one of them: --eps_clip for a symmetric clip, --eps_clip_low_high LOW HIGH for clip-higher.",
        openrlhf=True,
    ),
    Rule(
        "dual_clip",
        _loss_has_no_dual_clip,
        lambda c: f"the {c.policy_loss_type} policy loss has no dual clip",
        "Drop --dual_clip, or use --policy_loss_type ppo.",
    ),
    Rule(
        "min_lr_ratio",
        lambda c: c.lr_scheduler == "constant_with_warmup",
        "the learning rate stays constant "
        "after its warm-up (--lr_scheduler constant_with_warmup, hybrid's default; OpenRLHF's is cosine)",
        "Add --lr_scheduler cosine_with_min_lr to decay to it, or drop it.",
    ),
    # ---- engine/trainer mismatch ----------------------------------------------------------------------------------
    *(
        Rule(
            name,
            lambda c: not c.enable_vllm_is_correction,
            "the rollout correction is off (--no_enable_vllm_is_correction)",
            f"Drop --{name}, or turn the correction on.",
        )
        for name in ("vllm_is_truncated_threshold", "use_icepop", "vllm_is_correction_type")
    ),
    # ---- asynchronous training ------------------------------------------------------------------------------------
    Rule(
        "async_max_staleness",
        lambda c: not c.async_train,
        "only an asynchronous run (--async_train) trains on samples of older weights",
        "Add --async_train, or drop it.",
        openrlhf=True,
    ),
    Rule(
        "partial_rollout",
        lambda c: not c.async_train,
        "it pauses generations at a weight update, which only happens while they run with --async_train",
        "Add --async_train, or drop --partial_rollout.",
    ),
    Rule(
        "mps_engine_share",
        lambda c: c.mps == "off" or not c.async_train,
        lambda c: (
            "--mps off starts no CUDA MPS daemon"
            if c.mps == "off"
            else "without --async_train the engines and the trainers take turns on a GPU (a share only slows each)"
        ),
        "Add --mps on (or auto) and --async_train, or drop it.",
    ),
    # ---- batches --------------------------------------------------------------------------------------------------
    *(
        Rule(
            name,
            lambda c: not c.use_dynamic_batch,
            "micro-batches hold a fixed number of samples (no --use_dynamic_batch), so there is no token budget",
            "Add --use_dynamic_batch, or drop it.",
        )
        for name in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu")
    ),
    # ---- DAPO -----------------------------------------------------------------------------------------------------
    Rule(
        "overlong_penalty_factor",
        lambda c: c.overlong_buffer_len is None,
        "the overlong penalty applies over the last --overlong_buffer_len tokens, and none is given",
        "Add --overlong_buffer_len N, or drop it.",
        openrlhf=True,
    ),
    *(
        Rule(
            name,
            lambda c: not c.dynamic_filtering,
            "--dynamic_filtering is off",
            "Add --dynamic_filtering, or drop it.",
        )
        for name in ("dynamic_filtering_reward_range", "dynamic_filtering_max_rounds")
    ),
    # ---- agents ---------------------------------------------------------------------------------------------------
    *(
        Rule(
            name,
            lambda c: not c.uses_agent,
            "the run has no environment (single-turn rollouts)",
            "Add --agent_func_path FILE.py, or drop it.",
        )
        for name in ("max_turns", "max_new_tokens_per_turn", "agent_timeout_s", "agent_on_error")
    ),
    # ---- data -----------------------------------------------------------------------------------------------------
    *(
        Rule(
            name,
            lambda c: c.prompt_data is not None,
            "the prompts come from --prompt_data, not a built-in task",
            "Drop it, or drop --prompt_data to train on the built-in task.",
        )
        for name in ("task", "task_length")
    ),
    *(
        Rule(
            name,
            lambda c: c.prompt_data is None,
            "there is no --prompt_data (the prompts are the built-in task's)",
            "Give --prompt_data FILE, or drop it.",
        )
        for name in ("prompt_split", "prompt_data_probs")
    ),
    *(
        Rule(  # the evaluation prompts are read with them too
            name,
            lambda c: c.prompt_data is None and c.eval_dataset is None,
            "there is no --prompt_data nor --eval_dataset (the prompts are the built-in task's)",
            "Give --prompt_data FILE (or --eval_dataset FILE), or drop it.",
        )
        for name in ("input_key", "label_key", "input_template")
    ),
    *(
        Rule(
            name,
            lambda c: c.eval_dataset is None,
            "there is no --eval_dataset (no evaluation runs)",
            "Add --eval_dataset FILE (held-out prompts, read like --prompt_data), or drop it.",
            openrlhf=name != "eval_pass_threshold",  # OpenRLHF reads its --eval.* only with --eval.dataset too
        )
        for name in (
            "eval_steps",
            "eval_split",
            "eval_temperature",
            "eval_n_samples_per_prompt",
            "eval_pass_threshold",
        )
    ),
    Rule(
        "input_template",
        lambda c: c.apply_chat_template,
        "--apply_chat_template renders the prompts with the tokenizer's template instead",
        "Keep one of them.",
        openrlhf=True,
    ),
    # ---- logging --------------------------------------------------------------------------------------------------
    *(
        Rule(
            name,
            lambda c: not c.use_wandb,
            "nothing is logged to Weights & Biases (no --use_wandb)",
            "Add --use_wandb (an API key, or True for the current login), or drop it.",
            openrlhf=True,
        )
        for name in ("wandb_project", "wandb_run_name")
    ),
)


def covered_fields() -> frozenset[str]:
    return frozenset(r.field for r in RULES)


def set_fields(config: Any) -> frozenset[str]:
    """The fields the user set to something other than their default (see the module docstring)."""
    import dataclasses

    given = getattr(config, "given_fields", None)
    out = set()
    for f in dataclasses.fields(config):
        # default_factory is not MISSING there (every field has a default), which mypy cannot narrow
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        value = getattr(config, f.name)
        if _same(value, default):
            continue
        if given is not None:
            if f.name in given:
                out.add(f.name)
        elif not (f.name in DEMO_SETTINGS and _same(value, DEMO_SETTINGS[f.name])):
            out.add(f.name)
    return frozenset(out)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # a pair from YAML is a list
        return tuple(a) == tuple(b)
    return a == b


def findings(config: Any) -> list[tuple[Rule, str]]:
    """Each set field that does nothing in ``config``, with its first applying rule and that rule's verdict."""
    openrlhf_line = bool(getattr(config, "openrlhf_line", False))
    chosen = set_fields(config)
    out, seen = [], set()
    for rule in RULES:
        if rule.field in chosen and rule.field not in seen and rule.when(config):
            seen.add(rule.field)
            out.append((rule, rule.verdict(openrlhf_line)))
    return out


def check(config: Any) -> list[str]:
    """Raise a :class:`ConfigError` for the first set field that does nothing (refused); return the notes of the
    ones an OpenRLHF command line passes (see the module docstring)."""
    notes = []
    for rule, verdict in findings(config):
        reason = rule.text(rule.reason, config)
        if verdict == "refuse":
            raise ConfigError(rule.field, f"{reason}, so --{rule.field} would do nothing.", rule.text(rule.fix, config))
        notes.append(f"--{rule.field} has no effect here: {reason} (OpenRLHF ignores it too).")
    return notes
