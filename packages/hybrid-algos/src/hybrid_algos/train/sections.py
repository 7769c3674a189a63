"""The run's settings in sections, each owned and validated by the package that uses it.

:class:`~hybrid_algos.train.config.RLConfig` is the flat surface users write (CLI flags, ``--config`` files, OpenRLHF's
names). Below it nothing reads the flat names: each package takes its own section, in its own words —

=========== ===================================================== =====================================
section     class (owner)                                         what it decides
=========== ===================================================== =====================================
engine      ``hybrid_engines.adapter.EngineSettings``             the inference engines
sync        ``hybrid_engines.weight_sync.settings.SyncSettings``  trainer -> engine weight sync
placement   ``hybrid_core.placement.settings.PlacementSettings``  which GPUs each role gets
residency   ``hybrid_core.residency.settings.ResidencySettings``  what stays on each GPU between phases
trainer     ``hybrid_algos.train.workers.settings.TrainerSettings`` DeepSpeed, precision, optimizer
algorithm   ``hybrid_algos.settings.AlgorithmSettings``           advantages, losses, KL, corrections
rollout     ``hybrid_algos.train.rollout_settings.RolloutSettings`` batch shape, sampling, async
run         ``hybrid_algos.train.run_settings.RunSettings``       saving, logging, Ray, deadlines, MPS
models      ``hybrid_algos.train.model_settings.ModelSettings``   model folders, rewards, the built-in task
evaluation  ``hybrid_algos.train.eval_settings.EvalSettings``     held-out prompts scored during training
=========== ===================================================== =====================================

:data:`TABLE` is the one place a flat name meets a section's name. A section's ``validate()`` names its settings as
``section.name`` (e.g. ``engine.gpu_memory_utilization``); :func:`in_flag_words` turns such an error into the flat
names the user wrote (``--vllm_gpu_memory_utilization``), so core and the engines never spell a CLI flag.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybrid_algos.errors import AlgoInputError
from hybrid_core.errors import ConfigError

#: section -> "module:Class" of its owner (imported on first use: core and the engines stay optional imports here).
SECTIONS: dict[str, str] = {
    "engine": "hybrid_engines.adapter:EngineSettings",
    "sync": "hybrid_engines.weight_sync.settings:SyncSettings",
    "placement": "hybrid_core.placement.settings:PlacementSettings",
    "residency": "hybrid_core.residency.settings:ResidencySettings",
    "trainer": "hybrid_algos.train.workers.settings:TrainerSettings",
    "algorithm": "hybrid_algos.settings:AlgorithmSettings",
    "rollout": "hybrid_algos.train.rollout_settings:RolloutSettings",
    "run": "hybrid_algos.train.run_settings:RunSettings",
    "models": "hybrid_algos.train.model_settings:ModelSettings",
    "evaluation": "hybrid_algos.train.eval_settings:EvalSettings",
}

#: (flat name, "section.name"). A flat name may feed several sections (``bf16``: the trainer's precision and the
#: engines' dtype); each "section.name" has exactly one flat name (the error translation's reverse map).
TABLE: tuple[tuple[str, str], ...] = (
    # ---- engine
    ("backend", "engine.backend"),
    ("vllm_num_engines", "engine.num_engines"),
    ("vllm_tensor_parallel_size", "engine.tensor_parallel_size"),
    ("vllm_gpu_memory_utilization", "engine.gpu_memory_utilization"),
    ("enforce_eager", "engine.enforce_eager"),
    ("enable_prefix_caching", "engine.enable_prefix_caching"),
    ("bf16", "engine.bf16"),
    ("seed", "engine.seed"),
    ("trust_remote_code", "engine.trust_remote_code"),
    ("vllm_enable_sleep", "engine.sleep"),
    ("engine_sleep_level", "engine.sleep_level"),
    ("seeded_sampling", "engine.seeded_sampling"),
    # ---- sync
    ("weight_sync_bucket_mb", "sync.bucket_mb"),
    ("weight_sync", "sync.transport"),
    ("verify_weight_sync", "sync.verify"),
    ("vllm_sync_backend", "sync.group_backend"),
    ("lora_sync", "sync.lora"),
    # ---- placement
    ("actor_num_nodes", "placement.actor_num_nodes"),
    ("actor_num_gpus_per_node", "placement.actor_num_gpus_per_node"),
    ("critic_num_nodes", "placement.critic_num_nodes"),
    ("critic_num_gpus_per_node", "placement.critic_num_gpus_per_node"),
    ("ref_num_nodes", "placement.ref_num_nodes"),
    ("ref_num_gpus_per_node", "placement.ref_num_gpus_per_node"),
    ("reward_num_nodes", "placement.reward_num_nodes"),
    ("reward_num_gpus_per_node", "placement.reward_num_gpus_per_node"),
    ("colocate_all_models", "placement.colocate_all"),
    ("colocate_actor_ref", "placement.colocate_actor_ref"),
    ("colocate_critic_reward", "placement.colocate_critic_reward"),
    ("placement", "placement.ranges"),
    ("gpus_per_node", "placement.gpus_per_node"),
    # ---- residency
    ("residency", "residency.mode"),
    ("residency_pins", "residency.pins"),
    ("gpu_memory_gb", "residency.gpu_memory_gb"),
    ("host_memory_gb", "residency.host_memory_gb"),
    ("gpu_memory_usable", "residency.gpu_memory_usable"),
    ("gpu_context_gb", "residency.gpu_context_gb"),
    ("residency_overlap", "residency.overlap"),
    ("deepspeed_enable_sleep", "residency.trainer_sleep"),
    ("ref_reward_offload", "residency.frozen_sleep"),
    # ---- trainer (helper T adds its rows here)
    ("trainer", "trainer.backend"),
    ("zero_stage", "trainer.zero_stage"),
    ("bf16", "trainer.bf16"),
    ("adam_offload", "trainer.adam_offload"),
    ("bf16_master_weights", "trainer.bf16_master_weights"),
    ("bf16_optimizer_states", "trainer.bf16_optimizer_states"),
    ("gradient_checkpointing", "trainer.gradient_checkpointing"),
    ("flash_attn", "trainer.flash_attn"),
    ("packing_samples", "trainer.packing"),
    ("use_dynamic_batch", "trainer.dynamic_batch"),
    ("train_max_tokens_per_gpu", "trainer.train_max_tokens"),
    ("rollout_max_tokens_per_gpu", "trainer.rollout_max_tokens"),
    ("actor_learning_rate", "trainer.actor_lr"),
    ("critic_learning_rate", "trainer.critic_lr"),
    ("lr_warmup_ratio", "trainer.lr_warmup_ratio"),
    ("lr_scheduler", "trainer.lr_scheduler"),
    ("min_lr_ratio", "trainer.min_lr_ratio"),
    ("l2", "trainer.weight_decay"),
    ("adam_betas", "trainer.adam_betas"),
    ("max_norm", "trainer.max_grad_norm"),
    ("lora_rank", "trainer.lora_rank"),
    ("lora_alpha", "trainer.lora_alpha"),
    ("lora_dropout", "trainer.lora_dropout"),
    ("lora_target_modules", "trainer.lora_target_modules"),
    # ---- algorithm (helper T adds its rows here)
    ("advantage_estimator", "algorithm.estimator"),
    ("gamma", "algorithm.gamma"),
    ("lambd", "algorithm.lam"),
    ("init_kl_coef", "algorithm.kl_coef"),
    ("kl_target", "algorithm.kl_target"),
    ("kl_horizon", "algorithm.kl_horizon"),
    ("kl_estimator", "algorithm.kl_estimator"),
    ("use_kl_loss", "algorithm.kl_loss"),
    ("policy_loss_type", "algorithm.policy_loss"),
    ("loss_agg_mode", "algorithm.agg_mode"),
    ("eps_clip", "algorithm.clip_eps"),
    ("eps_clip_low_high", "algorithm.clip_low_high"),
    ("dual_clip", "algorithm.dual_clip"),
    ("value_clip", "algorithm.value_clip"),
    ("entropy_loss_coef", "algorithm.entropy_coef"),
    ("recompute_old_logprobs", "algorithm.recompute_old_logprobs"),
    ("normalize_reward", "algorithm.normalize_reward"),
    ("reward_clip_range", "algorithm.reward_clip"),
    ("enable_vllm_is_correction", "algorithm.correction"),
    ("vllm_is_correction_type", "algorithm.correction_type"),
    ("vllm_is_truncated_threshold", "algorithm.correction_threshold"),
    ("use_icepop", "algorithm.use_icepop"),
    ("engine_logprobs", "algorithm.engine_logprobs"),
    ("dynamic_filtering", "algorithm.dynamic_filtering"),
    ("dynamic_filtering_reward_range", "algorithm.filter_reward_range"),
    ("dynamic_filtering_max_rounds", "algorithm.filter_max_rounds"),
    ("overlong_buffer_len", "algorithm.overlong_buffer_len"),
    ("overlong_penalty_factor", "algorithm.overlong_penalty_factor"),
    ("mask_truncated_completions", "algorithm.mask_truncated_completions"),
    ("distill_coef", "algorithm.distill_coef"),
    ("distill_task_coef", "algorithm.distill_task_coef"),
    # ---- rollout (helper U adds its rows here)
    ("rollout_batch_size", "rollout.rollout_batch_size"),
    ("n_samples_per_prompt", "rollout.n_samples_per_prompt"),
    ("micro_rollout_batch_size", "rollout.micro_rollout_batch_size"),
    ("train_batch_size", "rollout.train_batch_size"),
    ("micro_train_batch_size", "rollout.micro_train_batch_size"),
    ("max_epochs", "rollout.max_epochs"),
    ("num_episodes", "rollout.num_episodes"),
    ("max_samples", "rollout.max_samples"),
    ("max_steps", "rollout.max_steps"),
    ("prompt_max_len", "rollout.prompt_max_len"),
    ("generate_max_len", "rollout.generate_max_len"),
    ("temperature", "rollout.temperature"),
    ("top_p", "rollout.top_p"),
    ("top_k", "rollout.top_k"),
    ("async_train", "rollout.async_train"),
    ("async_max_staleness", "rollout.async_max_staleness"),
    ("partial_rollout", "rollout.partial_rollout"),
    ("prompt_data", "rollout.prompt_data"),
    ("input_key", "rollout.input_key"),
    ("label_key", "rollout.label_key"),
    ("apply_chat_template", "rollout.apply_chat_template"),
    ("prompt_split", "rollout.prompt_split"),
    ("prompt_data_probs", "rollout.prompt_data_probs"),
    ("input_template", "rollout.input_template"),
    ("image_key", "rollout.image_key"),
    ("max_images_per_prompt", "rollout.max_images_per_prompt"),
    ("seed", "rollout.seed"),
    ("agent_func_path", "rollout.agent_func_path"),
    ("max_turns", "rollout.max_turns"),
    ("max_new_tokens_per_turn", "rollout.max_new_tokens_per_turn"),
    ("agent_timeout_s", "rollout.agent_timeout_s"),
    ("agent_on_error", "rollout.agent_on_error"),
    # ---- run (helper U adds its rows here)
    ("save_path", "run.save_path"),
    ("ckpt_path", "run.ckpt_path"),
    ("save_steps", "run.save_steps"),
    ("save_hf_ckpt", "run.save_hf_ckpt"),
    ("max_ckpt_num", "run.max_ckpt_num"),
    ("final_checkpoint", "run.final_checkpoint"),
    ("resume", "run.resume"),
    ("resume_if_exists", "run.resume_if_exists"),
    ("overwrite", "run.overwrite"),
    ("trust_checkpoint", "run.trust_checkpoint"),
    ("logging_steps", "run.logging_steps"),
    ("profile_step", "run.profile_step"),
    ("use_wandb", "run.use_wandb"),
    ("wandb_project", "run.wandb_project"),
    ("wandb_run_name", "run.wandb_run_name"),
    ("use_tensorboard", "run.use_tensorboard"),
    ("seed", "run.seed"),
    ("address", "run.address"),
    ("ray_temp_dir", "run.ray_temp_dir"),
    ("ray_log_max_mb", "run.ray_log_max_mb"),
    ("num_gpus", "run.num_gpus"),
    ("call_timeout_s", "run.call_timeout_s"),
    ("step_timeout_s", "run.step_timeout_s"),
    ("mps", "run.mps"),
    ("mps_engine_share", "run.mps_engine_share"),
    # ---- models (helper U)
    ("pretrain", "models.pretrain"),
    ("trust_remote_code", "models.trust_remote_code"),
    ("reward_pretrain", "models.reward_pretrain"),
    ("teacher_pretrain", "models.teacher_pretrain"),
    ("reward_random_head", "models.reward_random_head"),
    ("reward_fn", "models.reward_fn"),
    ("critic_pretrain", "models.critic_pretrain"),
    ("task", "models.task"),
    ("task_length", "models.task_length"),
    ("tiny_model", "models.tiny_model"),
    ("plugins", "models.plugins"),
    # ---- evaluation
    ("eval_dataset", "evaluation.dataset"),
    ("eval_steps", "evaluation.steps"),
    ("eval_split", "evaluation.split"),
    ("eval_temperature", "evaluation.temperature"),
    ("eval_n_samples_per_prompt", "evaluation.n_samples_per_prompt"),
    ("eval_pass_threshold", "evaluation.pass_threshold"),
)

#: ``section.name``, or ``no_section.name`` for a switch turned off (``--no_flat_name``).
_PATH = re.compile(r"\b(no_)?((?:" + "|".join(SECTIONS) + r")\.[a-z_][a-z0-9_]*)\b")


#: "section.name" -> its flat name, and section -> {field: flat name}: the table read once (sections are built on
#: every access, some in a step's hot path)
_FLAT: dict[str, str] = {}
_FIELDS: dict[str, dict[str, str]] = {}
for _flat, _path in TABLE:
    _FLAT.setdefault(_path, _flat)
    _section, _, _field = _path.partition(".")
    _FIELDS.setdefault(_section, {})[_field] = _flat


@functools.cache
def section_class(name: str) -> type:
    module, _, cls = SECTIONS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def fields_of(name: str) -> dict[str, str]:
    """The section's settings that come from flat names: {section field: flat name}."""
    return dict(_FIELDS.get(name, {}))


def build(name: str, config: Any, **extra: Any) -> Any:
    """Section ``name`` of a flat config: every field the table maps, plus ``extra`` (derived values the section
    needs that no flag sets directly)."""
    values = {field: getattr(config, flat) for field, flat in _FIELDS.get(name, {}).items()}
    values.update(extra)
    return section_class(name)(**values)


def flag_of(path: str) -> str | None:
    """The flat name of ``section.name`` (None when no flag sets it)."""
    return _FLAT.get(path)


def in_flag_words(error: ConfigError | AlgoInputError) -> ConfigError:
    """``error`` with every ``section.name`` it mentions as the flag the user writes (``--flat_name``); its field
    becomes the flat name. Paths the table does not know are left as they are."""

    field = flag_of(error.field) or _PATH.sub(_flat_of, error.field)  # several at once ("a, b") name each
    problem = flag_text(error.problem)
    fix = flag_text(error.fix) if error.fix else error.fix
    kind = type(error) if isinstance(error, ConfigError) else ConfigError  # the math's own error type, too
    out = kind(field, problem, fix)
    out.__cause__ = error.__cause__
    return out


def _flat_of(match: re.Match[str], dashes: str = "") -> str:
    """A matched ``[no_]section.name`` as its flat name (``dashes`` before it), or as it was when no flag sets it."""
    flat = flag_of(match.group(2))
    return f"{dashes}{match.group(1) or ''}{flat}" if flat else match.group(0)


def flag_text(text: str) -> str:
    """``text`` with every ``section.name`` as its flag (``--flat_name``; ``no_section.name``: ``--no_flat_name``),
    for errors and notes alike."""
    return _PATH.sub(lambda m: _flat_of(m, "--"), text)


@contextmanager
def flag_words() -> Iterator[None]:
    """Within the block, a section's ConfigError (or the math's AlgoInputError) is re-raised in flag words
    (:func:`in_flag_words`)."""
    try:
        yield
    except (ConfigError, AlgoInputError) as error:
        raise in_flag_words(error) from error


def table_problems() -> list[str]:
    """What is wrong with :data:`TABLE` against the section classes and RLConfig (a test asserts none)."""
    # by name, as the section classes are: config builds its sections from here, so this module sits below it
    config = importlib.import_module(__name__.rpartition(".")[0] + ".config")
    flat_fields = {f.name for f in dataclasses.fields(config.RLConfig)}
    problems = []
    seen: dict[str, str] = {}
    for flat, path in TABLE:
        if flat not in flat_fields:
            problems.append(f"{flat}: not a field of RLConfig")
        if path in seen:
            problems.append(f"{path}: set by both {seen[path]} and {flat}")
        seen[path] = flat
        section, _, field = path.partition(".")
        if section not in SECTIONS:
            problems.append(f"{path}: no section {section!r}")
            continue
        try:
            cls = section_class(section)
        except (ImportError, AttributeError):
            continue  # a section not written yet is reported by the test of its owner
        if field not in {f.name for f in dataclasses.fields(cls)}:
            problems.append(f"{path}: {cls.__name__} has no field {field!r}")
    return problems
