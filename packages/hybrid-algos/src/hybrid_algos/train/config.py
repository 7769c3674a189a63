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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybrid_core.errors import ConfigError
from hybrid_engines.adapter import EngineSettings
from hybrid_engines.registry import backend_names, engine_spec

from .demo import DEMO_SETTINGS

#: Built-in synthetic tasks (prompts + rule-based reward) used when no --prompt_data is given.
TASKS = ("copy", "copy_first", "reverse", "add", "lookup")
#: Built-in tasks whose samples are multi-turn conversations with a built-in environment (hybrid_algos.train.agents).
AGENT_TASKS = ("lookup",)


@dataclass
class RLConfig:
    """Settings shared by PPO, GRPO and REINFORCE++. Defaults give the CPU demo (tiny model, built-in engine)."""

    # ---- models ---------------------------------------------------------------------------------------------
    pretrain: str | None = None  # HF model folder; None = the tiny built-in demo model (built from a config)
    trust_remote_code: bool = False  # run the Python code a model folder ships (auto_map); only for code you trust
    reward_pretrain: str | None = None  # sequence-classification reward model folder
    reward_random_head: bool = (
        False  # score with a random reward head when --reward_pretrain has none (tests/benchmarks only)
    )
    reward_fn: str | None = (
        None  # "module:function" rule; a .py file / http(s) URL(s): OpenRLHF's reward; None = the task's rule
    )
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
    ref_reward_offload: bool = False  # reference and reward models sleep between their turns (the residency plan)
    placement: dict[str, str] | None = None  # e.g. {"actor": "0-7", "rollout": "4-7"}; overrides the counts
    gpus_per_node: int | None = None  # cluster size check; None = what Ray reports

    # ---- inference engine ------------------------------------------------------------------------------------
    backend: str = "hf"  # hf (built-in transformers engine) | vllm | sglang
    vllm_gpu_memory_utilization: float = 0.5
    vllm_enable_sleep: bool | None = None  # engines sleep between generations; None = the residency plan decides
    vllm_sync_backend: str | None = None  # weight broadcast group: nccl | gloo; None = nccl with CUDA, gloo without
    enforce_eager: bool = False
    enable_prefix_caching: bool = False
    seeded_sampling: bool | None = (
        None  # a seed per sample (batch-independent; resumes draw the same); None = where cheap (hf)
    )
    weight_sync_bucket_mb: int = 512
    weight_sync: str = "auto"  # auto (CUDA IPC when engines share the actor's GPUs, else broadcast) | ipc | broadcast
    # sampled: 1st sync checks all tensors, then a rotating 1/32 (stale weights: at once; one bad byte: within 32
    # syncs) | full (slower) | off
    verify_weight_sync: str = "sampled"
    engine_sleep_level: int | None = (
        None  # when engine weights leave: 1 to host memory, 2 discarded (re-synced); None = planner
    )

    # ---- trainer (DeepSpeed) ---------------------------------------------------------------------------------
    deepspeed_enable_sleep: bool | None = None  # trainers sleep between their phases; None = the residency plan decides
    zero_stage: int = 2
    bf16: bool = False
    adam_offload: bool = False
    bf16_master_weights: bool = False  # the ZeRO optimizer's master weights and gradients in bf16 (2 bytes, not 4)
    bf16_optimizer_states: bool = False  # Adam's m, v in bf16 too (with --bf16_master_weights): 6 bytes per parameter
    gradient_checkpointing: bool = False
    packing_samples: bool = (
        False  # trainers' forward passes concatenate samples without padding (one row, position ids)
    )
    use_dynamic_batch: bool = False  # micro-batches by token budget instead of a fixed number of samples
    train_max_tokens_per_gpu: int | None = (
        None  # token budget of a training micro-batch (--use_dynamic_batch; default 16384)
    )
    rollout_max_tokens_per_gpu: int | None = (
        None  # token budget of a log-prob / value pass (default: the training budget)
    )
    flash_attn: bool = False
    actor_learning_rate: float = 1e-6
    critic_learning_rate: float = 9e-6
    lr_warmup_ratio: float = 0.0
    lr_scheduler: str = "constant_with_warmup"  # or cosine_with_min_lr: after warm-up, decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.1  # the cosine decay's floor, as a fraction of the learning rate
    l2: float = 0.0  # weight decay
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_norm: float = 1.0

    # ---- residency (what stays on each GPU; hybrid_core.residency) -------------------------------------------
    # auto: planned from the memory budget | all-sleep: every shared role moves | manual: only the sleep flags
    residency: str = "auto"
    residency_pins: dict[str, str] | None = (
        None  # fix single decisions, e.g. actor.optimizer=offload rollout.kv_cache=release
    )
    gpu_memory_gb: float | None = None  # GPU memory the plan may use per GPU; None = the GPU's own (80 without a GPU)
    host_memory_gb: float | None = (
        None  # host memory (RAM) the plan may fill per node; None = this machine's available memory
    )
    gpu_memory_usable: float = 0.92  # fraction of it a phase may fill (the rest absorbs fragmentation, workspaces)
    gpu_context_gb: float = 0.5  # what each process holds on its GPU whatever it keeps (CUDA context, workspaces)
    residency_overlap: bool = True  # start moves early where the memory allows (off: every move waits for its phase)

    # ---- asynchronous training (train/async_rollout; generation of later batches overlaps training) -------------
    async_train: bool = False  # engines generate batch k+1 (older weights) while the trainer trains on batch k
    async_max_staleness: int = 1  # a sample trained on is at most this many weight versions older than the trainer
    partial_rollout: bool = False  # generations running at a weight update are paused and resumed with the new weights

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
    eps_clip: float | None = (
        None  # None: the policy loss's own (PPO 0.2; GSPO 3e-4 / 4e-4; CISPO no lower bound / 0.28)
    )
    eps_clip_low_high: tuple[float, float] | None = None  # asymmetric clip (clip-higher)
    dual_clip: float | None = None
    value_clip: float = 0.2
    entropy_loss_coef: float = 0.0
    normalize_reward: bool = False
    reward_clip_range: tuple[float, float] = (-10.0, 10.0)
    policy_loss_type: str = "ppo"  # ppo | gspo | cispo | dr_grpo | ... (the policy-loss registry; see --help)
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm; None = the policy loss's own
    loss_agg_mode: str | None = None
    recompute_old_logprobs: bool = False  # always run the actor's old log-prob pass (else skipped when on-policy)
    # your files/modules, comma-separated (my_losses.py,my_pkg.envs): imported on the driver and in every role
    # worker, so the losses / estimators they register can be named
    plugins: str | None = None

    # ---- engine/trainer mismatch -----------------------------------------------------------------------------
    enable_vllm_is_correction: bool = True  # weight the policy loss by trainer/engine importance ratios (any backend)
    vllm_is_correction_type: str = "tis"  # tis | icepop | seq-tis | seq-mis | seq-mask-tis (see --help)
    vllm_is_truncated_threshold: tuple[float, float] | None = (
        None  # LOW HIGH bounds of the ratio; None = the type's own
    )
    use_icepop: bool = False  # OpenRLHF's older switch: the same as --vllm_is_correction_type icepop
    engine_logprobs: bool | None = (
        None  # engines return the sampled tokens' log-probs (mismatch/* metrics); None = when the correction needs them
    )

    # ---- DAPO ------------------------------------------------------------------------------------------------
    dynamic_filtering: bool = (
        False  # drop groups whose rewards are all equal; generate more prompts until the batch is full
    )
    dynamic_filtering_reward_range: tuple[float, float] | None = (
        None  # also drop groups whose mean reward is outside (LOW, HIGH)
    )
    dynamic_filtering_max_rounds: int = (
        8  # extra generation rounds per step; then the batch is filled with dropped groups
    )
    overlong_buffer_len: int | None = None  # DAPO soft overlong penalty over the last N tokens before generate_max_len
    overlong_penalty_factor: float = 1.0  # the penalty at generate_max_len
    mask_truncated_completions: bool = False  # completions cut at generate_max_len are left out of the policy loss

    # ---- agents (multi-turn, tool-using rollouts) ------------------------------------------------------------
    agent_func_path: str | None = (
        None  # environment: FILE.py (OpenRLHF's AgentExecutor, or an Environment class), FILE.py:NAME or module:NAME
    )
    max_turns: int | None = None  # model turns per sample, then it ends; None = 8 (the built-in lookup task: 2)
    max_new_tokens_per_turn: int | None = (
        None  # new tokens of one turn; None = what is left of generate_max_len (lookup: 2)
    )
    agent_timeout_s: float = 60.0  # deadline of each environment call (reset, step)
    agent_on_error: str = (
        "raise"  # environment raised, timed out or answered in a wrong shape: raise (end the run) | end_sample
    )

    # ---- data ------------------------------------------------------------------------------------------------
    prompt_data: str | None = None  # JSONL / Parquet file or a datasets folder; None = the built-in task
    input_key: str | None = None
    label_key: str | None = None
    apply_chat_template: bool = False
    prompt_split: str = "train"
    prompt_data_probs: str | None = None  # comma-separated sampling weights, one per --prompt_data dataset
    input_template: str | None = None  # e.g. "User: {}\nAssistant: " around each plain-text prompt

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
    profile_step: int = 0  # profile this step (1-based): torch profiler on the trainer workers, cProfile on the driver
    use_wandb: str | None = field(default=None, repr=False)  # may hold an API key: never in a printed config
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
    #: The fields the user set (command line, --config file), recorded by the CLI (:meth:`record_given`); None: a
    #: config built in Python, where every field that differs from its default counts as set (see inactive.py).
    given_fields: ClassVar[frozenset[str] | None] = None
    #: The settings came from an OpenRLHF command line: a flag OpenRLHF also ignores is a note, not an error.
    openrlhf_line: ClassVar[bool] = False

    @property
    def algorithm(self) -> str:
        return "rl"

    @property
    def uses_critic(self) -> bool:
        """The advantage estimator reads critic values (its registry entry says so), so a critic is trained."""
        return estimator_needs_critic(self.advantage_estimator)

    @property
    def policy_agg_mode(self) -> str:
        """``loss_agg_mode``, or the policy loss's own default when it is not set."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        from hybrid_algos import get_policy_loss

        return get_policy_loss(self.policy_loss_type).agg_mode

    @property
    def value_agg_mode(self) -> str:
        return self.loss_agg_mode or "token-mean"

    @property
    def correction_bounds(self) -> tuple[float | None, float]:
        """(low, high) of the rollout correction: the flags', or the correction type's own."""
        if self.vllm_is_truncated_threshold is not None:
            low, high = self.vllm_is_truncated_threshold
            return float(low), float(high)
        from hybrid_algos import get_rollout_correction

        spec = get_rollout_correction(self.correction_type)
        return spec.low, spec.high

    @property
    def wants_engine_logprobs(self) -> bool:
        """Whether the engines are asked for the sampled tokens' log-probs: the correction needs them, and
        ``--engine_logprobs`` adds the mismatch metrics without it. They cost the engine (vLLM 0.26: ~22-24 % of a 357M
        model's generate call on an H100), so nothing asks for them that does not use them."""
        return self.enable_vllm_is_correction if self.engine_logprobs is None else self.engine_logprobs

    @property
    def correction_type(self) -> str:
        return "icepop" if self.use_icepop else self.vllm_is_correction_type

    @property
    def train_token_budget(self) -> int:
        return self.train_max_tokens_per_gpu or DEFAULT_MAX_TOKENS_PER_GPU

    @property
    def rollout_token_budget(self) -> int:
        return self.rollout_max_tokens_per_gpu or self.train_token_budget

    @property
    def uses_agent(self) -> bool:
        """Samples are multi-turn conversations with an environment (``--agent_func_path``, or a built-in agent
        task)."""
        return self.agent_func_path is not None or (self.prompt_data is None and self.task in AGENT_TASKS)

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
        """``--eps_clip_low_high``, else ``--eps_clip`` both ways, else the policy loss's paper default."""
        if self.eps_clip_low_high:
            return (*self.eps_clip_low_high,)  # a tuple (a --config file gives a list)
        if self.eps_clip is not None:
            return (self.eps_clip, self.eps_clip)
        from hybrid_algos import get_policy_loss

        return get_policy_loss(self.policy_loss_type).default_clip

    def clip_note(self) -> str | None:
        """What the plan says when the clip range is a policy loss's own default that is not PPO's 0.2."""
        if self.eps_clip_low_high or self.eps_clip is not None:
            return None
        from hybrid_algos import get_policy_loss

        loss = get_policy_loss(self.policy_loss_type)
        if loss.default_clip == (0.2, 0.2):
            return None
        low, high = loss.default_clip
        return (
            f"policy loss {loss.name}: clip range ({low:g}, {high:g}) from {loss.default_clip_source} "
            "(--eps_clip / --eps_clip_low_high set another)"
        )

    @property
    def checkpoint_dir(self) -> str:
        return self.ckpt_path or os.path.join(self.save_path, "checkpoints")

    def replace(self, **changes: Any) -> RLConfig:
        out = dataclasses.replace(self, **changes)
        if "given_fields" in vars(self):  # what the user set stays known (the changes are the program's own)
            out.record_given(self.given_fields or (), openrlhf_line=self.openrlhf_line)
        return out

    def record_given(self, names: Iterable[str], *, openrlhf_line: bool = False) -> RLConfig:
        """Remember which fields the user set (and whether on an OpenRLHF command line) for the rules on settings
        that do nothing (:mod:`hybrid_algos.train.inactive`); return self."""
        # ClassVar defaults, set per instance here: ClassVar keeps them out of the dataclass fields (and replace())
        self.given_fields = frozenset(names)  # type: ignore[misc]
        self.openrlhf_line = bool(openrlhf_line)  # type: ignore[misc]
        return self

    def inactive_notes(self) -> list[str]:
        """The notes on set fields that do nothing here and pass on an OpenRLHF command line (the others are
        refused by :meth:`validate`)."""
        from .inactive import check

        return check(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def engine_settings(self) -> EngineSettings:
        """The engine section, in the engines' words: what the backend's adapter checks (``check_settings``) and
        builds its engines from (``engine_kwargs``)."""
        return EngineSettings(
            backend=self.backend,
            num_engines=self.vllm_num_engines,
            tensor_parallel_size=self.vllm_tensor_parallel_size,
            gpu_memory_utilization=self.vllm_gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            bf16=self.bf16,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
        )

    # ---------------------------------------------------------------------------------------------------------
    def validate(self) -> RLConfig:
        """Check everything that can be checked without Ray or a GPU; return self so calls chain."""
        from .plugins import prepare

        prepare(self.plugins)  # first: the names they register are checked below (and the workers import them too)
        # the engine registry is the one list of backends
        _choice("backend", self.backend, backend_names(), "--backend hf runs anywhere; vllm/sglang need the extras.")
        from hybrid_algos import LOSS_AGG_MODES, list_policy_losses
        from hybrid_algos.kl import KL_ESTIMATOR_ALIASES, KL_ESTIMATORS

        if self.loss_agg_mode is not None:
            _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _choice("kl_estimator", self.kl_estimator, (*KL_ESTIMATORS, *KL_ESTIMATOR_ALIASES))
        _choice(
            "policy_loss_type",
            self.policy_loss_type,
            tuple(list_policy_losses()),
            "`hybrid grpo --help` lists each loss; a loss of your own: register it in a file named by "
            "--plugins FILE.py.",
        )
        if self.prompt_data is None:
            _choice("task", self.task, TASKS, "Or give your own prompts with --prompt_data FILE --input_key KEY.")
        self._validate_estimator()
        self._validate_async()
        for name in (
            "task_length",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "micro_rollout_batch_size",
            "train_batch_size",
            "micro_train_batch_size",
            "max_epochs",
            "num_episodes",
            "max_samples",
            "prompt_max_len",
            "generate_max_len",
            "vllm_tensor_parallel_size",
            "actor_num_nodes",
            "actor_num_gpus_per_node",
            "logging_steps",
            "max_ckpt_num",
            "ray_log_max_mb",
            "weight_sync_bucket_mb",
        ):
            _positive(name, getattr(self, name))
        if self.max_steps is not None:
            _positive("max_steps", self.max_steps)
        if isinstance(self.profile_step, bool) or not isinstance(self.profile_step, int) or self.profile_step < 0:
            raise ConfigError(
                "profile_step",
                f"must be a step number >= 1 (0: no profile), got {self.profile_step!r}.",
                "E.g. --profile_step 5 profiles the fifth step (after the warm-up of the first ones).",
            )
        if (
            isinstance(self.vllm_num_engines, bool)
            or not isinstance(self.vllm_num_engines, int)
            or self.vllm_num_engines < 0
        ):
            raise ConfigError(
                "vllm_num_engines",
                f"must be a whole number >= 0, got {self.vllm_num_engines!r}.",
                "Give the number of engines; 0 puts a built-in engine on each actor GPU.",
            )
        engine_spec(self.backend).check_settings(self.engine_settings())  # what this engine cannot run (its adapter)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(
                "zero_stage",
                f"must be 0, 1, 2 or 3, got {self.zero_stage}.",
                "Use --zero_stage 2 (the default) or 3 for models that do not fit one GPU.",
            )
        self._validate_precision()
        if self.deepspeed_enable_sleep and self.zero_stage == 0:
            raise ConfigError(
                "deepspeed_enable_sleep",
                "DeepSpeed can only offload/reload its states with ZeRO 1-3.",
                "Use --zero_stage 1, 2 or 3, or drop --deepspeed_enable_sleep.",
            )
        if self.residency == "all-sleep" and self.zero_stage == 0:
            raise ConfigError(
                "residency",
                "all-sleep moves the trainers' states, which DeepSpeed can only do with ZeRO 1-3.",
                "Use --zero_stage 1, 2 or 3, or --residency auto.",
            )
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(
                "vllm_gpu_memory_utilization",
                f"must be in (0, 1], got {self.vllm_gpu_memory_utilization}.",
                "It is a fraction of the GPU, e.g. --vllm_gpu_memory_utilization 0.5.",
            )
        _choice("weight_sync", self.weight_sync, ("auto", "ipc", "broadcast"))
        if isinstance(self.verify_weight_sync, bool):  # a config from before the modes: on = the default
            self.verify_weight_sync = "sampled" if self.verify_weight_sync else "off"
        _choice("verify_weight_sync", self.verify_weight_sync, ("sampled", "full", "off"))
        self._validate_residency()
        if self.engine_sleep_level not in (None, 1, 2):
            raise ConfigError(
                "engine_sleep_level",
                f"must be 1 or 2, got {self.engine_sleep_level}.",
                "1 keeps the weights in host memory, 2 discards them; use --engine_sleep_level 1.",
            )
        if self.vllm_sync_backend not in (None, "nccl", "gloo"):
            raise ConfigError(
                "vllm_sync_backend",
                f"must be nccl or gloo, got {self.vllm_sync_backend!r}.",
                "Use --vllm_sync_backend nccl on GPUs (gloo is picked by itself on CPU).",
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k == 0 or self.top_k < -1:
            field = "temperature" if self.temperature < 0 else "top_p" if not 0 < self.top_p <= 1 else "top_k"
            raise ConfigError(
                field,
                f"got temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}.",
                "Use temperature >= 0, 0 < top_p <= 1, and top_k = -1 (off) or >= 1.",
            )
        for name in ("actor_learning_rate", "critic_learning_rate"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}.", f"E.g. --{name} 1e-6.")
        if self.init_kl_coef < 0:
            raise ConfigError(
                "init_kl_coef",
                f"must be >= 0, got {self.init_kl_coef}.",
                "Use 0 for no KL term, or a small positive value such as 0.01.",
            )
        self._validate_clip()
        self._validate_correction()
        self._validate_dapo()
        self._validate_agent()
        self._validate_batches()
        self._validate_files()
        if self.save_steps == 0 or self.save_steps < -1:
            raise ConfigError(
                "save_steps",
                f"must be -1 (only the final save) or >= 1, got {self.save_steps}.",
                "E.g. --save_steps 10 to checkpoint every 10 steps.",
            )
        if self.resume and self.overwrite:
            raise ConfigError(
                "overwrite",
                "--overwrite deletes the run that --resume would continue.",
                "Keep one of them: --resume continues the run, --overwrite replaces it.",
            )
        if self.resume and not os.path.isdir(self.checkpoint_dir):
            raise ConfigError(
                "resume",
                f"no checkpoint folder at {self.checkpoint_dir!r}.",
                "Point --ckpt_path (or --save_path) at the run to continue, or drop --resume.",
            )
        for name in ("call_timeout_s", "step_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ConfigError(
                    name,
                    f"must be a finite number of seconds > 0, got {value}.",
                    f"Every wait has a deadline; e.g. --{name} 600.",
                )
        if self.address and self.num_gpus is not None:
            raise ConfigError(
                "num_gpus",
                f"cannot declare GPUs when joining the running cluster at {self.address}.",
                "Drop --num_gpus; the cluster's own GPUs are used.",
            )
        from .inactive import check

        check(self)  # a setting that would do nothing in this run is refused (the table in inactive.py)
        return self

    def _validate_precision(self) -> None:
        """What DeepSpeed (0.19.8) would assert on for bf16 master weights / optimizer states, said before it starts."""
        asked = [n for n in ("bf16_master_weights", "bf16_optimizer_states") if getattr(self, n)]
        if not asked:
            return
        if not self.bf16:
            raise ConfigError(
                asked[0],
                "bf16 master weights and optimizer states are for a model trained in bf16, "
                "and this one trains in fp32 (no --bf16).",
                f"Add --bf16, or drop --{asked[0]}.",
            )
        if self.zero_stage == 0:
            raise ConfigError(
                asked[0],
                "DeepSpeed keeps master weights and optimizer states in bf16 only in its "
                "ZeRO optimizer (stages 1-3), and --zero_stage is 0.",
                f"Use --zero_stage 1, 2 or 3, or drop --{asked[0]}.",
            )
        if self.bf16_optimizer_states and not self.bf16_master_weights:
            raise ConfigError(
                "bf16_optimizer_states",
                "Adam's moments in bf16 need the master weights in bf16 too "
                "(DeepSpeed steps the moments in the master weights' dtype).",
                "Add --bf16_master_weights, or drop --bf16_optimizer_states.",
            )
        if self.bf16_master_weights and not self.bf16_optimizer_states and not self.adam_offload:
            raise ConfigError(
                "bf16_master_weights",
                "bf16 master weights with fp32 Adam moments are only possible "
                "with the optimizer in host memory (DeepSpeed's CPU Adam); on the GPU its moments take "
                "the master weights' dtype.",
                "Add --bf16_optimizer_states (bf16 master weights and moments on the GPU, 6 bytes per "
                "parameter, as a pure-bf16 trainer keeps them), or --adam_offload (CPU Adam: 14 bytes "
                "per parameter in host memory).",
            )

    def _validate_estimator(self) -> None:
        from hybrid_algos.advantages import list_advantage_estimators

        known = list_advantage_estimators()
        if self.advantage_estimator not in known:
            raise ConfigError(
                "advantage_estimator",
                f"unknown estimator {self.advantage_estimator!r}.",
                f"Choose one of: {', '.join(sorted(known))}; one of your own: register it in a file "
                "named by --plugins FILE.py.",
            )

    def _validate_clip(self) -> None:
        from hybrid_algos import get_policy_loss

        loss = get_policy_loss(self.policy_loss_type)
        low, high = self.clip_range
        # CISPO clips a weight, not the objective: clip_low = 1 (no lower bound) is its paper's setting.
        low_ok = 0 < low <= 1 if loss.name == "cispo" else 0 < low < 1
        if not (low_ok and high > 0):
            raise ConfigError(
                "eps_clip_low_high" if self.eps_clip_low_high else "eps_clip",
                f"clip range must satisfy 0 < low < 1 and high > 0, got ({low}, {high}).",
                "E.g. --eps_clip 0.2, or --eps_clip_low_high 0.2 0.28.",
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(
                "dual_clip",
                f"must be > 1 (it bounds the loss for negative advantages), got {self.dual_clip}.",
                "E.g. --dual_clip 3, or leave it unset.",
            )
        lo, hi = self.reward_clip_range
        if lo >= hi:
            raise ConfigError(
                "reward_clip_range", f"low must be below high, got ({lo}, {hi}).", "E.g. --reward_clip_range -10 10."
            )

    def _validate_correction(self) -> None:
        from hybrid_algos import list_rollout_corrections

        _choice(
            "vllm_is_correction_type",
            self.vllm_is_correction_type,
            tuple(list_rollout_corrections()),
            "`hybrid grpo --help` lists each type.",
        )
        if self.use_icepop and self.vllm_is_correction_type not in ("tis", "icepop"):
            raise ConfigError(
                "use_icepop",
                f"--use_icepop asks for icepop but --vllm_is_correction_type is {self.vllm_is_correction_type}.",
                "Keep one of them.",
            )
        if self.engine_logprobs is False and self.enable_vllm_is_correction:
            raise ConfigError(
                "engine_logprobs",
                "the rollout correction (on by default) weighs each token by the "
                "trainer's over the engine's log-prob, so the engines must return them.",
                "Drop --no_engine_logprobs, or add --no_enable_vllm_is_correction.",
            )
        if self.vllm_is_truncated_threshold is not None:
            low, high = self.vllm_is_truncated_threshold
            if not (0 <= low < high < math.inf):
                raise ConfigError(
                    "vllm_is_truncated_threshold",
                    f"need 0 <= LOW < HIGH, got ({low}, {high}).",
                    "E.g. --vllm_is_truncated_threshold 0.5 5.0 (OpenRLHF's), or 0 2 for plain TIS.",
                )

    def _validate_async(self) -> None:
        if (
            isinstance(self.async_max_staleness, bool)
            or not isinstance(self.async_max_staleness, int)
            or self.async_max_staleness < 1
        ):
            raise ConfigError(
                "async_max_staleness",
                f"must be a whole number >= 1, got {self.async_max_staleness!r}.",
                "1 is one-step-off-policy: batch k+1 is generated while batch k trains.",
            )
        if self.async_train and not self.enable_vllm_is_correction:
            raise ConfigError(
                "async_train",
                "an asynchronous run trains on samples of older weights; the gap is "
                "corrected with the engine's log-probs as the behaviour policy (the mismatch "
                "correction), which --no_enable_vllm_is_correction turns off.",
                "Drop --no_enable_vllm_is_correction, or drop --async_train.",
            )

    def _validate_dapo(self) -> None:
        if self.dynamic_filtering:
            if self.n_samples_per_prompt < 2:
                raise ConfigError(
                    "dynamic_filtering",
                    "dynamic sampling drops groups whose samples all scored the "
                    "same, so it needs at least 2 samples per prompt.",
                    "Use --n_samples_per_prompt 4 (or more).",
                )
            if self.reward_pretrain is not None:
                raise ConfigError(
                    "dynamic_filtering",
                    "dynamic sampling scores every extra round inside the rollout "
                    "turn; a reward model would need a GPU turn of its own per round.",
                    "Use a rule reward (--reward_fn module:function) with --dynamic_filtering.",
                )
            if self.dynamic_filtering_max_rounds < 0:
                raise ConfigError(
                    "dynamic_filtering_max_rounds",
                    f"must be >= 0, got {self.dynamic_filtering_max_rounds}.",
                    "E.g. --dynamic_filtering_max_rounds 8.",
                )
            lo_hi = self.dynamic_filtering_reward_range
            if lo_hi is not None and not lo_hi[0] < lo_hi[1]:
                raise ConfigError(
                    "dynamic_filtering_reward_range",
                    f"low must be below high, got {tuple(lo_hi)}.",
                    "E.g. --dynamic_filtering_reward_range 0 1.",
                )
        if self.overlong_buffer_len is not None and not 1 <= self.overlong_buffer_len <= self.generate_max_len:
            raise ConfigError(
                "overlong_buffer_len",
                f"must be in [1, generate_max_len = {self.generate_max_len}], got {self.overlong_buffer_len}.",
                "E.g. a quarter of --generate_max_len.",
            )
        if not 0 <= self.overlong_penalty_factor < math.inf:
            raise ConfigError(
                "overlong_penalty_factor",
                f"must be a finite number >= 0, got {self.overlong_penalty_factor}.",
                "E.g. --overlong_penalty_factor 1.0.",
            )
        for name in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"):
            value = getattr(self, name)
            if value is None:
                continue
            _positive(name, value)

    def _validate_agent(self) -> None:
        if not math.isfinite(self.agent_timeout_s) or self.agent_timeout_s <= 0:
            raise ConfigError(
                "agent_timeout_s",
                f"must be a finite number of seconds > 0, got {self.agent_timeout_s}.",
                "E.g. --agent_timeout_s 60 (each environment reset / step must answer within it).",
            )
        _choice(
            "agent_on_error",
            self.agent_on_error,
            AGENT_ERROR_POLICIES,
            "raise ends the run at the first bad environment call; end_sample ends that sample (reward 0, left "
            "out of the loss) and training goes on.",
        )
        for name in ("max_turns", "max_new_tokens_per_turn"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.max_new_tokens_per_turn is not None and self.max_new_tokens_per_turn > self.generate_max_len:
            raise ConfigError(
                "max_new_tokens_per_turn",
                f"{self.max_new_tokens_per_turn} is more than the whole "
                f"response may hold (generate_max_len = {self.generate_max_len}: every turn and every "
                "environment reply of a sample).",
                "Lower it, or raise --generate_max_len.",
            )
        if not self.uses_agent:  # agent settings of a single-turn run: refused by the table in inactive.py
            return
        if self.reward_pretrain is not None:
            raise ConfigError(
                "reward_pretrain",
                "a multi-turn run is rewarded by its environment (the rewards its "
                "step returns), so a reward model would be ignored.",
                "Drop --reward_pretrain, or score inside the environment's step.",
            )
        if self.reward_fn is not None:
            raise ConfigError(
                "reward_fn",
                "a multi-turn run is rewarded by its environment (the rewards its step "
                "returns), so --reward_fn would be ignored.",
                "Drop --reward_fn, or call your reward function from the environment's step.",
            )
        if self.agent_func_path is not None:
            from .agents.loader import check_agent_path

            check_agent_path(self.agent_func_path)

    def _validate_batches(self) -> None:
        samples = self.samples_per_step
        if samples % self.train_batch_size:
            hint = _closest_divisor_hint(
                samples, self.train_batch_size, self.micro_train_batch_size * self.actor_world_size
            )
            raise ConfigError(
                "train_batch_size",
                f"rollout_batch_size x n_samples_per_prompt = {samples} samples per step is not a multiple "
                f"of train_batch_size = {self.train_batch_size}.",
                f"Use a train_batch_size that divides {samples}{hint}.",
            )
        per_update = self.micro_train_batch_size * self.actor_world_size
        if self.train_batch_size % per_update:
            raise ConfigError(
                "micro_train_batch_size",
                f"train_batch_size = {self.train_batch_size} is not a multiple of micro_train_batch_size x "
                f"actor GPUs = {self.micro_train_batch_size} x {self.actor_world_size} = {per_update}.",
                "Pick micro_train_batch_size so that it divides train_batch_size / actor GPUs.",
            )
        if self.max_samples < self.rollout_batch_size:
            raise ConfigError(
                "max_samples",
                f"max_samples = {self.max_samples} is smaller than one rollout batch "
                f"(rollout_batch_size = {self.rollout_batch_size}).",
                "Raise --max_samples or lower --rollout_batch_size.",
            )
        if estimator_needs_groups(self.advantage_estimator) and self.n_samples_per_prompt < 2:
            raise ConfigError(
                "n_samples_per_prompt",
                f"{self.advantage_estimator} compares samples of the same prompt, so it needs at least 2 per prompt.",
                "Use --n_samples_per_prompt 4 (or more).",
            )

    def _validate_residency(self) -> None:
        from hybrid_core.residency import MODES, STATE_MOVES

        _choice(
            "residency",
            self.residency,
            MODES,
            "auto plans from the memory budget; all-sleep moves every "
            "shared role between its phases; manual follows --vllm_enable_sleep / --deepspeed_enable_sleep.",
        )
        for key, move in (self.residency_pins or {}).items():
            role, _, state = str(key).partition(".")
            if not role or state not in STATE_MOVES or move not in STATE_MOVES[state]:
                raise ConfigError(
                    "residency_pins",
                    f"{key}={move} is not ROLE.STATE=MOVE with a known state and move.",
                    "E.g. --residency_pins actor.optimizer=offload rollout.kv_cache=release (states: "
                    + "; ".join(f"{s}: {'/'.join(m)}" for s, m in STATE_MOVES.items())
                    + ").",
                )
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ConfigError("gpu_memory_gb", f"must be > 0, got {self.gpu_memory_gb}.", "E.g. --gpu_memory_gb 80.")
        if self.host_memory_gb is not None and not self.host_memory_gb > 0:
            raise ConfigError(
                "host_memory_gb",
                f"must be > 0, got {self.host_memory_gb}.",
                "Give each node's host memory in GiB, e.g. --host_memory_gb 1000 (or leave it out: this "
                "machine's available memory).",
            )
        if not 0 <= self.gpu_context_gb < 64:
            raise ConfigError(
                "gpu_context_gb",
                f"must be in [0, 64), got {self.gpu_context_gb}.",
                "E.g. --gpu_context_gb 0.5 (CUDA context and library workspaces of one process).",
            )
        _choice(
            "lr_scheduler",
            self.lr_scheduler,
            LR_SCHEDULERS,
            "constant_with_warmup keeps the rate after --lr_warmup_ratio; cosine_with_min_lr decays it.",
        )
        for name in ("lr_warmup_ratio", "min_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ConfigError(name, f"must be a fraction in [0, 1], got {value!r}.", f"E.g. --{name} 0.1.")
        if not 0 < self.gpu_memory_usable <= 1:
            raise ConfigError(
                "gpu_memory_usable",
                f"must be in (0, 1], got {self.gpu_memory_usable}.",
                "E.g. --gpu_memory_usable 0.92.",
            )

    def residency_settings(self) -> dict[str, Any]:
        """What the sleep flags say to the residency planner: roles asked to sleep, states pinned (``flag_pins``
        name every role a flag speaks for, present in the run or not; ``pins`` are the user's own)."""
        sleep_roles: set[str] = set()
        flag_pins: dict[tuple[str, str], str | tuple[str, str]] = {}
        pins: dict[tuple[str, str], Any] = {}
        for flag, roles in (("vllm_enable_sleep", ("rollout",)), ("deepspeed_enable_sleep", ("actor", "critic"))):
            value = getattr(self, flag)
            if value:
                sleep_roles.update(roles)
            elif value is False:  # --no_<flag>: those roles keep everything on the GPU
                for role in roles:
                    states = ("weights", "kv_cache") if role == "rollout" else ("params", "grads", "optimizer")
                    flag_pins.update({(role, s): "resident" for s in states})
        if self.ref_reward_offload:  # OpenRLHF's --ref_reward_offload: the frozen models leave between their turns
            sleep_roles.update(("reference", "reward"))
        if self.engine_sleep_level is not None and ("rollout", "weights") not in flag_pins:
            # a level given with the planner on: when the engines' weights must leave, they leave this way
            flag_pins[("rollout", "weights")] = ("resident", "offload" if self.engine_sleep_level == 1 else "discard")
        for key, move in (self.residency_pins or {}).items():
            role, _, state = str(key).partition(".")
            pins[(role, state)] = move
        return {
            "mode": self.residency,
            "sleep_roles": sleep_roles,
            "pins": pins,
            "flag_pins": flag_pins,
            "engine_sleep_level": self.engine_sleep_level or 1,
        }

    def _validate_files(self) -> None:
        for name in ("pretrain", "reward_pretrain", "critic_pretrain"):
            path = getattr(self, name)
            if path is not None and not os.path.isdir(path):
                raise ConfigError(
                    name,
                    f"no model folder at {path!r} (models are not downloaded at run time).",
                    "Give a local Hugging Face model folder (config.json + weights).",
                )
        if self.prompt_data is not None:
            from .data import check_prompt_sources

            check_prompt_sources(self.prompt_data, self.prompt_data_probs)
            if not self.input_key:
                raise ConfigError(
                    "input_key",
                    "--prompt_data needs --input_key to say which field holds the prompt.",
                    "Add e.g. --input_key prompt.",
                )
        from .remote_rewards import check_openrlhf_reward, is_openrlhf_reward

        if self.reward_fn is not None and is_openrlhf_reward(self.reward_fn):
            check_openrlhf_reward(self.reward_fn)
        elif self.reward_fn is not None:
            module, _, func = self.reward_fn.partition(":")
            if not module or not func:
                raise ConfigError(
                    "reward_fn",
                    f"expected 'module:function', got {self.reward_fn!r}.",
                    "E.g. --reward_fn my_rewards:score or --reward_fn path/to/file.py:score.",
                )
            if not os.path.isfile(module) and not _module_exists(module):
                raise ConfigError(
                    "reward_fn",
                    f"cannot find module {module!r}.",
                    "Make it importable (PYTHONPATH) or give a .py path.",
                )
        if self.reward_pretrain is not None and self.reward_fn is not None:
            raise ConfigError(
                "reward_fn",
                "both --reward_pretrain and --reward_fn are set; a run uses one reward.",
                "Keep one of them.",
            )
        if self.reward_random_head and self.reward_pretrain is None:
            raise ConfigError(
                "reward_random_head",
                "there is no reward model (--reward_pretrain) whose head it would initialise.",
                "Drop --reward_random_head, or give --reward_pretrain DIR.",
            )


#: What ``--agent_on_error`` may say.
AGENT_ERROR_POLICIES = ("raise", "end_sample")


def demo_config(cls: type[RLConfig], **overrides: Any) -> RLConfig:
    """``cls`` with the demo settings (see :data:`DEMO_SETTINGS`), then ``overrides``."""
    return cls(**{**DEMO_SETTINGS, **overrides})


#: Token budget of a micro-batch with --use_dynamic_batch when --train_max_tokens_per_gpu is not given.
DEFAULT_MAX_TOKENS_PER_GPU = 16384


def estimator_needs_critic(name: str) -> bool:
    """Whether the advantage estimator ``name`` reads critic values (from its registry entry)."""
    from hybrid_algos import get_advantage_estimator
    from hybrid_algos.errors import AlgoInputError

    try:
        return get_advantage_estimator(name).needs_critic
    except AlgoInputError:
        return False  # unknown: validate() says so


def estimator_needs_groups(name: str) -> bool:
    """Whether the advantage estimator ``name`` compares the samples of a prompt (from its registry entry)."""
    from hybrid_algos import get_advantage_estimator
    from hybrid_algos.errors import AlgoInputError

    try:
        return get_advantage_estimator(name).needs_groups
    except AlgoInputError:
        return False


def registry_help() -> str:
    """Every policy loss, rollout correction and advantage estimator with one line from its registry entry."""
    from hybrid_algos import (
        get_advantage_estimator,
        get_policy_loss,
        get_rollout_correction,
        list_advantage_estimators,
        list_policy_losses,
        list_rollout_corrections,
    )

    def block(title, names, entry):
        seen, lines = set(), [title]
        for name in names:
            item = entry(name)
            if id(item) in seen:
                continue
            seen.add(id(item))
            aliases = [a for a in getattr(item, "aliases", ()) if a != item.name]
            label = item.name + (f" ({', '.join(aliases)})" if aliases else "")
            lines.append(
                f"  {label:<30} {item.summary}" if len(label) <= 30 else f"  {label}\n  {'':<30} {item.summary}"
            )
        return lines

    estimators = block(
        "advantage estimators (--advantage_estimator):", list_advantage_estimators(False), get_advantage_estimator
    )
    for i, name in enumerate(list_advantage_estimators(False), start=1):
        entry = get_advantage_estimator(name)
        needs = [w for w, on in (("critic", entry.needs_critic), ("groups", entry.needs_groups)) if on]
        if needs:
            estimators[i] += f" [needs {' and '.join(needs)}]"
    losses = block("policy losses (--policy_loss_type):", list_policy_losses(False), get_policy_loss)
    for i, name in enumerate(list_policy_losses(False), start=1):
        losses[i] += f" [aggregation: {get_policy_loss(name).agg_mode}]"
    corrections = block(
        "rollout corrections (--vllm_is_correction_type):", list_rollout_corrections(), get_rollout_correction
    )
    return "\n".join([*estimators, "", *losses, "", *corrections])


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


#: Learning-rate schedules (OpenRLHF's names): both warm up linearly over --lr_warmup_ratio of the updates.
LR_SCHEDULERS = ("constant_with_warmup", "cosine_with_min_lr")

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
        raise ConfigError(
            name, f"{value!r} is not one of {', '.join(choices)}.", fix or f"Use one of: {', '.join(choices)}."
        )


def _closest_divisor_hint(samples: int, wanted: int, per_update: int) -> str:
    """' (e.g. N)': the divisor of ``samples`` nearest ``wanted`` that is also a multiple of ``per_update``."""
    fits = [d for d in range(per_update, samples + 1, per_update) if samples % d == 0]
    return f" (e.g. {min(fits, key=lambda d: abs(d - wanted))})" if fits else ""
