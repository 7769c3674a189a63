"""Training configuration: one dataclass per algorithm, field names = OpenRLHF flag names.

``hybrid ppo --zero_stage 3`` sets ``PPOConfig.zero_stage``; a YAML file (``--config``) uses the same names. Every
check that can be made before Ray starts is made by :meth:`RLConfig.validate`, which raises
:class:`hybrid_core.errors.ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybrid_algos.settings import AlgorithmSettings
from hybrid_core.errors import ConfigError
from hybrid_core.placement.settings import PlacementSettings
from hybrid_core.residency.settings import ResidencySettings
from hybrid_engines.adapter import EngineSettings
from hybrid_engines.registry import validate_settings
from hybrid_engines.weight_sync.settings import SyncSettings

from .demo import DEMO_SETTINGS
from .eval_settings import EvalSettings
from .model_settings import AGENT_TASKS, ModelSettings
from .rollout_settings import RolloutSettings
from .run_settings import RunSettings
from .sections import build, flag_text, flag_words
from .train_settings import SECTION_NAMES, TrainSettings
from .workers.settings import TrainerSettings


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
    trainer: str = "deepspeed"  # the actor's and critic's backend: deepspeed (ZeRO) | fsdp2 (torch's fully_shard)
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
    # LoRA on the actor and PPO's critic, as OpenRLHF's one flag (PEFT adapters, the base frozen; train/lora.py)
    lora_rank: int = 0  # 0: train every weight; > 0: LoRA adapters of this rank (needs peft)
    lora_alpha: int = 16  # adapter scale = lora_alpha / lora_rank
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"  # all-linear, or module names, comma-separated (q_proj,v_proj)
    # what each weight sync sends under LoRA (hf and vllm engines take the adapter alone; others get merged weights)
    lora_sync: str = "auto"  # auto: adapter-only where the engines take it, else merged | adapter | merged

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

    # ---- on-policy distillation (a teacher role scores every sampled token) ---------------------------------
    teacher_pretrain: str | None = None  # the teacher's model folder (same tokenizer as the policy); None: no teacher
    distill_coef: float = 1.0  # weight of the teacher's per-token reverse KL in each token's advantage
    distill_task_coef: float = 1.0  # weight of the task reward's advantage beside it; 0: distillation alone

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
    # vision-language prompts (train/images.py): the record field of a prompt's images (paths relative to the
    # dataset file, base64 or bytes), and the most images one prompt may hold; 0 = text training (OpenRLHF's default)
    image_key: str = "images"
    max_images_per_prompt: int = 0

    # ---- evaluation during training (held-out prompts; train/evaluation.py) -------------------------------------
    eval_dataset: str | None = None  # JSONL / Parquet file(s) or datasets folder, read like --prompt_data; None: none
    eval_steps: int = -1  # evaluate after every N steps and after the last; -1: only after the last step
    eval_split: str = "train"  # the split of a datasets folder (OpenRLHF's default)
    eval_temperature: float = 0.6  # sampling temperature of the held-out prompts' samples (0: greedy)
    eval_n_samples_per_prompt: int = 4  # samples per held-out prompt: the k of eval/pass@k
    eval_pass_threshold: float = 1.0  # a sample passes when its reward is >= this (the built-in tasks' full score)

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
    # off | on (a CUDA MPS control daemon of the run's own, or the run is refused) | auto (on where generation
    # overlaps training on shared GPUs and MPS can start)
    mps: str = "off"
    mps_engine_share: int | None = None  # under MPS on shared GPUs: the engines' SM percentage, the trainers the rest

    # ---------------------------------------------------------------------------------------------------------
    #: The fields the user set (command line, --config file), recorded by the CLI (:meth:`record_given`); None: a
    #: config built in Python, where every field that differs from its default counts as set (see inactive.py).
    given_fields: ClassVar[frozenset[str] | None] = None
    #: The settings came from an OpenRLHF command line: a flag OpenRLHF also ignores is a note, not an error.
    openrlhf_line: ClassVar[bool] = False

    @property
    def algorithm(self) -> str:
        return "rl"

    # the algorithm section's derived settings that many callers read from the config (hybrid_algos.settings)
    @property
    def uses_critic(self) -> bool:
        return self.algorithm_settings().uses_critic

    @property
    def policy_agg_mode(self) -> str:
        return self.algorithm_settings().policy_agg_mode

    @property
    def value_agg_mode(self) -> str:
        return self.algorithm_settings().value_agg_mode

    @property
    def correction_bounds(self) -> tuple[float | None, float]:
        return self.algorithm_settings().correction_bounds

    @property
    def wants_engine_logprobs(self) -> bool:
        return self.algorithm_settings().wants_engine_logprobs

    @property
    def correction_type(self) -> str:
        return self.algorithm_settings().correction_name

    @property
    def uses_agent(self) -> bool:
        """Samples are multi-turn conversations with an environment (``--agent_func_path``, or a built-in agent
        task)."""
        return self.agent_func_path is not None or (self.prompt_data is None and self.task in AGENT_TASKS)

    @property
    def uses_reference(self) -> bool:
        return self.algorithm_settings().uses_reference

    @property
    def single_update(self) -> bool:
        return self.rollout_settings().single_update

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether a step runs the actor's old log-prob pass (:meth:`AlgorithmSettings.needs_old_logprobs`)."""
        teacher = self.teacher_pretrain is not None  # the distillation term needs them before the update
        return teacher or self.algorithm_settings().needs_old_logprobs(self.single_update)

    @property
    def samples_per_step(self) -> int:
        return self.rollout_settings().samples_per_step

    @property
    def actor_world_size(self) -> int:
        return self.placement_settings().world_size("actor")

    @property
    def critic_world_size(self) -> int:
        return self.placement_settings().world_size("critic")

    @property
    def clip_range(self) -> tuple[float, float]:
        return self.algorithm_settings().clip_range

    def clip_note(self) -> str | None:
        note = self.algorithm_settings().clip_note()
        return flag_text(note) if note else None

    @property
    def checkpoint_dir(self) -> str:
        return self.run_settings().checkpoint_dir

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
        return build("engine", self)

    def sync_settings(self) -> SyncSettings:
        """The weight-sync section: the path asked for, the bucket size, verification, the group backend."""
        return build("sync", self)

    def rollout_settings(self) -> RolloutSettings:
        """The rollout section: batch shape, sampling, prompts, asynchronous generation, agents."""
        return build("rollout", self)

    def run_settings(self) -> RunSettings:
        """The run section: saving, resuming, logging, Ray, deadlines."""
        return build("run", self)

    def trainer_settings(self) -> TrainerSettings:
        """The trainer section: DeepSpeed, precision, the optimizer and its schedule, how passes are batched."""
        return build("trainer", self)

    def algorithm_settings(self) -> AlgorithmSettings:
        """The algorithm section: advantages, losses, KL, the rollout correction, DAPO."""
        return build("algorithm", self)

    def placement_settings(self) -> PlacementSettings:
        """The placement section: the roles' counts and colocation, or their GPU ranges."""
        return build("placement", self)

    def residency_settings(self) -> ResidencySettings:
        """The residency section: the planner's mode, the pins, the memory budget, the sleep switches."""
        return build("residency", self)

    def models_settings(self) -> ModelSettings:
        """The models section: model folders, rewards, the built-in task and model."""
        return build("models", self)

    def evaluation_settings(self) -> EvalSettings:
        """The evaluation section: the held-out prompts, when they are generated on, how they are scored."""
        return build("evaluation", self)

    def settings(self) -> TrainSettings:
        """The run's settings in sections (:class:`~.train_settings.TrainSettings`): what everything below
        :func:`~.prepare.prepare` reads. Call it on a validated config."""
        return TrainSettings(self.algorithm, *(build(name, self) for name in SECTION_NAMES))

    # ---------------------------------------------------------------------------------------------------------
    def validate(self) -> RLConfig:
        """Check everything that can be checked without Ray or a GPU; return self so calls chain."""
        from .plugins import prepare

        prepare(self.plugins)  # first: the names they register are checked below (and the workers import them too)
        with flag_words():  # the engine registry is the one list of backends; each adapter says what it refuses
            validate_settings(self.engine_settings())
        with flag_words():  # the rollout's shape and the reward's source are arguments: DAPO's checks need them
            self.algorithm_settings().validate(
                n_samples_per_prompt=self.n_samples_per_prompt,
                generate_max_len=self.generate_max_len,
                reward_model=self.reward_pretrain is not None,
            )
        with flag_words():
            self.placement_settings().validate()
        grouped = self.advantage_estimator if estimator_needs_groups(self.advantage_estimator) else None
        with flag_words():
            self.rollout_settings().validate(
                actor_gpus=self.actor_world_size, grouped_estimator=grouped, corrected=self.enable_vllm_is_correction
            )
            self.run_settings().validate()
        with flag_words():
            self.trainer_settings().validate()
        if isinstance(self.verify_weight_sync, bool):  # a config from before the modes: on = the default
            self.verify_weight_sync = "sampled" if self.verify_weight_sync else "off"
        with flag_words():
            self.sync_settings().validate()
        with flag_words():  # the trainers' ZeRO stage is an argument: DeepSpeed moves its states only under ZeRO 1-3
            self.residency_settings().validate(zero_stage=self.zero_stage)
        self._validate_agent_reward()
        self._validate_images()
        with flag_words():
            self.models_settings().validate(builtin_prompts=self.prompt_data is None)
        with flag_words():  # the prompts' fields and what scores them are the rollout's and the models' sections'
            self.evaluation_settings().validate(
                input_key=self.input_key,
                async_train=self.async_train,
                reward_model=self.reward_pretrain is not None,
                agent=self.uses_agent,
            )
        from .inactive import check

        check(self)  # a setting that would do nothing in this run is refused (the table in inactive.py)
        return self

    def _validate_images(self) -> None:
        """Vision-language training (train/images.py, train/vision.py) crosses the rollout, models, trainer and
        engine sections: a role or mode that would see the image tokens without the images is refused by name."""
        if self.max_images_per_prompt <= 0:
            return
        if self.pretrain is None:
            raise ConfigError(
                "pretrain",
                "the built-in tiny model is a text model; prompts with images need a vision-language model.",
                "Give --pretrain a Qwen2-VL / Qwen2.5-VL folder (train/tiny_vlm.py builds a tiny one).",
            )
        refused = [
            ("packing_samples", self.packing_samples, "packed micro-batches"),
            ("critic", self.uses_critic, "PPO's critic (its values would not see the images)"),
            ("reward_pretrain", self.reward_pretrain is not None, "a reward model (it would score without them)"),
            ("teacher_pretrain", self.teacher_pretrain is not None, "a distillation teacher"),
            ("eval_dataset", self.eval_dataset is not None, "evaluation prompts"),
            ("lora_rank", bool(self.lora_rank), "LoRA adapters"),
            ("partial_rollout", self.partial_rollout and self.backend != "hf", f"{self.backend}'s partial rollouts"),
        ]
        for flag, on, what in refused:
            if on:
                fix = (
                    "Use GRPO or REINFORCE++ (--advantage_estimator grpo / reinforce)"
                    if flag == "critic"
                    else (f"Drop --{flag}")
                )
                raise ConfigError(
                    flag,
                    f"{what} do not take images yet (vision-language training: --max_images_per_prompt "
                    f"{self.max_images_per_prompt}).",
                    f"{fix}, or train on text (--max_images_per_prompt 0).",
                )

    def _validate_agent_reward(self) -> None:
        # crosses the rollout (is this a multi-turn run?) and the models (where rewards come from) sections
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


def demo_config(cls: type[RLConfig], **overrides: Any) -> RLConfig:
    """``cls`` with the demo settings (see :data:`DEMO_SETTINGS`), then ``overrides``."""
    return cls(**{**DEMO_SETTINGS, **overrides})


def estimator_needs_critic(name: str) -> bool:
    """Whether the advantage estimator ``name`` reads critic values (from its registry entry; unknown: False)."""
    return AlgorithmSettings(estimator=name).uses_critic


def estimator_needs_groups(name: str) -> bool:
    """Whether the advantage estimator ``name`` compares the samples of a prompt (from its registry entry)."""
    return AlgorithmSettings(estimator=name).needs_groups


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


CONFIGS: dict[str, type[RLConfig]] = {"ppo": PPOConfig, "grpo": GRPOConfig, "reinforce": ReinforceConfig}


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"must be a positive integer, got {value!r}.", f"Give --{name} a whole number >= 1.")


def _choice(name: str, value: str, choices: tuple[str, ...], fix: str | None = None) -> None:
    if value not in choices:
        raise ConfigError(
            name, f"{value!r} is not one of {', '.join(choices)}.", fix or f"Use one of: {', '.join(choices)}."
        )
