"""The trainer section of a run: the backend (DeepSpeed or FSDP2), DeepSpeed's ZeRO stage, precision, the optimizer
and its schedule, and how the trained and frozen roles batch their passes, in the trainer's own words.

The training config (``RLConfig``, OpenRLHF's flat names) builds it (``RLConfig.trainer_settings()``; the names are
mapped in :data:`hybrid_algos.train.sections.TABLE`), and the role workers read it (:mod:`.policy`, :mod:`.critic`,
:mod:`.frozen`). :meth:`TrainerSettings.validate` holds every check of these settings; its errors name them as
``trainer.<field>`` (the config turns those into the flags the user wrote).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_core.errors import ConfigError

#: Learning-rate schedules (OpenRLHF's names): both warm up linearly over lr_warmup_ratio of the updates.
LR_SCHEDULERS = ("constant_with_warmup", "cosine_with_min_lr")
#: Trainer backends of the trained roles (actor, critic): DeepSpeed's ZeRO engine, or torch's FSDP2 (fully_shard).
BACKENDS = ("deepspeed", "fsdp2")
#: The settings only DeepSpeed reads, with their defaults: under fsdp2 a different value would do nothing.
DEEPSPEED_ONLY = {"zero_stage": 2, "adam_offload": False}
#: Token budget of a micro-batch by tokens (dynamic_batch) when train_max_tokens is not given.
DEFAULT_MAX_TOKENS_PER_GPU = 16384


@dataclass(frozen=True)
class TrainerSettings:
    """How the trained roles (actor, critic) run under their backend (DeepSpeed or FSDP2), and how every role
    batches its forward passes.
    Defaults are the flat config's."""

    backend: str = "deepspeed"  # deepspeed | fsdp2 (trainer_backends/registry.py)
    # ---- DeepSpeed (bf16, bf16_master_weights / optimizer_states, gradient_checkpointing also map onto fsdp2) ---
    zero_stage: int = 2  # 0-3
    bf16: bool = False  # the models compute in bf16 (else fp32)
    adam_offload: bool = False  # the optimizer in host memory (DeepSpeed's CPU Adam)
    bf16_master_weights: bool = False  # the ZeRO optimizer's master weights and gradients in bf16 (2 bytes, not 4)
    bf16_optimizer_states: bool = False  # Adam's m, v in bf16 too (with bf16_master_weights): 6 bytes per parameter
    gradient_checkpointing: bool = False  # recompute activations in the backward pass
    flash_attn: bool = False  # FlashAttention-2 kernels (else PyTorch SDPA) in the trainers
    # ---- batching ----------------------------------------------------------------------------------------------
    packing: bool = False  # forward passes concatenate samples without padding (one row, position ids)
    dynamic_batch: bool = False  # micro-batches by token budget instead of a fixed number of samples
    train_max_tokens: int | None = None  # token budget of a training micro-batch; None: DEFAULT_MAX_TOKENS_PER_GPU
    rollout_max_tokens: int | None = None  # token budget of a log-prob / value pass; None: the training budget
    # ---- optimizer ---------------------------------------------------------------------------------------------
    actor_lr: float = 1e-6
    critic_lr: float = 9e-6
    lr_warmup_ratio: float = 0.0  # linear warm-up over this fraction of the run's updates
    lr_scheduler: str = "constant_with_warmup"  # or cosine_with_min_lr: after warm-up, decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.1  # the cosine decay's floor, as a fraction of the learning rate
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0  # gradient clipping
    # ---- LoRA (the actor's and the critic's adapters: train/lora.py) -----------------------------------------------
    lora_rank: int = 0  # 0: every weight trains; > 0: PEFT LoRA adapters of this rank, the base frozen
    lora_alpha: int = 16  # the adapters' scale is lora_alpha / lora_rank
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"  # PEFT's target_modules: all-linear, or module names, comma-separated

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def train_token_budget(self) -> int:
        return self.train_max_tokens or DEFAULT_MAX_TOKENS_PER_GPU

    @property
    def rollout_token_budget(self) -> int:
        return self.rollout_max_tokens or self.train_token_budget

    @property
    def moves_states(self) -> bool:
        """The backend can offload and reload its states (the residency plan's moves of a trained role): FSDP2
        always, DeepSpeed under ZeRO 1-3."""
        return self.backend == "fsdp2" or self.zero_stage in (1, 2, 3)

    def validate(self) -> TrainerSettings:
        """Refuse what DeepSpeed would refuse (or assert on) later, as :class:`ConfigError` naming
        ``trainer.<field>``; return self."""
        if self.backend not in BACKENDS:
            raise ConfigError(
                "trainer.backend",
                f"{self.backend!r} is not one of {', '.join(BACKENDS)}.",
                "Use trainer.backend deepspeed (the default) or fsdp2 (torch's fully_shard).",
            )
        if self.backend == "fsdp2":
            self._validate_fsdp2()
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(
                "trainer.zero_stage",
                f"must be 0, 1, 2 or 3, got {self.zero_stage}.",
                "Use trainer.zero_stage 2 (the default) or 3 for models that do not fit one GPU.",
            )
        self._validate_precision()
        for name in ("actor_lr", "critic_lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"trainer.{name}", f"must be > 0, got {getattr(self, name)}.", f"E.g. trainer.{name} 1e-6."
                )
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ConfigError(
                "trainer.lr_scheduler",
                f"{self.lr_scheduler!r} is not one of {', '.join(LR_SCHEDULERS)}.",
                "constant_with_warmup keeps the rate after trainer.lr_warmup_ratio; cosine_with_min_lr decays it.",
            )
        for name in ("lr_warmup_ratio", "min_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ConfigError(
                    f"trainer.{name}", f"must be a fraction in [0, 1], got {value!r}.", f"E.g. trainer.{name} 0.1."
                )
        from ..lora import validate_lora

        validate_lora(self)
        for name in ("train_max_tokens", "rollout_max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(
                    f"trainer.{name}",
                    f"must be a positive integer, got {value!r}.",
                    f"Give trainer.{name} a whole number >= 1.",
                )
        return self

    def _validate_fsdp2(self) -> None:
        """DeepSpeed's own settings would do nothing under FSDP2: refused rather than ignored."""
        for name, default in DEEPSPEED_ONLY.items():
            if getattr(self, name) != default:
                raise ConfigError(
                    f"trainer.{name}",
                    "is DeepSpeed's, and trainer.backend fsdp2 does not read it: FSDP2 shards parameters, "
                    "gradients and optimizer state over the ranks and keeps the optimizer on the GPU (the residency "
                    "plan moves its states off between phases).",
                    f"Drop trainer.{name}, or use trainer.backend deepspeed.",
                )

    def _validate_precision(self) -> None:
        """What DeepSpeed (0.19.8) would assert on for bf16 master weights / optimizer states, said before it starts."""
        asked = [n for n in ("bf16_master_weights", "bf16_optimizer_states") if getattr(self, n)]
        if not asked:
            return
        if not self.bf16:
            raise ConfigError(
                f"trainer.{asked[0]}",
                "bf16 master weights and optimizer states are for a model trained in bf16, "
                "and this one trains in fp32 (no trainer.bf16).",
                f"Add trainer.bf16, or drop trainer.{asked[0]}.",
            )
        if self.zero_stage == 0 and self.backend == "deepspeed":
            raise ConfigError(
                f"trainer.{asked[0]}",
                "DeepSpeed keeps master weights and optimizer states in bf16 only in its "
                "ZeRO optimizer (stages 1-3), and trainer.zero_stage is 0.",
                f"Use trainer.zero_stage 1, 2 or 3, or drop trainer.{asked[0]}.",
            )
        if self.bf16_optimizer_states and not self.bf16_master_weights:
            raise ConfigError(
                "trainer.bf16_optimizer_states",
                "Adam's moments in bf16 need the master weights in bf16 too "
                "(the optimizer steps the moments in the master weights' dtype).",
                "Add trainer.bf16_master_weights, or drop trainer.bf16_optimizer_states.",
            )
        if self.bf16_master_weights and not self.bf16_optimizer_states and self.backend == "fsdp2":
            raise ConfigError(
                "trainer.bf16_master_weights",
                "under trainer.backend fsdp2 torch's AdamW keeps Adam's moments in the master weights' dtype, so "
                "bf16 master weights come with bf16 moments.",
                "Add trainer.bf16_optimizer_states (6 bytes per parameter, sharded over the ranks).",
            )
        if self.bf16_master_weights and not self.bf16_optimizer_states and not self.adam_offload:
            raise ConfigError(
                "trainer.bf16_master_weights",
                "bf16 master weights with fp32 Adam moments are only possible "
                "with the optimizer in host memory (DeepSpeed's CPU Adam); on the GPU its moments take "
                "the master weights' dtype.",
                "Add trainer.bf16_optimizer_states (bf16 master weights and moments on the GPU, 6 bytes per "
                "parameter, as a pure-bf16 trainer keeps them), or trainer.adam_offload (CPU Adam: 14 bytes "
                "per parameter in host memory).",
            )
