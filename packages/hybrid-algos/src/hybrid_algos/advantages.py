"""Advantage estimators behind a small registry, all called the same way: ``estimator(AdvantageInputs) -> (A, R)``.

Built in (canonical name, then in brackets the ``--advantage_estimator`` alias OpenRLHF users type):

- ``gae`` [``gae``] -- PPO with a critic: GAE(gamma, lambda) (Schulman et al. 2016, "High-Dimensional Continuous
  Control Using Generalized Advantage Estimation"); advantages whitened over the batch, returns ``A + V``.
- ``reinforce_plus_plus`` [``reinforce``] -- REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted reward-to-go of
  the per-token rewards (KL penalty included), whitened over the batch. No critic.
- ``reinforce_plus_plus_baseline`` [``reinforce_baseline``] -- REINFORCE++-baseline: each score minus its prompt's
  mean score, then as above.
- ``grpo`` [``group_norm``] -- GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300):
  ``(score - group mean) / (group std + eps)``, broadcast over the response.
- ``dr_grpo`` [``dr_grpo``] -- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective", arXiv:2503.20783): ``score - group mean``.
- ``rloo`` [``rloo``] -- RLOO (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et
  al. 2024, "Back to Basics", arXiv:2402.14740): ``score - mean of the prompt's other samples``.

Dr. GRPO removes both of GRPO's normalisations. The std division is removed here; the per-response length
normalisation lives in the loss, not in the advantages: aggregate the policy loss with
``agg_mode="seq-mean-token-sum-norm"`` and a constant ``norm_len`` (the max generation length) — see
:mod:`hybrid_algos.aggregation`.

Rewards. ``scores`` ``[batch]`` are the outcome rewards (one per response); ``token_rewards`` ``[batch, len]`` are
*extra* per-token rewards, typically the KL penalty from :func:`hybrid_algos.kl.kl_penalty`. The per-token reward
an estimator works with is ``token_rewards`` plus the (shaped) score on the last valid token. Group baselines are
computed from ``scores`` alone. If you already built the full per-token reward (e.g. with
:func:`hybrid_algos.kl.kl_penalty_rewards`), pass it as ``token_rewards`` and leave ``scores=None`` (gae and
reinforce_plus_plus only: group estimators need the scores).

Discount. gae and the REINFORCE++ pair discount the whole per-token reward with ``gamma``. grpo, dr_grpo and rloo
broadcast the shaped score to every valid token undiscounted and add the ``gamma``-discounted reward-to-go of
``token_rewards`` (equal to OpenRLHF's behaviour, which forces gamma = 1 for them).

Groups. Pass ``n_samples_per_prompt=n`` when the batch holds consecutive blocks of ``n`` samples per prompt, or
``group_ids`` (one id per sample, any order) otherwise. Std is the unbiased (n - 1) one, as in GRPO's reference
implementations; a group of one gets advantage 0 (there is nothing to compare with), except in rloo, which refuses.

Batch statistics (whitening) are over the batch given: pass the whole rollout batch, not a micro-batch.
Outputs are float32 (or wider), detached, and 0 at masked positions. Add an estimator with
:func:`register_advantage_estimator`, in a file a training run names with ``--plugins FILE.py``
(:mod:`hybrid_algos.train.plugins`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from . import _checks
from .errors import AlgoInputError
from .masked import masked_whiten
from .returns import discounted_returns, generalized_advantages, scores_to_token_rewards

EstimatorFn = Callable[["AdvantageInputs"], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class AdvantageInputs:
    """Everything any estimator may need; each uses the fields it needs and says which are missing.

    Shapes: ``response_mask``, ``token_rewards``, ``values``: ``[batch, response_len]``; ``scores``: ``[batch]``.
    Checked on construction (shapes, dtypes, devices, NaN/inf at valid positions); ``response_mask`` is stored as
    bool and integer/bool ``scores`` as float32.
    """

    response_mask: torch.Tensor
    scores: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    values: torch.Tensor | None = None
    group_ids: torch.Tensor | Sequence[Hashable] | None = None
    n_samples_per_prompt: int | None = None
    gamma: float = 1.0
    lam: float = 1.0
    eps: float = 1e-6

    def __post_init__(self) -> None:
        raw_mask = self.response_mask
        mask = _checks.mask("response_mask", raw_mask)
        self.response_mask = mask
        batch = mask.shape[0]
        value_checks: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        if self.scores is None and self.token_rewards is None:
            raise AlgoInputError(
                "scores",
                "neither scores nor token_rewards were given.",
                "Pass scores=[batch] outcome rewards and/or token_rewards=[batch, len].",
            )
        if self.scores is not None:
            scores = _checks.tensor("scores", self.scores, ndim=1)
            if scores.shape[0] != batch or scores.device != mask.device:
                raise AlgoInputError(
                    "scores",
                    f"shape {tuple(scores.shape)} on {scores.device} does not match "
                    f"response_mask {tuple(mask.shape)} on {mask.device}.",
                    "Pass one score per sequence, on the mask's device.",
                )
            self.scores = scores if scores.is_floating_point() else scores.float()
            value_checks.append(("scores", self.scores, None))
        for name in ("token_rewards", "values"):
            x = getattr(self, name)
            if x is not None:
                x = _checks.tensor(name, x, ndim=2, floating=True)
                _checks.same_shape(name, x, "response_mask", mask)
                value_checks.append((name, x, mask))
        _checks.finite(value_checks, masks=[("response_mask", raw_mask)])
        self.gamma = _checks.unit_interval("gamma", self.gamma)
        self.lam = _checks.unit_interval("lam", self.lam)
        self.eps = _checks.positive_float("eps", self.eps)
        self._check_groups(batch)

    def _check_groups(self, batch: int) -> None:
        if self.group_ids is not None and self.n_samples_per_prompt is not None:
            raise AlgoInputError(
                "group_ids",
                "both group_ids and n_samples_per_prompt were given.",
                "Pass one: n_samples_per_prompt for consecutive blocks, group_ids otherwise.",
            )
        n = self.n_samples_per_prompt
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1 or batch % n):
            raise AlgoInputError(
                "n_samples_per_prompt",
                f"must be a positive int dividing the batch ({batch}), got {n!r}.",
                "Pass the number of samples generated per prompt.",
            )
        ids = self.group_ids
        if isinstance(ids, torch.Tensor) and (ids.dim() != 1 or ids.is_floating_point() or ids.is_complex()):
            raise AlgoInputError(
                "group_ids",
                f"expected a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}.",
                "Pass integer prompt ids, shape [batch].",
            )
        if ids is not None and (isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or len(ids) != batch):
            got = f"{len(ids)} ids" if hasattr(ids, "__len__") else type(ids).__name__
            raise AlgoInputError(
                "group_ids",
                f"expected one id per sequence ({batch}), got {got}.",
                "Pass one group (prompt) id per sequence: a list or a 1-D integer tensor.",
            )

    @property
    def has_groups(self) -> bool:
        return self.group_ids is not None or self.n_samples_per_prompt is not None

    def group_index(self) -> tuple[torch.Tensor, int]:
        """``(index, num_groups)``: each sample's group as 0..num_groups-1 (long tensor on the mask's device)."""
        device, batch = self.response_mask.device, self.response_mask.shape[0]
        if self.n_samples_per_prompt is not None:
            n = self.n_samples_per_prompt
            return torch.arange(batch, device=device) // n, batch // n
        if self.group_ids is None:
            raise AlgoInputError(
                "group_ids",
                "this estimator compares samples of the same prompt but no groups were given.",
                "Pass n_samples_per_prompt=n or group_ids=[batch].",
            )
        if isinstance(self.group_ids, torch.Tensor):
            uniq, index = torch.unique(self.group_ids.to(device), return_inverse=True)
            return index, int(uniq.numel())
        ids: dict[Hashable, int] = {}
        index = torch.tensor([ids.setdefault(g, len(ids)) for g in self.group_ids], dtype=torch.long, device=device)
        return index, len(ids)

    def dense_rewards(self) -> torch.Tensor:
        """``token_rewards`` (0 at masked positions), or zeros; float32 or wider."""
        mask = self.response_mask
        if self.token_rewards is None:
            return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        r = self.token_rewards
        return torch.where(mask, r.to(torch.promote_types(r.dtype, torch.float32)), 0.0)

    def rewards_per_token(self, scores: torch.Tensor | None = None) -> torch.Tensor:
        """``token_rewards`` plus ``scores`` (default: ``self.scores``) on each response's last valid token."""
        scores = self.scores if scores is None else scores
        dense = self.dense_rewards()
        if scores is None:
            return dense
        outcome = scores_to_token_rewards(scores, self.response_mask)
        dtype = torch.promote_types(dense.dtype, outcome.dtype)
        return dense.to(dtype) + outcome.to(dtype)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: call it with :class:`AdvantageInputs` to get ``(advantages, returns)``."""

    name: str
    fn: EstimatorFn
    requires: tuple[str, ...] = ()  # of "scores", "values", "groups"
    aliases: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """The first line of the estimator function's docstring (what ``--help`` shows)."""
        return ((self.fn.__doc__ or "").strip().splitlines() or [self.name])[0].strip().replace("``", "")

    @property
    def needs_critic(self) -> bool:
        """It reads critic values: a run with it trains a critic."""
        return "values" in self.requires

    @property
    def needs_groups(self) -> bool:
        """It compares the samples of one prompt: a run needs several samples per prompt."""
        return "groups" in self.requires

    def __call__(self, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(inputs, AdvantageInputs):
            raise AlgoInputError(
                "inputs",
                f"expected AdvantageInputs, got {type(inputs).__name__}.",
                "Wrap the tensors: AdvantageInputs(response_mask=..., scores=..., ...).",
            )
        for need in self.requires:
            missing = not inputs.has_groups if need == "groups" else getattr(inputs, need) is None
            if missing:
                field = "group_ids" if need == "groups" else need
                raise AlgoInputError(
                    field,
                    f"the {self.name!r} estimator needs {_NEEDS[need]}, but none were given.",
                    f"Pass AdvantageInputs({_FIX[need]}).",
                )
        with torch.no_grad():
            advantages, returns = self.fn(inputs)
        for name, x in (("advantages", advantages), ("returns", returns)):
            if not isinstance(x, torch.Tensor) or x.shape != inputs.response_mask.shape:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise AlgoInputError(
                    name,
                    f"estimator {self.name!r} returned {got}, expected {tuple(inputs.response_mask.shape)}.",
                    "Fix the registered estimator.",
                )
        return advantages, returns


_NEEDS = {"scores": "per-sequence scores", "values": "critic values", "groups": "prompt groups"}
_FIX = {
    "scores": "scores=<[batch] outcome rewards>",
    "values": "values=<[batch, len] critic values>",
    "groups": "n_samples_per_prompt=n or group_ids=<[batch] prompt ids>",
}


def _same_definition(a: Callable[..., object], b: Callable[..., object]) -> bool:
    """``a`` and ``b`` are one function of one file (its module imported twice, under two names)."""
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (
        code_a is not None
        and code_b is not None
        and a.__qualname__ == b.__qualname__
        and os.path.abspath(code_a.co_filename) == os.path.abspath(code_b.co_filename)
    )


_REGISTRY: dict[str, AdvantageEstimator] = {}
_ALIASES: dict[str, str] = {}


def register_advantage_estimator(
    name: str, *, aliases: Sequence[str] = (), requires: Sequence[str] = (), replace: bool = False
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: register ``fn(inputs: AdvantageInputs) -> (advantages, returns)`` under ``name`` (and aliases).

    ``requires`` lists what the estimator cannot run without (``"scores"``, ``"values"``, ``"groups"``); a missing
    one is reported by name before ``fn`` runs. ``fn`` runs under ``torch.no_grad()``. Registering a taken name
    raises unless ``replace=True``. The function is returned unchanged.
    """
    unknown = set(requires) - set(_NEEDS)
    if unknown:
        raise AlgoInputError("requires", f"unknown requirement(s) {sorted(unknown)}.", f"Use some of {sorted(_NEEDS)}.")
    names = [name, *aliases]
    for n in names:
        if not isinstance(n, str) or not n:
            raise AlgoInputError("name", f"estimator names must be non-empty strings, got {n!r}.")

    def decorate(fn: EstimatorFn) -> EstimatorFn:
        taken = [n for n in names if n in _REGISTRY or n in _ALIASES]
        # The same function of the same file imported again (one file named by --plugins and --agent_func_path) is
        # no clash: the newer one takes its place.
        entries = [_REGISTRY.get(_ALIASES.get(n, n)) for n in taken]
        again = all(e is not None and _same_definition(e.fn, fn) for e in entries)
        if taken and not replace and not again:
            raise AlgoInputError(
                "name",
                f"advantage estimator name(s) {taken} are already registered.",
                "Pick another name, or pass replace=True to override.",
            )
        for n in taken:
            _REGISTRY.pop(n, None)
            _ALIASES.pop(n, None)
        _REGISTRY[name] = AdvantageEstimator(name, fn, tuple(requires), tuple(aliases))
        for alias in aliases:
            _ALIASES[alias] = name
        return fn

    return decorate


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name`` or one of its aliases; unknown names list the known ones."""
    canonical = _ALIASES.get(name, name)
    if canonical not in _REGISTRY:
        raise AlgoInputError(
            "advantage_estimator",
            f"unknown estimator {name!r}.",
            f"Choose one of: {', '.join(list_advantage_estimators())}.",
        )
    return _REGISTRY[canonical]


def list_advantage_estimators(include_aliases: bool = True) -> list[str]:
    """Sorted names accepted by :func:`get_advantage_estimator` (canonical names only if not ``include_aliases``)."""
    names = set(_REGISTRY) | (set(_ALIASES) if include_aliases else set())
    return sorted(names)


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_advantage_estimator(name)(inputs)``: ``(advantages, returns)``, each ``[batch, response_len]``."""
    return get_advantage_estimator(name)(inputs)


# ---- built-in estimators --------------------------------------------------------------------------------------


def _group_mean_std(scores: torch.Tensor, index: torch.Tensor, groups: int) -> tuple[torch.Tensor, ...]:
    """Per-sample group mean, unbiased group std (0 for groups of one) and group size.

    A group whose samples all scored the same gets its score back as the mean *exactly*: the float sum of 16 x 0.7
    is not 16 x 0.7, and ``score - mean`` would otherwise leave a rounding residue that GRPO's ``/ (std + eps)``
    turns into an advantage of ~0.1 for a group that carries no signal.
    """
    dtype = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(dtype)
    count = torch.zeros(groups, dtype=dtype, device=s.device).index_add_(0, index, torch.ones_like(s))
    mean = torch.zeros(groups, dtype=dtype, device=s.device).index_add_(0, index, s) / count
    low = torch.zeros(groups, dtype=dtype, device=s.device).scatter_reduce_(0, index, s, "amin", include_self=False)
    high = torch.zeros(groups, dtype=dtype, device=s.device).scatter_reduce_(0, index, s, "amax", include_self=False)
    mean = torch.where(low == high, high, mean)
    sq = torch.zeros(groups, dtype=dtype, device=s.device).index_add_(0, index, (s - mean[index]).square())
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 0.0)
    return mean[index], std[index], count[index]


def _broadcast_outcome(inputs: AdvantageInputs, shaped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shaped score on every valid token plus the reward-to-go of the dense per-token rewards."""
    mask = inputs.response_mask
    dense = inputs.dense_rewards()
    dtype = torch.promote_types(dense.dtype, shaped.dtype)
    advantages = torch.where(mask, shaped.to(dtype)[:, None], 0.0)
    if inputs.token_rewards is not None:
        advantages = advantages + discounted_returns(dense, mask, inputs.gamma).to(dtype)
    return advantages, advantages.clone()


@register_advantage_estimator("gae", requires=("values",))
def gae_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE with a critic; returns (the critic's targets) are the un-whitened ``A + V``."""
    advantages, returns = generalized_advantages(
        inputs.rewards_per_token(), inputs.values, inputs.response_mask, inputs.gamma, inputs.lam
    )
    return masked_whiten(advantages, inputs.response_mask), returns


@register_advantage_estimator("reinforce_plus_plus", aliases=("reinforce",))
def reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over the batch's valid tokens."""
    returns = discounted_returns(inputs.rewards_per_token(), inputs.response_mask, inputs.gamma)
    return masked_whiten(returns, inputs.response_mask), returns


@register_advantage_estimator(
    "reinforce_plus_plus_baseline", aliases=("reinforce_baseline",), requires=("scores", "groups")
)
def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: score minus its prompt's mean score, then REINFORCE++."""
    mean, _, _ = _group_mean_std(inputs.scores, *inputs.group_index())
    returns = discounted_returns(inputs.rewards_per_token(inputs.scores - mean), inputs.response_mask, inputs.gamma)
    return masked_whiten(returns, inputs.response_mask), returns


@register_advantage_estimator("grpo", aliases=("group_norm",), requires=("scores", "groups"))
def grpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(score - group mean) / (group std + eps)``."""
    mean, std, _ = _group_mean_std(inputs.scores, *inputs.group_index())
    return _broadcast_outcome(inputs, (inputs.scores - mean) / (std + inputs.eps))


@register_advantage_estimator("dr_grpo", requires=("scores", "groups"))
def dr_grpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: ``score - group mean`` (pair with the ``seq-mean-token-sum-norm`` loss aggregation)."""
    mean, _, _ = _group_mean_std(inputs.scores, *inputs.group_index())
    return _broadcast_outcome(inputs, inputs.scores - mean)


@register_advantage_estimator("rloo", requires=("scores", "groups"))
def rloo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``score - mean of the other samples of the prompt`` = ``n / (n - 1) * (score - group mean)``."""
    mean, _, count = _group_mean_std(inputs.scores, *inputs.group_index())
    if bool((count < 2).any()):
        raise AlgoInputError(
            "group_ids",
            "rloo needs at least 2 samples per prompt (a leave-one-out baseline), but some groups have 1.",
            "Generate n_samples_per_prompt >= 2.",
        )
    return _broadcast_outcome(inputs, (inputs.scores - mean) * count / (count - 1))
