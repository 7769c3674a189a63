"""``--help`` text for the training flags whose config comment is missing or too terse (most are OpenRLHF's flags:
the text says what each means here). :func:`hybrid_cli.flags.field_specs` takes a field's help from here first, then
from the comment beside the field in the config dataclass."""

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
    "zero_stage": "DeepSpeed ZeRO stage (0-3)", "bf16": "bf16 mixed precision",
    "adam_offload": "Adam states on the CPU",
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
    "train_batch_size": "samples per optimizer step (all ranks)",
    "micro_train_batch_size": "samples per GPU per forward/backward",
    "max_epochs": "PPO epochs over each rollout batch", "max_samples": "use at most this many prompts of --prompt_data",
    "max_steps": "stop after this many steps", "prompt_max_len": "longer prompts are dropped (and counted)",
    "generate_max_len": "most new tokens per completion",
    "advantage_estimator": "gae (PPO), reinforce (REINFORCE++), group_norm (GRPO), rloo, reinforce_baseline, "
                           "dr_grpo, ...",
    "init_kl_coef": "KL penalty coefficient", "normalize_reward": "running mean/std normalisation of rewards",
    "prompt_data": "JSONL/JSON/Parquet file, datasets folder, or a folder of data files",
    "input_key": "the field holding the prompt (text or chat messages)",
    "label_key": "field passed to rule rewards as the label",
    "apply_chat_template": "render prompts with the tokenizer's chat template (add_generation_prompt=True)",
    "save_path": "run folder: final model, metrics.jsonl, logs",
    "ckpt_path": "checkpoint folder (default: <save_path>/checkpoints)",
    "save_steps": "checkpoint every N steps (-1: only at the end)",
    "save_hf_ckpt": "also save each checkpoint in Hugging Face format",
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
