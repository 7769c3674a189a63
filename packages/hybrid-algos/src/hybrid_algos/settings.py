"""The algorithm section of a run: advantages, losses, KL, the rollout correction and DAPO's pieces, in the math's
own words.

The training config (``RLConfig``, OpenRLHF's flat names) builds it (``RLConfig.algorithm_settings()``; the names
are mapped in ``hybrid_algos.train.sections.TABLE``), and the trainer's loss code, the advantage step and the rollout's
dynamic sampling read it. :meth:`AlgorithmSettings.validate` holds every check of these settings; its errors name
them as ``algorithm.<field>`` (the config turns those into the flags the user wrote). Only torch's side of the
package is imported here: the registries this section names (estimators, policy losses, corrections) are the
math's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .advantages import get_advantage_estimator, list_advantage_estimators
from .aggregation import LOSS_AGG_MODES
from .errors import AlgoInputError
from .kl import KL_ESTIMATOR_ALIASES, KL_ESTIMATORS
from .mismatch import get_rollout_correction, list_rollout_corrections
from .policy_loss import get_policy_loss, list_policy_losses

#: Where a fix says how to register a loss or an estimator of one's own (the run's plugin files).
_PLUGINS_FIX = "register it in a file named by models.plugins FILE.py"


@dataclass(frozen=True)
class AlgorithmSettings:
    """What the algorithm computes: advantages, the policy / value / KL / entropy losses, the engine-trainer
    correction, and DAPO's reward shaping and dynamic sampling. Defaults are the flat config's."""

    # ---- advantages ------------------------------------------------------------------------------------------
    estimator: str = "gae"  # the advantage estimator's registry name (gae, group_norm, reinforce, ...)
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE's lambda
    # ---- KL to the reference ---------------------------------------------------------------------------------
    kl_coef: float = 0.01  # the KL term's (initial) coefficient; 0: no KL term, no reference model
    kl_target: float | None = None  # set: an adaptive controller steers the coefficient towards this KL
    kl_horizon: int = 10000  # the adaptive controller's horizon (samples)
    kl_estimator: str = "k1"  # k1 | k2 | k3 (or OpenRLHF's aliases)
    kl_loss: bool = False  # KL as a loss term (GRPO), not a reward penalty
    # ---- policy and value losses -----------------------------------------------------------------------------
    policy_loss: str = "ppo"  # the policy loss's registry name
    agg_mode: str | None = None  # the loss aggregation; None: the policy loss's own (the value loss: token-mean)
    clip_eps: float | None = None  # the clip range both ways; None: the policy loss's own
    clip_low_high: tuple[float, float] | None = None  # an asymmetric clip range (clip-higher)
    dual_clip: float | None = None  # the bound of the loss for negative advantages (> 1)
    value_clip: float = 0.2
    entropy_coef: float = 0.0  # the entropy bonus; > 0 makes the trainer compute the entropy
    recompute_old_logprobs: bool = False  # always run the old log-prob pass (else skipped when on-policy)
    # ---- rewards ---------------------------------------------------------------------------------------------
    normalize_reward: bool = False
    reward_clip: tuple[float, float] = (-10.0, 10.0)
    # ---- engine/trainer mismatch (hybrid_algos.mismatch) -----------------------------------------------------
    correction: bool = True  # weight the policy loss by the trainer/engine importance ratios
    correction_type: str = "tis"  # the correction asked for (``use_icepop`` may override it: correction_name)
    correction_threshold: tuple[float, float] | None = None  # (LOW, HIGH) of the ratio; None: the type's own
    use_icepop: bool = False  # OpenRLHF's older switch: correction_type icepop
    engine_logprobs: bool | None = None  # the engines return sampled log-probs; None: when the correction needs them
    # ---- DAPO (hybrid_algos.dapo) ----------------------------------------------------------------------------
    dynamic_filtering: bool = False  # drop groups whose rewards are all equal, generate more until the batch fills
    filter_reward_range: tuple[float, float] | None = None  # also drop groups whose mean reward is outside it
    filter_max_rounds: int = 8  # extra generation rounds per step, then dropped groups fill the batch
    overlong_buffer_len: int | None = None  # the soft overlong penalty over the last N tokens of the length limit
    overlong_penalty_factor: float = 1.0  # the penalty at the length limit
    mask_truncated_completions: bool = False  # completions cut at the length limit leave the policy loss
    # ---- on-policy distillation (hybrid_algos.distillation; only with a teacher role) --------------------------
    distill_coef: float = 1.0  # weight of the teacher's per-token reverse KL in the advantage
    distill_task_coef: float = 1.0  # weight of the task reward's advantage beside it; 0: distillation alone

    # ---- what the settings imply -------------------------------------------------------------------------------
    @property
    def uses_critic(self) -> bool:
        """The estimator reads critic values (its registry entry says so), so a critic is trained."""
        try:
            return get_advantage_estimator(self.estimator).needs_critic
        except AlgoInputError:
            return False  # unknown: validate() says so

    @property
    def needs_groups(self) -> bool:
        """The estimator compares the samples of a prompt (its registry entry says so)."""
        try:
            return get_advantage_estimator(self.estimator).needs_groups
        except AlgoInputError:
            return False

    @property
    def uses_reference(self) -> bool:
        # A zero coefficient makes the KL term vanish, as a reward penalty or as a loss: no reference to run.
        return self.kl_coef > 0

    @property
    def policy_agg_mode(self) -> str:
        """``agg_mode``, or the policy loss's own default when it is not set."""
        return self.agg_mode if self.agg_mode is not None else get_policy_loss(self.policy_loss).agg_mode

    @property
    def value_agg_mode(self) -> str:
        return self.agg_mode or "token-mean"

    @property
    def clip_range(self) -> tuple[float, float]:
        """``clip_low_high``, else ``clip_eps`` both ways, else the policy loss's paper default."""
        if self.clip_low_high:
            low, high = self.clip_low_high  # a --config file gives a list
            return (low, high)
        if self.clip_eps is not None:
            return (self.clip_eps, self.clip_eps)
        return get_policy_loss(self.policy_loss).default_clip

    def clip_note(self) -> str | None:
        """What the plan says when the clip range is a policy loss's own default that is not PPO's 0.2."""
        if self.clip_low_high or self.clip_eps is not None:
            return None
        loss = get_policy_loss(self.policy_loss)
        if loss.default_clip == (0.2, 0.2):
            return None
        low, high = loss.default_clip
        return (
            f"policy loss {loss.name}: clip range ({low:g}, {high:g}) from {loss.default_clip_source} "
            "(algorithm.clip_eps / algorithm.clip_low_high set another)"
        )

    @property
    def correction_name(self) -> str:
        """The rollout correction applied: ``correction_type``, or icepop with ``use_icepop``."""
        return "icepop" if self.use_icepop else self.correction_type

    @property
    def correction_bounds(self) -> tuple[float | None, float]:
        """(low, high) of the rollout correction: the threshold given, or the correction type's own."""
        if self.correction_threshold is not None:
            low, high = self.correction_threshold
            return float(low), float(high)
        spec = get_rollout_correction(self.correction_name)
        return spec.low, spec.high

    @property
    def wants_engine_logprobs(self) -> bool:
        """Whether the engines are asked for the sampled tokens' log-probs: the correction needs them, and
        ``engine_logprobs`` adds the mismatch metrics without it. They cost the engine (vLLM 0.26: ~22-24 % of a 357M
        model's generate call on an H100), so nothing asks for them that does not use them."""
        return self.correction if self.engine_logprobs is None else self.engine_logprobs

    def needs_old_logprobs(self, single_update: bool) -> bool:
        """Whether a step runs the actor's forward pass for the "old" log-probs before training.

        With a single update (``single_update``: one epoch, the whole rollout one train batch), DeepSpeed only steps
        at the end of gradient accumulation, so every micro-batch of the actor's update sees the pre-update weights:
        its own detached log-probs are the old ones (ratio 1). They are still needed before training for KL as a
        reward penalty (the advantage step), and for an adaptive KL controller, which steers on the KL they give.
        """
        if self.recompute_old_logprobs or not single_update:
            return True
        return self.uses_reference and (not self.kl_loss or self.kl_target is not None)

    # ---- checks --------------------------------------------------------------------------------------------------
    def validate(
        self,
        *,
        n_samples_per_prompt: int | None = None,
        generate_max_len: int | None = None,
        reward_model: bool = False,
    ) -> AlgorithmSettings:
        """Refuse what the math cannot run, as :class:`AlgoInputError` naming ``algorithm.<field>``; return self.

        The checks that need the rollout's shape take it as arguments (skipped when not given):
        ``n_samples_per_prompt`` (dynamic sampling compares a prompt's samples), ``generate_max_len`` (the overlong
        buffer lies within it) and ``reward_model`` (the run scores with a reward model, not a rule)."""
        if self.agg_mode is not None:
            _choice("algorithm.agg_mode", self.agg_mode, LOSS_AGG_MODES)
        _choice("algorithm.kl_estimator", self.kl_estimator, (*KL_ESTIMATORS, *KL_ESTIMATOR_ALIASES))
        _choice(
            "algorithm.policy_loss",
            self.policy_loss,
            tuple(list_policy_losses()),
            f"`hybrid grpo --help` lists each loss; a loss of your own: {_PLUGINS_FIX}.",
        )
        self._validate_estimator()
        if self.kl_coef < 0:
            raise AlgoInputError(
                "algorithm.kl_coef",
                f"must be >= 0, got {self.kl_coef}.",
                "Use 0 for no KL term, or a small positive value such as 0.01.",
            )
        self._validate_clip()
        self._validate_correction()
        self._validate_dapo(n_samples_per_prompt, generate_max_len, reward_model)
        self._validate_distillation()
        return self

    def _validate_distillation(self) -> None:
        for name in ("distill_coef", "distill_task_coef"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise AlgoInputError(
                    f"algorithm.{name}", f"must be a finite number >= 0, got {value}.", "E.g. 1.0 (or 0 to drop it)."
                )
        if self.distill_coef == 0 and self.distill_task_coef == 0:
            raise AlgoInputError(
                "algorithm.distill_coef",
                "with algorithm.distill_task_coef 0 too, every advantage would be 0 and nothing would be learned.",
                "Give algorithm.distill_coef > 0 (distillation), algorithm.distill_task_coef > 0 (the task), or both.",
            )

    def _validate_estimator(self) -> None:
        known = list_advantage_estimators()
        if self.estimator not in known:
            raise AlgoInputError(
                "algorithm.estimator",
                f"unknown estimator {self.estimator!r}.",
                f"Choose one of: {', '.join(sorted(known))}; one of your own: {_PLUGINS_FIX}.",
            )

    def _validate_clip(self) -> None:
        loss = get_policy_loss(self.policy_loss)
        low, high = self.clip_range
        # CISPO clips a weight, not the objective: clip_low = 1 (no lower bound) is its paper's setting.
        low_ok = 0 < low <= 1 if loss.name == "cispo" else 0 < low < 1
        if not (low_ok and high > 0):
            raise AlgoInputError(
                "algorithm.clip_low_high" if self.clip_low_high else "algorithm.clip_eps",
                f"clip range must satisfy 0 < low < 1 and high > 0, got ({low}, {high}).",
                "E.g. algorithm.clip_eps 0.2, or algorithm.clip_low_high 0.2 0.28.",
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise AlgoInputError(
                "algorithm.dual_clip",
                f"must be > 1 (it bounds the loss for negative advantages), got {self.dual_clip}.",
                "E.g. algorithm.dual_clip 3, or leave it unset.",
            )
        lo, hi = self.reward_clip
        if lo >= hi:
            raise AlgoInputError(
                "algorithm.reward_clip",
                f"low must be below high, got ({lo}, {hi}).",
                "E.g. algorithm.reward_clip -10 10.",
            )

    def _validate_correction(self) -> None:
        _choice(
            "algorithm.correction_type",
            self.correction_type,
            tuple(list_rollout_corrections()),
            "`hybrid grpo --help` lists each type.",
        )
        if self.use_icepop and self.correction_type not in ("tis", "icepop"):
            raise AlgoInputError(
                "algorithm.use_icepop",
                f"algorithm.use_icepop asks for icepop but algorithm.correction_type is {self.correction_type}.",
                "Keep one of them.",
            )
        if self.engine_logprobs is False and self.correction:
            raise AlgoInputError(
                "algorithm.engine_logprobs",
                "the rollout correction (on by default) weighs each token by the "
                "trainer's over the engine's log-prob, so the engines must return them.",
                "Drop no_algorithm.engine_logprobs, or add no_algorithm.correction.",
            )
        if self.correction_threshold is not None:
            low, high = self.correction_threshold
            if not (0 <= low < high < math.inf):
                raise AlgoInputError(
                    "algorithm.correction_threshold",
                    f"need 0 <= LOW < HIGH, got ({low}, {high}).",
                    "E.g. algorithm.correction_threshold 0.5 5.0 (OpenRLHF's), or 0 2 for plain TIS.",
                )

    def _validate_dapo(
        self, n_samples_per_prompt: int | None, generate_max_len: int | None, reward_model: bool
    ) -> None:
        if self.dynamic_filtering:
            if n_samples_per_prompt is not None and n_samples_per_prompt < 2:
                raise AlgoInputError(
                    "algorithm.dynamic_filtering",
                    "dynamic sampling drops groups whose samples all scored the "
                    "same, so it needs at least 2 samples per prompt.",
                    "Use rollout.n_samples_per_prompt 4 (or more).",
                )
            if reward_model:
                raise AlgoInputError(
                    "algorithm.dynamic_filtering",
                    "dynamic sampling scores every extra round inside the rollout "
                    "turn; a reward model would need a GPU turn of its own per round.",
                    "Use a rule reward (models.reward_fn module:function) with algorithm.dynamic_filtering.",
                )
            if self.filter_max_rounds < 0:
                raise AlgoInputError(
                    "algorithm.filter_max_rounds",
                    f"must be >= 0, got {self.filter_max_rounds}.",
                    "E.g. algorithm.filter_max_rounds 8.",
                )
            lo_hi = self.filter_reward_range
            if lo_hi is not None and not lo_hi[0] < lo_hi[1]:
                raise AlgoInputError(
                    "algorithm.filter_reward_range",
                    f"low must be below high, got {tuple(lo_hi)}.",
                    "E.g. algorithm.filter_reward_range 0 1.",
                )
        buffer = self.overlong_buffer_len
        if buffer is not None and not 1 <= buffer <= (generate_max_len or math.inf):
            where = f"[1, generate_max_len = {generate_max_len}]" if generate_max_len else "[1, the length limit]"
            raise AlgoInputError(
                "algorithm.overlong_buffer_len",
                f"must be in {where}, got {buffer}.",
                "E.g. a quarter of rollout.generate_max_len.",
            )
        if not 0 <= self.overlong_penalty_factor < math.inf:
            raise AlgoInputError(
                "algorithm.overlong_penalty_factor",
                f"must be a finite number >= 0, got {self.overlong_penalty_factor}.",
                "E.g. algorithm.overlong_penalty_factor 1.0.",
            )


def _choice(name: str, value: str, choices: tuple[str, ...], fix: str | None = None) -> None:
    if value not in choices:
        raise AlgoInputError(
            name, f"{value!r} is not one of {', '.join(choices)}.", fix or f"Use one of: {', '.join(choices)}."
        )
