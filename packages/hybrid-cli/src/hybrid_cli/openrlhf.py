"""What an OpenRLHF command line means, so that one pasted after ``hybrid ppo`` runs unchanged.

Three things live here: the help text of the OpenRLHF flags, the OpenRLHF flags we know but do not support yet
(an error says so instead of ignoring them), and OpenRLHF's placement defaults.

**Placement defaults.** hybrid's own default is the hybrid engine: every model and the engines colocated, engines
and trainers sleeping while another role works, the built-in ``hf`` engine. In OpenRLHF each of those is *off*
unless its flag is given, and the engines are vLLM. So: as soon as a command line (or ``--config`` file) places
roles the OpenRLHF way -- any ``--*_num_nodes``, ``--*_num_gpus_per_node``, ``--vllm_num_engines``,
``--vllm_tensor_parallel_size`` or ``--colocate_*`` -- every setting of :data:`OPENRLHF_DEFAULTS` that is not
given takes OpenRLHF's default: ``--colocate_all_models``, ``--vllm_enable_sleep`` and ``--deepspeed_enable_sleep``
off, ``--backend vllm``, 8 GPUs per role, OpenRLHF's batch sizes. OpenRLHF's 64-GPU "without hybrid engine" command
therefore gets dedicated GPUs per role, as it does there. (One difference stays: without ``--vllm_num_engines``
OpenRLHF generates with the actor's own model; hybrid always has engines, one by default.)
"""

from __future__ import annotations

from typing import Any, Mapping

#: OpenRLHF names that mean one of our fields.
ALIASES = {
    "load_checkpoint": "resume_if_exists",  # OpenRLHF: load the checkpoint if there is one, else start fresh
}

#: Flags that place roles the OpenRLHF way (see the module docstring).
PLACEMENT_FLAGS = frozenset({
    "actor_num_nodes", "actor_num_gpus_per_node", "critic_num_nodes", "critic_num_gpus_per_node",
    "ref_num_nodes", "ref_num_gpus_per_node", "reward_num_nodes", "reward_num_gpus_per_node",
    "vllm_num_engines", "vllm_tensor_parallel_size", "colocate_all_models", "colocate_actor_ref",
    "colocate_critic_reward",
})

#: OpenRLHF's defaults (train_ppo_ray) where they differ from hybrid's, for where roles run and the batch shape.
#: Each applies only when its own flag is not given. Algorithm hyperparameters (lambd, value_clip, KL, ...) keep
#: the subcommand's defaults: ``hybrid grpo`` chooses GRPO's, whatever placement flags come with it.
OPENRLHF_DEFAULTS: dict[str, Any] = {
    "colocate_all_models": False, "vllm_enable_sleep": False, "deepspeed_enable_sleep": False, "backend": "vllm",
    "actor_num_gpus_per_node": 8, "critic_num_gpus_per_node": 8, "ref_num_gpus_per_node": 8,
    "reward_num_gpus_per_node": 8, "vllm_gpu_memory_utilization": 0.95,
    "rollout_batch_size": 1024, "micro_rollout_batch_size": 8, "train_batch_size": 128, "micro_train_batch_size": 4,
    "max_samples": 100_000_000,
}


def openrlhf_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """OpenRLHF's defaults for the settings not in ``given``, when ``given`` places roles the OpenRLHF way."""
    if "placement" in given or not PLACEMENT_FLAGS & set(given):
        return {}
    return {k: v for k, v in OPENRLHF_DEFAULTS.items() if k not in given}


#: OpenRLHF flags that hybrid knows but does not support yet, with why / what to use instead.
UNSUPPORTED = {
    "remote_rm_url": "remote reward servers; use --reward_fn module:function for a rule reward",
    "agent_func_path": "multi-turn agent rollouts",
    "async_train": "asynchronous rollout/training; hybrid runs the colocated synchronous loop",
    "vllm_sync_with_ray": "weight sync over Ray's object store; hybrid uses --vllm_sync_backend",
    "ref_reward_offload": "ZeRO-3 parameter offload of the reference/reward models; they sleep when colocated",
    "lora_rank": "LoRA", "lora_alpha": "LoRA", "lora_dropout": "LoRA", "target_modules": "LoRA",
    "load_in_4bit": "4-bit quantised training",
    "zpg": "ZeRO++ hierarchical partitioning",
    "ds_tensor_parallel_size": "DeepSpeed tensor parallelism (AutoTP)",
    "ring_attn_size": "ring attention (sequence parallelism)", "ring_head_stride": "ring attention (sequence parallelism)",
    "use_dynamic_batch": "token-budget dynamic batching", "rollout_max_tokens_per_gpu": "token-budget dynamic batching",
    "train_max_tokens_per_gpu": "token-budget dynamic batching",
    "pretrain_data": "the PTX (pre-training) loss", "pretrain_data_probs": "the PTX (pre-training) loss",
    "pretrain_split": "the PTX (pre-training) loss", "ptx_coef": "the PTX (pre-training) loss",
    "prompt_data_probs": "mixing several prompt datasets",
    "eval_dataset": "evaluation during training", "eval_split": "evaluation during training",
    "eval_steps": "evaluation during training", "eval_temperature": "evaluation during training",
    "eval_n_samples_per_prompt": "evaluation during training",
    "input_template": "prompt templates; use --apply_chat_template",
    "tokenizer_chat_template": "overriding the tokenizer's chat template",
    "dynamic_filtering": "dynamic sampling filters", "dynamic_filtering_reward_range": "dynamic sampling filters",
    "freezing_actor_steps": "critic warm-up with a frozen actor",
    "save_value_network": "saving the critic in Hugging Face format",
    "value_head_prefix": "custom value-head names", "head_prefix": "custom value-head names",
    "no_advantage_std_norm": "turning off advantage std-normalisation",
    "aux_loss_coef": "MoE auxiliary loss",
    "enable_ema": "EMA of the actor", "ema_beta": "EMA of the actor",
    "use_liger_kernel": "Liger kernels", "deepcompile": "DeepSpeed compile", "overlap_comm": "DeepSpeed overlap_comm",
    "grad_accum_dtype": "a gradient-accumulation dtype", "disable_fast_tokenizer": "slow tokenizers",
    "gradient_checkpointing_use_reentrant": "reentrant gradient checkpointing",
    "actor_init_on_gpu": "initialising the actor on the GPU", "disable_ds_ckpt": "skipping DeepSpeed checkpoints",
    "use_ds_universal_ckpt": "DeepSpeed universal checkpoints", "max_ckpt_mem": "a checkpoint size budget",
    "lr_scheduler": "learning-rate schedules other than warmup + constant",
    "max_len": "a total length; use --prompt_max_len and --generate_max_len",
    "wandb_org": "W&B organisations", "wandb_group": "W&B groups", "use_ms": "ModelScope downloads",
    "local_rank": "the DeepSpeed launcher; hybrid starts its workers through Ray",
    "full_determinism": "full determinism mode", "perf": "OpenRLHF's performance statistics",
    "policy_loss_type": "policy losses other than the PPO clip loss",
    "attn_implementation": "choosing the attention kernel; use --flash_attn",
    "vllm_generate_batch_size": "a separate generation batch size", "rollout_tasks_per_gpu": "Ray task reservations",
    "enable_vllm_is_correction": "importance-sampling correction of engine log-probs",
    "vllm_is_truncated_threshold": "importance-sampling correction of engine log-probs",
    "async_queue_size": "asynchronous rollout/training",
    "overlong_buffer_len": "overlong-response penalties", "overlong_penalty_factor": "overlong-response penalties",
    "use_kl_estimator_k3": "the old switch; use --kl_estimator k3",
}

#: Help for the flags whose config comment is missing or too terse for ``--help``.
HELP = {
    "pretrain": "actor/initial policy: a local Hugging Face model folder (default: the tiny built-in demo model)",
    "reward_pretrain": "reward model: a local sequence-classification model folder",
    "actor_num_nodes": "actor nodes", "actor_num_gpus_per_node": "actor GPUs per node (data-parallel ranks)",
    "critic_num_nodes": "critic nodes (PPO with gae)", "critic_num_gpus_per_node": "critic GPUs per node",
    "ref_num_nodes": "reference model nodes", "ref_num_gpus_per_node": "reference model GPUs per node",
    "reward_num_nodes": "reward model nodes", "reward_num_gpus_per_node": "reward model GPUs per node",
    "vllm_num_engines": "inference engines (any --backend)", "vllm_tensor_parallel_size": "GPUs per engine (tensor parallel)",
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
}
