"""What an OpenRLHF command line means, so that one pasted after ``hybrid ppo`` runs unchanged.

Which flags exist and what each means is the table in :mod:`hybrid_cli.openrlhf_flags`; this module holds what is
*not* given: the defaults. hybrid's own default is the hybrid engine (every model and the engines colocated, the
residency planner deciding who sleeps, the built-in ``hf`` engine, the CPU demo's sizes). OpenRLHF's
``train_ppo_ray`` defaults are the opposite (nothing colocated, 8 GPUs per role, rollout batch 1024, bf16, no
engines: generate with the actor's own model).

**Which defaults a command line gets -- what a user would expect.** Someone who pastes an OpenRLHF script expects
OpenRLHF's run: its 64-GPU "without hybrid engine" command must not silently become colocated. Someone who adds
``--vllm_num_engines 2`` to the demo expects the demo with two engines, not a switch to vLLM, 8 GPUs per role and
batches of 1024. So OpenRLHF's defaults (:func:`openrlhf_defaults`) apply to a command line that *is* an OpenRLHF
one: it uses OpenRLHF's dotted spelling (``--vllm.num_engines``: only OpenRLHF >= 0.10.2 scripts do), or it names its
own model (``--pretrain``) *and* places roles the OpenRLHF way (:data:`PLACEMENT_FLAGS`). Either way a note lists
every default taken. The demo (no ``--pretrain``) with a placement flag keeps hybrid's defaults, and a note says so.
``--placement`` (RLinf-style ranges) is hybrid's own way and never takes OpenRLHF's defaults.

The defaults are read from the same data file as the flags (OpenRLHF 0.11.2's parser), only for where roles run,
the engines, the batch shape and precision; algorithm hyperparameters keep the subcommand's defaults (``hybrid grpo``
means GRPO's, whatever placement flags come with it). ``--vllm_enable_sleep`` / ``--deepspeed_enable_sleep`` are
not defaulted: not given, the residency planner decides what each role keeps on its GPUs, as always (given, those
roles sleep; ``--no_...`` keeps them resident).
"""

from __future__ import annotations

from typing import Any, Mapping

from . import openrlhf_flags as orl

#: Flags that place roles the OpenRLHF way (see the module docstring).
PLACEMENT_FLAGS = frozenset({
    "actor_num_nodes", "actor_num_gpus_per_node", "critic_num_nodes", "critic_num_gpus_per_node",
    "ref_num_nodes", "ref_num_gpus_per_node", "reward_num_nodes", "reward_num_gpus_per_node",
    "vllm_num_engines", "vllm_tensor_parallel_size", "colocate_all_models", "colocate_actor_ref",
    "colocate_critic_reward",
})

#: Our settings that take OpenRLHF's default in an OpenRLHF command line (the values come from the data file).
DEFAULTED_FIELDS = (
    "colocate_all_models", "colocate_actor_ref", "colocate_critic_reward",
    "actor_num_gpus_per_node", "critic_num_gpus_per_node", "ref_num_gpus_per_node",
    "reward_num_gpus_per_node", "vllm_num_engines", "vllm_gpu_memory_utilization", "rollout_batch_size",
    "micro_rollout_batch_size", "train_batch_size", "micro_train_batch_size", "max_samples", "bf16", "flash_attn",
    "input_key",
)


def openrlhf_default_values() -> dict[str, Any]:
    """OpenRLHF's defaults for :data:`DEFAULTED_FIELDS`, from its parser (the data file)."""
    out: dict[str, Any] = {}
    for flag in orl.openrlhf_flags().values():
        if not flag.dotted:
            continue
        rule = orl.rule_for(flag.name)
        if rule.kind == "same" and rule.field in DEFAULTED_FIELDS:
            out[rule.field] = bool(flag.default) if flag.is_switch else flag.default
        elif rule.kind == "convert" and rule.field in DEFAULTED_FIELDS and flag.default is not None:
            ctx = orl.Context({}, {}, frozenset(DEFAULTED_FIELDS))
            out.update({k: v for k, v in rule.fn(flag.default, ctx, flag.name).items() if k in DEFAULTED_FIELDS})
    if out.get("vllm_num_engines") is None:  # OpenRLHF: no --vllm_num_engines = generate with the actor's model
        out["vllm_num_engines"] = 0
    return out


def is_openrlhf_command(given: Mapping[str, Any], dotted_used: bool) -> bool:
    if "placement" in given:
        return False
    return dotted_used or ("pretrain" in given and bool(PLACEMENT_FLAGS & set(given)))


def openrlhf_defaults(given: Mapping[str, Any], *, dotted_used: bool = False) -> dict[str, Any]:
    """OpenRLHF's defaults for the settings not in ``given``, when ``given`` is an OpenRLHF command line."""
    if not is_openrlhf_command(given, dotted_used):
        return {}
    implied = {k: v for k, v in openrlhf_default_values().items() if k not in given}
    if "backend" not in given:  # OpenRLHF's engines are vLLM; without engines it generates with transformers
        engines = given.get("vllm_num_engines", implied.get("vllm_num_engines"))
        implied["backend"] = "vllm" if engines else "hf"
    return implied


def without_engines(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``--vllm_num_engines 0``: OpenRLHF generates with the actor's own model; hybrid puts a built-in (transformers)
    engine on each actor GPU, taking turns with the actor there (the residency plan). A tensor-parallel size is then
    unused (as in OpenRLHF)."""
    if values.get("vllm_num_engines", 1) != 0:
        return {}, []
    changes: dict[str, Any] = {}
    notes = ["--vllm_num_engines 0: OpenRLHF generates with the actor's own model; here the built-in transformers "
             "engine runs on each actor GPU, taking turns with the actor (no vLLM)."]
    if values.get("vllm_tensor_parallel_size", 1) > 1:
        changes["vllm_tensor_parallel_size"] = 1
        notes.append(f"--vllm_tensor_parallel_size {values['vllm_tensor_parallel_size']} is unused without engines "
                     "(as in OpenRLHF).")
    return changes, notes


#: Help for the flags whose config comment is missing or too terse for ``--help``.
HELP = {
    "pretrain": "actor/initial policy: a local Hugging Face model folder (default: the tiny built-in demo model)",
    "reward_pretrain": "reward model: a local sequence-classification model folder",
    "actor_num_nodes": "actor nodes", "actor_num_gpus_per_node": "actor GPUs per node (data-parallel ranks)",
    "critic_num_nodes": "critic nodes (PPO with gae)", "critic_num_gpus_per_node": "critic GPUs per node",
    "ref_num_nodes": "reference model nodes", "ref_num_gpus_per_node": "reference model GPUs per node",
    "reward_num_nodes": "reward model nodes", "reward_num_gpus_per_node": "reward model GPUs per node",
    "vllm_num_engines": "inference engines (any --backend); 0: a built-in engine on each actor GPU, as OpenRLHF "
                        "generates with the actor", "vllm_tensor_parallel_size": "GPUs per engine (tensor parallel)",
    "colocate_all_models": "hybrid engine: engines, actor, reference, reward and critic share the same GPUs",
    "colocate_actor_ref": "actor and reference model share GPUs",
    "colocate_critic_reward": "critic and reward model share GPUs",
    "vllm_gpu_memory_utilization": "fraction of each GPU an engine takes for weights + KV cache (vLLM/SGLang)",
    "vllm_enable_sleep": "engines free their GPU memory between rollouts (needs colocation)",
    "deepspeed_enable_sleep": "trainers offload params/grads/optimizer to host memory between turns (needs colocation)",
    "vllm_sync_backend": "collective backend of the actor-to-engine weight broadcast (nccl | gloo)",
    "enforce_eager": "no CUDA graphs in the engines",
    "enable_prefix_caching": "prefix caching in the engines",
    "zero_stage": "DeepSpeed ZeRO stage (0-3)", "bf16": "bf16 mixed precision", "adam_offload": "Adam states on the CPU",
    "bf16_master_weights": "the ZeRO optimizer keeps its master weights and gradients in bf16, not fp32 (DeepSpeed's "
                           "bf16_master_weights_and_grads; needs --bf16, ZeRO 1-3, and --bf16_optimizer_states or "
                           "--adam_offload)",
    "bf16_optimizer_states": "Adam's m and v in bf16 too (needs --bf16_master_weights): 6 bytes of optimizer state "
                             "per parameter on the GPU instead of 12, as a pure-bf16 trainer keeps it",
    "gradient_checkpointing": "recompute activations in the backward pass",
    "packing_samples": "pack samples without padding", "flash_attn": "flash attention 2 in the trainers",
    "actor_learning_rate": "actor learning rate", "critic_learning_rate": "critic learning rate",
    "rollout_batch_size": "prompts per step", "n_samples_per_prompt": "completions per prompt",
    "micro_rollout_batch_size": "samples per GPU per forward pass of the inference phase",
    "train_batch_size": "samples per optimizer step (all ranks)", "micro_train_batch_size": "samples per GPU per forward/backward",
    "max_epochs": "PPO epochs over each rollout batch", "max_samples": "use at most this many prompts of --prompt_data",
    "max_steps": "stop after this many steps", "prompt_max_len": "longer prompts are dropped (and counted)",
    "generate_max_len": "most new tokens per completion",
    "advantage_estimator": "gae (PPO), reinforce (REINFORCE++), group_norm (GRPO), rloo, reinforce_baseline, dr_grpo, ...",
    "init_kl_coef": "KL penalty coefficient", "normalize_reward": "running mean/std normalisation of rewards",
    "prompt_data": "JSONL/JSON/Parquet file, datasets folder, or a folder of data files",
    "input_key": "the field holding the prompt (text or chat messages)", "label_key": "field passed to rule rewards as the label",
    "apply_chat_template": "render prompts with the tokenizer's chat template (add_generation_prompt=True)",
    "save_path": "run folder: final model, metrics.jsonl, logs", "ckpt_path": "checkpoint folder (default: <save_path>/checkpoints)",
    "save_steps": "checkpoint every N steps (-1: only at the end)", "save_hf_ckpt": "also save each checkpoint in Hugging Face format",
    "resume": "continue from the last checkpoint in --ckpt_path",
    "use_wandb": "log to Weights & Biases: an API key, or True to use the current login",
    "wandb_project": "W&B project", "wandb_run_name": "W&B run name",
    "address": "Ray cluster address (default: RAY_ADDRESS, else a new local Ray)",
    "ray_temp_dir": "temp/log folder of a new local Ray (default: Ray's /tmp/ray)",
    "ray_log_max_mb": "rotate each Ray log file at this size",
    "num_gpus": "GPUs a new local Ray declares (fake GPUs on a CPU machine)",
    "backend": "inference engine: hf (built-in), vllm, sglang",
    "reward_fn": "rule reward: module:function or file.py:function (hybrid's signature); OpenRLHF's reward (alias "
                 "--remote_rm_url): a file.py defining reward_func(queries, prompts, labels), or http(s) reward "
                 "server URL(s)",
    "prompt_data_probs": "sampling weights of the --prompt_data datasets (comma-separated), as OpenRLHF mixes them",
    "ref_reward_offload": "the residency plan lets the reference and reward models sleep between their turns",
    "gpus_per_node": "GPUs per node: plan nodes, engines within a node (default: a multi-node role's GPUs per node)",
}
