"""The rollout section: what a step generates and trains on — the batch shape, sampling, the prompts, asynchronous
generation and multi-turn agents.

:class:`RolloutSettings` is built from the flat config by ``RLConfig.rollout_settings()`` (the rows of
:data:`hybrid_algos.train.sections.TABLE`); its :meth:`~RolloutSettings.validate` holds the checks of these settings,
naming each as ``rollout.name`` (the config turns that into the flag the user wrote). The data functions
(:mod:`.data`), the multi-turn rollout (:mod:`.agents`) and the asynchronous runner (:mod:`.async_loop`) read this
section, not the flat config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybrid_core.errors import ConfigError

#: What ``rollout.agent_on_error`` may say.
AGENT_ERROR_POLICIES = ("raise", "end_sample")
#: Turns of a sample when neither rollout.max_turns nor the built-in task says.
DEFAULT_MAX_TURNS = 8


@dataclass(frozen=True)
class AgentSettings:
    """The multi-turn limits of a run, resolved (:meth:`RolloutSettings.agent_settings`): what the environment's
    rollout (:class:`~hybrid_algos.train.agents.AgentRollout`) and its guard run under."""

    max_turns: int
    turn_tokens: int | None  # new tokens of one turn (None: what is left of the response budget)
    timeout_s: float
    on_error: str


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout section (field names: OpenRLHF's, which already say what they size)."""

    # ---- batch shape
    rollout_batch_size: int = 16  # prompts per step
    n_samples_per_prompt: int = 1
    micro_rollout_batch_size: int = 16  # per GPU, for reference / critic / reward inference
    train_batch_size: int = 16  # samples per optimizer step (all ranks)
    micro_train_batch_size: int = 8  # per GPU
    max_epochs: int = 1  # passes over each rollout batch
    num_episodes: int = 1  # passes over the prompt set
    max_samples: int = 1_000_000
    max_steps: int | None = None  # stop after this many steps (None = as many as the prompts allow)
    prompt_max_len: int = 1024
    generate_max_len: int = 1024
    # ---- sampling
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # ---- asynchronous generation
    async_train: bool = False
    async_max_staleness: int = 1
    partial_rollout: bool = False
    # ---- prompts
    prompt_data: str | None = None  # None: the built-in task's prompts
    input_key: str | None = None
    label_key: str | None = None
    apply_chat_template: bool = False
    prompt_split: str = "train"
    prompt_data_probs: str | None = None
    input_template: str | None = None
    image_key: str = "images"  # vision-language prompts: train/images.py
    max_images_per_prompt: int = 0  # 0: text training; a record with images is then refused
    seed: int = 42  # the prompts' order and the built-in task's draws
    # ---- multi-turn agents
    agent_func_path: str | None = None
    max_turns: int | None = None
    max_new_tokens_per_turn: int | None = None
    agent_timeout_s: float = 60.0
    agent_on_error: str = "raise"

    # ---- derived ----------------------------------------------------------------------------------------------
    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def single_update(self) -> bool:
        """One optimizer step per rollout: one epoch, and the whole rollout is one train batch."""
        return self.max_epochs == 1 and self.train_batch_size == self.samples_per_step

    def agent_settings(self, builtin: bool) -> AgentSettings:
        """The multi-turn limits: the settings, else the built-in task's (``builtin``: its lookup environment), else
        :data:`DEFAULT_MAX_TURNS` turns of whatever the response budget leaves."""
        from .agents.lookup import MAX_TURNS, TURN_TOKENS

        max_turns = self.max_turns or (MAX_TURNS if builtin else DEFAULT_MAX_TURNS)
        turn_tokens = self.max_new_tokens_per_turn or (TURN_TOKENS if builtin else None)
        return AgentSettings(max_turns, turn_tokens, self.agent_timeout_s, self.agent_on_error)

    # ---- checks ------------------------------------------------------------------------------------------------
    def validate(
        self, *, actor_gpus: int = 1, grouped_estimator: str | None = None, corrected: bool = True
    ) -> RolloutSettings:
        """Check these settings; return self. The checks that need another section take what they need from it:
        ``actor_gpus`` (placement: a train batch splits over the actor's GPUs), ``grouped_estimator`` (algorithm: the
        advantage estimator's name when it compares the samples of a prompt) and ``corrected`` (algorithm: the
        mismatch correction is on, which an asynchronous run needs)."""
        for name in (
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
        ):
            _positive(name, getattr(self, name))
        if self.max_steps is not None:
            _positive("max_steps", self.max_steps)
        self._validate_async(corrected)
        self._validate_sampling()
        self._validate_agent()
        self._validate_batches(actor_gpus, grouped_estimator)
        self._validate_images()
        if self.prompt_data is not None:
            from .prompt_sources import check_prompt_sources

            check_prompt_sources(self.prompt_data, self.prompt_data_probs)
            if not self.input_key:
                raise ConfigError(
                    "rollout.input_key",
                    "rollout.prompt_data needs rollout.input_key to say which field holds the prompt.",
                    "Add e.g. rollout.input_key prompt.",
                )
        return self

    @property
    def images(self) -> bool:
        """Whether the prompts may hold images (vision-language training)."""
        return self.max_images_per_prompt > 0

    def _validate_images(self) -> None:
        n = self.max_images_per_prompt
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(
                "rollout.max_images_per_prompt",
                f"must be a whole number >= 0, got {n!r}.",
                "0 trains on text; N > 0 lets each prompt hold up to N images.",
            )
        if not isinstance(self.image_key, str) or not self.image_key:
            raise ConfigError("rollout.image_key", f"must name a record field, got {self.image_key!r}.")
        if not self.images:
            return
        if self.prompt_data is None:
            raise ConfigError(
                "rollout.max_images_per_prompt",
                "images come with your prompts (--prompt_data); the built-in tasks are text.",
                "Add --prompt_data FILE (records with images), or drop --max_images_per_prompt.",
            )
        for flag, on in (("agent_func_path", self.agent_func_path is not None),):
            if on:
                raise ConfigError(
                    f"rollout.{flag}",
                    "multi-turn environments do not take images yet (vision-language training is single-turn).",
                    f"Drop --{flag}, or --max_images_per_prompt.",
                )

    def _validate_async(self, corrected: bool) -> None:
        staleness = self.async_max_staleness
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
            raise ConfigError(
                "rollout.async_max_staleness",
                f"must be a whole number >= 1, got {staleness!r}.",
                "1 is one-step-off-policy: batch k+1 is generated while batch k trains.",
            )
        if self.async_train and not corrected:
            raise ConfigError(
                "rollout.async_train",
                "an asynchronous run trains on samples of older weights; the gap is "
                "corrected with the engine's log-probs as the behaviour policy (the mismatch "
                "correction), which no_algorithm.correction turns off.",
                "Drop no_algorithm.correction, or drop rollout.async_train.",
            )

    def _validate_sampling(self) -> None:
        bad_p = not 0 < self.top_p <= 1
        if self.temperature < 0 or bad_p or self.top_k == 0 or self.top_k < -1:
            name = "temperature" if self.temperature < 0 else "top_p" if bad_p else "top_k"
            raise ConfigError(
                f"rollout.{name}",
                f"got temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}.",
                "Use temperature >= 0, 0 < top_p <= 1, and top_k = -1 (off) or >= 1.",
            )

    def _validate_agent(self) -> None:
        if not math.isfinite(self.agent_timeout_s) or self.agent_timeout_s <= 0:
            raise ConfigError(
                "rollout.agent_timeout_s",
                f"must be a finite number of seconds > 0, got {self.agent_timeout_s}.",
                "E.g. rollout.agent_timeout_s 60 (each environment reset / step must answer within it).",
            )
        if self.agent_on_error not in AGENT_ERROR_POLICIES:
            raise ConfigError(
                "rollout.agent_on_error",
                f"{self.agent_on_error!r} is not one of {', '.join(AGENT_ERROR_POLICIES)}.",
                "raise ends the run at the first bad environment call; end_sample ends that sample (reward 0, left "
                "out of the loss) and training goes on.",
            )
        for name in ("max_turns", "max_new_tokens_per_turn"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.max_new_tokens_per_turn is not None and self.max_new_tokens_per_turn > self.generate_max_len:
            raise ConfigError(
                "rollout.max_new_tokens_per_turn",
                f"{self.max_new_tokens_per_turn} is more than the whole "
                f"response may hold (generate_max_len = {self.generate_max_len}: every turn and every "
                "environment reply of a sample).",
                "Lower it, or raise rollout.generate_max_len.",
            )
        if self.agent_func_path is not None:
            from .agents.loader import check_agent_path

            check_agent_path(self.agent_func_path)

    def _validate_batches(self, actor_gpus: int, grouped_estimator: str | None) -> None:
        samples = self.samples_per_step
        per_update = self.micro_train_batch_size * actor_gpus
        if samples % self.train_batch_size:
            hint = _closest_divisor_hint(samples, self.train_batch_size, per_update)
            raise ConfigError(
                "rollout.train_batch_size",
                f"rollout_batch_size x n_samples_per_prompt = {samples} samples per step is not a multiple "
                f"of train_batch_size = {self.train_batch_size}.",
                f"Use a train_batch_size that divides {samples}{hint}.",
            )
        if self.train_batch_size % per_update:
            raise ConfigError(
                "rollout.micro_train_batch_size",
                f"train_batch_size = {self.train_batch_size} is not a multiple of micro_train_batch_size x "
                f"actor GPUs = {self.micro_train_batch_size} x {actor_gpus} = {per_update}.",
                "Pick micro_train_batch_size so that it divides train_batch_size / actor GPUs.",
            )
        if self.max_samples < self.rollout_batch_size:
            raise ConfigError(
                "rollout.max_samples",
                f"max_samples = {self.max_samples} is smaller than one rollout batch "
                f"(rollout_batch_size = {self.rollout_batch_size}).",
                "Raise rollout.max_samples or lower rollout.rollout_batch_size.",
            )
        if grouped_estimator is not None and self.n_samples_per_prompt < 2:
            raise ConfigError(
                "rollout.n_samples_per_prompt",
                f"{grouped_estimator} compares samples of the same prompt, so it needs at least 2 per prompt.",
                "Use rollout.n_samples_per_prompt 4 (or more).",
            )


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"rollout.{name}",
            f"must be a positive integer, got {value!r}.",
            f"Give rollout.{name} a whole number >= 1.",
        )


def _closest_divisor_hint(samples: int, wanted: int, per_update: int) -> str:
    """' (e.g. N)': the divisor of ``samples`` nearest ``wanted`` that is also a multiple of ``per_update``."""
    fits = [d for d in range(per_update, samples + 1, per_update) if samples % d == 0]
    return f" (e.g. {min(fits, key=lambda d: abs(d - wanted))})" if fits else ""
