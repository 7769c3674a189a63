"""Training configuration: one dataclass per algorithm, field names = OpenRLHF flag names.

``hybrid ppo --zero_stage 3`` sets ``PPOConfig.zero_stage``; a YAML file (``--config``) uses the same names. Every
check that can be made before Ray starts is made by :meth:`RLConfig.validate`, which raises
:class:`hybrid_core.errors.ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

from hybrid_core.errors import ConfigError

BACKENDS = ("hf", "vllm", "sglang")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
#: Built-in synthetic tasks (prompts + rule-based reward) used when no --prompt_data is given.
TASKS = ("copy", "copy_first", "reverse", "add")


@dataclass
class RLConfig:
    """Settings shared by PPO, GRPO and REINFORCE++. Defaults give the CPU demo (tiny model, built-in engine)."""

    # ---- models ---------------------------------------------------------------------------------------------
    pretrain: str | None = None  # HF model folder; None = the tiny built-in demo model (built from a config)
    trust_remote_code: bool = False  # run the Python code a model folder ships (auto_map); only for code you trust
    reward_pretrain: str | None = None  # sequence-classification reward model folder
    reward_fn: str | None = None  # "module:function" rule-based reward; None = the built-in task's rule
    critic_pretrain: str | None = None  # PPO critic init; None = reward_pretrain, else pretrain
    task: str = "copy"  # built-in synthetic task when prompt_data is None
    task_length: int = 2  # symbols in each built-in task prompt
    tiny_model: dict[str, Any] = field(default_factory=dict)  # overrides of the demo model's config

    # ---- placement (OpenRLHF counts; or `placement` as RLinf-style ranges) -----------------------------------
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    critic_num_nodes: int = 1
    critic_num_gpus_per_node: int = 1
    ref_num_nodes: int = 1
    ref_num_gpus_per_node: int = 1
    reward_num_nodes: int = 1
    reward_num_gpus_per_node: int = 1
    vllm_num_engines: int = 1
    vllm_tensor_parallel_size: int = 1
    colocate_all_models: bool = True
    colocate_actor_ref: bool = False
    colocate_critic_reward: bool = False
    placement: dict[str, str] | None = None  # e.g. {"actor": "0-7", "rollout": "4-7"}; overrides the counts
    gpus_per_node: int | None = None  # cluster size check; None = what Ray reports

    # ---- inference engine ------------------------------------------------------------------------------------
    backend: str = "hf"  # hf (built-in transformers engine) | vllm | sglang
    vllm_gpu_memory_utilization: float = 0.5
    vllm_enable_sleep: bool = True
    vllm_sync_backend: str = "nccl"
    enforce_eager: bool = False
    enable_prefix_caching: bool = False
    weight_sync_bucket_mb: int = 512
    weight_sync: str = "auto"  # auto (CUDA IPC when engines share the actor's GPUs, else broadcast) | ipc | broadcast
    engine_sleep_level: int = 1  # 1: weights to host memory; 2: weights discarded (re-synced from the actor)

    # ---- trainer (DeepSpeed) ---------------------------------------------------------------------------------
    deepspeed_enable_sleep: bool = True
    zero_stage: int = 2
    bf16: bool = False
    adam_offload: bool = False
    gradient_checkpointing: bool = False
    packing_samples: bool = False
    flash_attn: bool = False
    actor_learning_rate: float = 1e-6
    critic_learning_rate: float = 9e-6
    lr_warmup_ratio: float = 0.0
    l2: float = 0.0  # weight decay
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_norm: float = 1.0

    # ---- batch shape -----------------------------------------------------------------------------------------
    rollout_batch_size: int = 16  # prompts per step
    n_samples_per_prompt: int = 1
    micro_rollout_batch_size: int = 16  # per GPU, for reference / critic / reward inference
    train_batch_size: int = 16  # samples per optimizer step (all ranks)
    micro_train_batch_size: int = 8  # per GPU
    max_epochs: int = 1  # PPO epochs over each rollout batch
    num_episodes: int = 1  # passes over the prompt set
    max_samples: int = 1_000_000
    max_steps: int | None = None  # stop after this many steps (None = as many as the prompts allow)
    prompt_max_len: int = 1024
    generate_max_len: int = 1024

    # ---- sampling --------------------------------------------------------------------------------------------
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    # ---- RL --------------------------------------------------------------------------------------------------
    advantage_estimator: str = "gae"
    gamma: float = 1.0
    lambd: float = 1.0
    init_kl_coef: float = 0.01
    kl_target: float | None = None  # set => adaptive KL controller
    kl_horizon: int = 10000
    kl_estimator: str = "k1"
    use_kl_loss: bool = False  # KL as a loss term (GRPO) instead of a reward penalty
    eps_clip: float = 0.2
    eps_clip_low_high: tuple[float, float] | None = None  # asymmetric clip (clip-higher)
    dual_clip: float | None = None
    value_clip: float = 0.2
    entropy_loss_coef: float = 0.0
    normalize_reward: bool = False
    reward_clip_range: tuple[float, float] = (-10.0, 10.0)
    loss_agg_mode: str = "token-mean"
    recompute_old_logprobs: bool = False  # always run the actor's old log-prob pass (else skipped when on-policy)

    # ---- data ------------------------------------------------------------------------------------------------
    prompt_data: str | None = None  # JSONL / Parquet file or a datasets folder; None = the built-in task
    input_key: str | None = None
    label_key: str | None = None
    apply_chat_template: bool = False
    prompt_split: str = "train"

    # ---- saving, logging -------------------------------------------------------------------------------------
    save_path: str = "./runs/hybrid"
    ckpt_path: str | None = None  # default: <save_path>/checkpoints
    save_steps: int = -1  # checkpoint every N steps; -1: only after the last step
    save_hf_ckpt: bool = False
    max_ckpt_num: int = 3
    final_checkpoint: bool = True  # a resumable checkpoint after the last step (off: only the final model is saved)
    resume: bool = False  # continue from the last complete checkpoint (an error when there is none)
    resume_if_exists: bool = False  # continue from the last checkpoint if there is one, else start fresh
    overwrite: bool = False  # a new run may replace an earlier run in --save_path (its files are deleted first)
    trust_checkpoint: bool = False  # skip the check that DeepSpeed's checkpoint pickles hold only known objects
    logging_steps: int = 1
    use_wandb: str | None = None
    wandb_project: str = "hybrid"
    wandb_run_name: str | None = None
    use_tensorboard: bool = True
    seed: int = 42

    # ---- Ray and reliability ---------------------------------------------------------------------------------
    address: str | None = None  # Ray cluster; None = RAY_ADDRESS or a new local one
    ray_temp_dir: str | None = None
    ray_log_max_mb: int = 100
    num_gpus: int | None = None  # local Ray only: GPUs to declare (CPU machines use this for the demo)
    call_timeout_s: float = 600.0  # deadline of each remote call, turn wait and collective
    step_timeout_s: float = 3600.0  # budget of one whole step (or checkpoint); then stacks are dumped and the run ends

    # ---------------------------------------------------------------------------------------------------------
    @property
    def algorithm(self) -> str:
        return "rl"

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def uses_reference(self) -> bool:
        # A zero coefficient makes the KL term vanish, as a reward penalty or as a loss: no reference to run.
        return self.init_kl_coef > 0

    @property
    def single_update(self) -> bool:
        """One optimizer step per rollout: one epoch, and the whole rollout is one train batch."""
        return self.max_epochs == 1 and self.train_batch_size == self.samples_per_step

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether a step runs the actor's forward pass for the "old" log-probs before training.

        With a single update, DeepSpeed only steps at the end of gradient accumulation, so every micro-batch of
        ``PolicyWorker.train`` sees the pre-update weights: its own detached log-probs are the old ones (ratio 1).
        They are still needed before training for KL as a reward penalty (``advantage_step``), and for an adaptive
        KL controller, which steers on the KL they give.
        """
        if self.recompute_old_logprobs or not self.single_update:
            return True
        return self.uses_reference and (not self.use_kl_loss or self.kl_target is not None)

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def actor_world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def critic_world_size(self) -> int:
        return self.critic_num_nodes * self.critic_num_gpus_per_node

    @property
    def clip_range(self) -> tuple[float, float]:
        return tuple(self.eps_clip_low_high) if self.eps_clip_low_high else (self.eps_clip, self.eps_clip)

    @property
    def checkpoint_dir(self) -> str:
        return self.ckpt_path or os.path.join(self.save_path, "checkpoints")

    def replace(self, **changes: Any) -> "RLConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---------------------------------------------------------------------------------------------------------
    def validate(self) -> "RLConfig":
        """Check everything that can be checked without Ray or a GPU; return self so calls chain."""
        _choice("backend", self.backend, BACKENDS, "--backend hf runs anywhere; vllm/sglang need the extras.")
        _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.prompt_data is None:
            _choice("task", self.task, TASKS, "Or give your own prompts with --prompt_data FILE --input_key KEY.")
        self._validate_estimator()
        for name in ("task_length", "rollout_batch_size", "n_samples_per_prompt", "micro_rollout_batch_size", "train_batch_size",
                     "micro_train_batch_size", "max_epochs", "num_episodes", "max_samples", "prompt_max_len",
                     "generate_max_len", "vllm_num_engines", "vllm_tensor_parallel_size", "actor_num_nodes",
                     "actor_num_gpus_per_node", "logging_steps", "max_ckpt_num", "ray_log_max_mb",
                     "weight_sync_bucket_mb"):
            _positive(name, getattr(self, name))
        if self.max_steps is not None:
            _positive("max_steps", self.max_steps)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}.",
                              "Use --zero_stage 2 (the default) or 3 for models that do not fit one GPU.")
        if self.deepspeed_enable_sleep and self.zero_stage == 0:
            raise ConfigError("deepspeed_enable_sleep", "DeepSpeed can only offload/reload its states with ZeRO 1-3.",
                              "Use --zero_stage 1, 2 or 3, or drop --deepspeed_enable_sleep.")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError("vllm_gpu_memory_utilization", f"must be in (0, 1], got {self.vllm_gpu_memory_utilization}.",
                              "It is a fraction of the GPU, e.g. --vllm_gpu_memory_utilization 0.5.")
        _choice("weight_sync", self.weight_sync, ("auto", "ipc", "broadcast"))
        if self.engine_sleep_level not in (1, 2):
            raise ConfigError("engine_sleep_level", f"must be 1 or 2, got {self.engine_sleep_level}.",
                              "1 keeps the weights in host memory, 2 discards them; use --engine_sleep_level 1.")
        if self.vllm_sync_backend not in ("nccl", "gloo"):
            raise ConfigError("vllm_sync_backend", f"must be nccl or gloo, got {self.vllm_sync_backend!r}.",
                              "Use --vllm_sync_backend nccl on GPUs (gloo is picked by itself on CPU).")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k == 0 or self.top_k < -1:
            field = ("temperature" if self.temperature < 0 else "top_p" if not 0 < self.top_p <= 1 else "top_k")
            raise ConfigError(field, f"got temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}.",
                              "Use temperature >= 0, 0 < top_p <= 1, and top_k = -1 (off) or >= 1.")
        for name in ("actor_learning_rate", "critic_learning_rate"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}.", f"E.g. --{name} 1e-6.")
        if self.init_kl_coef < 0:
            raise ConfigError("init_kl_coef", f"must be >= 0, got {self.init_kl_coef}.",
                              "Use 0 for no KL term, or a small positive value such as 0.01.")
        nothing_to_pair = not (self.uses_reference or self.colocate_all_models or self.placement is not None)
        if self.colocate_actor_ref and nothing_to_pair:
            raise ConfigError("colocate_actor_ref", "init_kl_coef = 0 turns the KL term off, so there is no reference "
                              "model to put on the actor's GPUs.",
                              "Drop --colocate_actor_ref, or give --init_kl_coef > 0.")
        self._validate_clip()
        self._validate_batches()
        self._validate_sleep()
        self._validate_files()
        if self.save_steps == 0 or self.save_steps < -1:
            raise ConfigError("save_steps", f"must be -1 (only the final save) or >= 1, got {self.save_steps}.",
                              "E.g. --save_steps 10 to checkpoint every 10 steps.")
        if self.resume and self.overwrite:
            raise ConfigError("overwrite", "--overwrite deletes the run that --resume would continue.",
                              "Keep one of them: --resume continues the run, --overwrite replaces it.")
        if self.resume and not os.path.isdir(self.checkpoint_dir):
            raise ConfigError("resume", f"no checkpoint folder at {self.checkpoint_dir!r}.",
                              "Point --ckpt_path (or --save_path) at the run to continue, or drop --resume.")
        for name in ("call_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ConfigError(name, f"must be a finite number of seconds > 0, got {value}.",
                                  f"Every wait has a deadline; e.g. --{name} 600.")
        if self.address and self.num_gpus is not None:
            raise ConfigError("num_gpus", f"cannot declare GPUs when joining the running cluster at {self.address}.",
                              "Drop --num_gpus; the cluster's own GPUs are used.")
        if self.backend == "hf" and self.vllm_tensor_parallel_size > 1:
            raise ConfigError("vllm_tensor_parallel_size", f"the built-in engine (--backend hf) runs on one GPU, but "
                              f"vllm_tensor_parallel_size = {self.vllm_tensor_parallel_size}.",
                              "Use --vllm_tensor_parallel_size 1 with --backend hf, or --backend vllm / sglang.")
        return self

    def _validate_estimator(self) -> None:
        from hybrid_algos.advantages import list_advantage_estimators

        known = list_advantage_estimators()
        if self.advantage_estimator not in known:
            raise ConfigError("advantage_estimator", f"unknown estimator {self.advantage_estimator!r}.",
                              f"Choose one of: {', '.join(sorted(known))}.")

    def _validate_clip(self) -> None:
        low, high = self.clip_range
        if not (0 < low < 1 and high > 0):
            raise ConfigError("eps_clip_low_high" if self.eps_clip_low_high else "eps_clip",
                              f"clip range must satisfy 0 < low < 1 and high > 0, got ({low}, {high}).",
                              "E.g. --eps_clip 0.2, or --eps_clip_low_high 0.2 0.28.")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError("dual_clip", f"must be > 1 (it bounds the loss for negative advantages), got {self.dual_clip}.",
                              "E.g. --dual_clip 3, or leave it unset.")
        lo, hi = self.reward_clip_range
        if lo >= hi:
            raise ConfigError("reward_clip_range", f"low must be below high, got ({lo}, {hi}).",
                              "E.g. --reward_clip_range -10 10.")

    def _validate_batches(self) -> None:
        samples = self.samples_per_step
        if samples % self.train_batch_size:
            raise ConfigError("train_batch_size",
                              f"rollout_batch_size x n_samples_per_prompt = {samples} samples per step is not a multiple "
                              f"of train_batch_size = {self.train_batch_size}.",
                              f"Use a train_batch_size that divides {samples}{_closest_divisor_hint(samples, self.train_batch_size, self.micro_train_batch_size * self.actor_world_size)}.")
        per_update = self.micro_train_batch_size * self.actor_world_size
        if self.train_batch_size % per_update:
            raise ConfigError("micro_train_batch_size",
                              f"train_batch_size = {self.train_batch_size} is not a multiple of micro_train_batch_size x "
                              f"actor GPUs = {self.micro_train_batch_size} x {self.actor_world_size} = {per_update}.",
                              "Pick micro_train_batch_size so that it divides train_batch_size / actor GPUs.")
        if self.max_samples < self.rollout_batch_size:
            raise ConfigError("max_samples", f"max_samples = {self.max_samples} is smaller than one rollout batch "
                              f"(rollout_batch_size = {self.rollout_batch_size}).", "Raise --max_samples or lower --rollout_batch_size.")
        if self.advantage_estimator in GROUP_ESTIMATORS and self.n_samples_per_prompt < 2:
            raise ConfigError("n_samples_per_prompt",
                              f"{self.advantage_estimator} compares samples of the same prompt, so it needs at least 2 per prompt.",
                              "Use --n_samples_per_prompt 4 (or more).")

    def _validate_sleep(self) -> None:
        colocated = self.colocate_all_models or self.placement is not None
        if self.vllm_enable_sleep and not colocated:
            raise ConfigError("vllm_enable_sleep", "engine sleep only helps when engines share GPUs with the trainer.",
                              "Add --colocate_all_models, or drop --vllm_enable_sleep.")
        if self.deepspeed_enable_sleep and not (colocated or self.colocate_actor_ref or self.colocate_critic_reward):
            raise ConfigError("deepspeed_enable_sleep", "trainer sleep only helps when models share GPUs.",
                              "Add --colocate_all_models, or drop --deepspeed_enable_sleep.")

    def _validate_files(self) -> None:
        for name in ("pretrain", "reward_pretrain", "critic_pretrain"):
            path = getattr(self, name)
            if path is not None and not os.path.isdir(path):
                raise ConfigError(name, f"no model folder at {path!r} (models are not downloaded at run time).",
                                  "Give a local Hugging Face model folder (config.json + weights).")
        if self.prompt_data is not None:
            if not os.path.exists(self.prompt_data):
                raise ConfigError("prompt_data", f"no file or folder at {self.prompt_data!r}.",
                                  "Give a local JSONL/Parquet file or a datasets folder.")
            if not self.input_key:
                raise ConfigError("input_key", "--prompt_data needs --input_key to say which field holds the prompt.",
                                  "Add e.g. --input_key prompt.")
        if self.reward_fn is not None:
            module, _, func = self.reward_fn.partition(":")
            if not module or not func:
                raise ConfigError("reward_fn", f"expected 'module:function', got {self.reward_fn!r}.",
                                  "E.g. --reward_fn my_rewards:score or --reward_fn path/to/file.py:score.")
            if not os.path.isfile(module) and not _module_exists(module):
                raise ConfigError("reward_fn", f"cannot find module {module!r}.", "Make it importable (PYTHONPATH) or give a .py path.")
        if self.reward_pretrain is not None and self.reward_fn is not None:
            raise ConfigError("reward_fn", "both --reward_pretrain and --reward_fn are set; a run uses one reward.",
                              "Keep one of them.")


#: Settings of the built-in demo (no --pretrain): the tiny model learns to copy the prompt's symbol, from chance to
#: >= 0.9 in ~12-25 steps of about a second on a CPU, with PPO, REINFORCE++ and GRPO, whatever the seed or CPU (the
#: CPU learning test runs exactly these, three seeds each). Adam's beta2 is 0.999 (OpenRLHF: 0.95) and 16 samples per
#: prompt: see tests/hybrid_algos/train/test_learning.py for why. Real models want OpenRLHF-scale settings (lr ~1e-6),
#: which are the defaults.
DEMO_SETTINGS: dict[str, Any] = dict(
    task="copy", task_length=1, max_steps=32, rollout_batch_size=16, n_samples_per_prompt=16, train_batch_size=64,
    micro_train_batch_size=32, micro_rollout_batch_size=64, max_epochs=2, actor_learning_rate=2e-3,
    critic_learning_rate=2e-3, adam_betas=(0.9, 0.999), use_kl_loss=True, kl_estimator="k3", init_kl_coef=1e-3,
)


def demo_config(cls: type["RLConfig"], **overrides: Any) -> "RLConfig":
    """``cls`` with the demo settings (see :data:`DEMO_SETTINGS`), then ``overrides``."""
    return cls(**{**DEMO_SETTINGS, **overrides})


GROUP_ESTIMATORS = ("group_norm", "grpo", "dr_grpo", "rloo", "reinforce_baseline", "reinforce_plus_plus_baseline")


@dataclass
class PPOConfig(RLConfig):
    """PPO with a GAE critic (Schulman et al. 2017; the OpenRLHF default)."""

    advantage_estimator: str = "gae"
    gamma: float = 1.0
    lambd: float = 0.95
    init_kl_coef: float = 0.01

    @property
    def algorithm(self) -> str:
        return "ppo"


@dataclass
class GRPOConfig(RLConfig):
    """GRPO (Shao et al. 2024): group-normalised rewards, no critic, KL as a loss term."""

    advantage_estimator: str = "group_norm"
    n_samples_per_prompt: int = 8
    use_kl_loss: bool = True
    kl_estimator: str = "k3"
    init_kl_coef: float = 0.001

    @property
    def algorithm(self) -> str:
        return "grpo"


@dataclass
class ReinforceConfig(RLConfig):
    """REINFORCE++ (Hu 2025): discounted returns with KL in the reward, batch-normalised, no critic."""

    advantage_estimator: str = "reinforce"
    init_kl_coef: float = 0.01

    @property
    def algorithm(self) -> str:
        return "reinforce"


CONFIGS: dict[str, type[RLConfig]] = {"ppo": PPOConfig, "grpo": GRPOConfig, "reinforce": ReinforceConfig}


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or the name is not a module path
        return False


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"must be a positive integer, got {value!r}.", f"Give --{name} a whole number >= 1.")


def _choice(name: str, value: str, choices: tuple[str, ...], fix: str | None = None) -> None:
    if value not in choices:
        raise ConfigError(name, f"{value!r} is not one of {', '.join(choices)}.", fix or f"Use one of: {', '.join(choices)}.")


def _closest_divisor_hint(samples: int, wanted: int, per_update: int) -> str:
    """' (e.g. N)': the divisor of ``samples`` nearest ``wanted`` that is also a multiple of ``per_update``."""
    fits = [d for d in range(per_update, samples + 1, per_update) if samples % d == 0]
    return f" (e.g. {min(fits, key=lambda d: abs(d - wanted))})" if fits else ""
