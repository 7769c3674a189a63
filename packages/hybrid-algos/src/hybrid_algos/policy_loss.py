"""Policy losses behind a small registry, all called the same way (:func:`compute_policy_loss`).

A registered loss turns :class:`PolicyLossInputs` into a *per-token* loss ``[batch, len]`` plus statistics; the
registry then multiplies in the rollout-correction weights (:mod:`hybrid_algos.mismatch`), if any, and aggregates
over valid tokens with the chosen mode (:mod:`hybrid_algos.aggregation`; each loss names its default mode).
Per valid token, with ``ratio = exp(logprobs - old_logprobs)`` and advantage ``A``:

- ``ppo`` -- PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms")::

      loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))

  Asymmetric clip (DAPO's clip-higher, Yu et al. 2025, arXiv:2503.14476): ``clip_high > clip_low`` leaves more room
  to raise unlikely tokens, against entropy collapse. Dual clip (Ye et al. 2020, arXiv:1912.09729): for ``A < 0``
  the loss grows without bound with the ratio; ``dual_clip = c > 1`` caps it at ``-A * c``.
- ``gspo`` -- GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): one ratio per
  sequence, the geometric mean ``s = exp(mean_t log ratio_t)``, clipped like PPO's. Written per token as
  ``s_t = sg(s) * pi(y_t) / sg(pi(y_t))`` (the paper's GSPO-token form: value ``s``, gradient ``s * grad log pi``),
  so it aggregates like any other loss; the default ``seq-mean-token-mean`` is the paper's objective.
- ``cispo`` -- CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585): ``-sg(clip(ratio, 1 - clip_low,
  1 + clip_high)) * A * log pi``. The ratio is clipped as a *weight* under a stop-gradient, so clipped tokens
  still get a gradient (PPO's clip zeroes theirs). ``clip_low = 1`` means no lower bound, as in the paper.
- ``dr_grpo`` -- PPO's clipped surrogate aggregated with Dr. GRPO's constant normaliser (Liu et al. 2025,
  arXiv:2503.20783): ``seq-mean-token-sum-norm`` with ``norm_len`` = the longest generation, instead of each
  response's own length. Pair it with the ``dr_grpo`` advantage estimator.

The ratio is formed in log space and the log-ratio clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before the
``exp`` (an fp overflow guard; such tokens are clipped anyway). Masked positions are zeroed *before* the ``exp`` so
padding can carry anything (even NaN) without touching the loss or its gradient.

Add a loss with :func:`register_policy_loss`::

    @register_policy_loss("my_loss", uses=("clip",))
    def my_loss(inputs: PolicyLossInputs):
        \"\"\"One line for ``hybrid grpo --help``.\"\"\"
        per_token = -inputs.advantages * inputs.ratio().clamp(max=1 + inputs.clip_high)
        return per_token, {}

in a file a training run names with ``--plugins FILE.py``: the policy worker, another process, imports it too
(:mod:`hybrid_algos.train.plugins`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import _checks
from .aggregation import LOSS_AGG_MODES, aggregate_loss, check_agg_mode
from .errors import AlgoInputError

LossFn = Callable[["PolicyLossInputs"], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
#: Settings a loss may read; a loss that does not list one refuses it when it is set (nothing silently ignored).
LOSS_SETTINGS = ("clip", "dual_clip")


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a registered loss gets: checked, float32 (or wider) tensors with masked positions set to 0.

    ``logprobs`` carries the gradient; ``old_logprobs`` and ``advantages`` are detached. ``mask`` is bool.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    log_ratio_clamp: float = 20.0

    def log_ratio(self) -> torch.Tensor:
        """``logprobs - old_logprobs`` per token, clamped (0 at masked positions)."""
        return (self.logprobs - self.old_logprobs).clamp(-self.log_ratio_clamp, self.log_ratio_clamp)

    def ratio(self) -> torch.Tensor:
        return torch.exp(self.log_ratio())

    def valid_fraction(self, flags: torch.Tensor) -> torch.Tensor:
        """The fraction of valid tokens where ``flags`` holds (0 when there is none)."""
        return (flags & self.mask).sum() / self.mask.sum().clamp(min=1)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: call :func:`compute_policy_loss` with its name (or an alias)."""

    name: str
    fn: LossFn
    agg_mode: str = "token-mean"  # the aggregation used when the caller does not choose one
    uses: tuple[str, ...] = ("clip",)  # of LOSS_SETTINGS
    aliases: tuple[str, ...] = ()
    #: ``(clip_low, clip_high)`` when the user sets none, and where it comes from (the loss's paper)
    default_clip: tuple[float, float] = (0.2, 0.2)
    default_clip_source: str = "PPO's 0.2"

    @property
    def summary(self) -> str:
        """The first line of the loss function's docstring (what ``--help`` shows)."""
        return ((self.fn.__doc__ or "").strip().splitlines() or [self.name])[0].strip().replace("``", "")


def _same_definition(a: Callable[..., object], b: Callable[..., object]) -> bool:
    """``a`` and ``b`` are one function of one file (its module imported twice, under two names)."""
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return (
        code_a is not None
        and code_b is not None
        and a.__qualname__ == b.__qualname__
        and os.path.abspath(code_a.co_filename) == os.path.abspath(code_b.co_filename)
    )


_REGISTRY: dict[str, PolicyLoss] = {}
_ALIASES: dict[str, str] = {}


def register_policy_loss(
    name: str,
    *,
    aliases: Sequence[str] = (),
    agg_mode: str = "token-mean",
    uses: Sequence[str] = ("clip",),
    replace: bool = False,
    default_clip: tuple[float, float] = (0.2, 0.2),
    default_clip_source: str = "PPO's 0.2",
) -> Callable[[LossFn], LossFn]:
    """Decorator: register ``fn(inputs: PolicyLossInputs) -> (per_token_loss, stats)`` under ``name``.

    ``agg_mode`` is the loss's default aggregation; ``uses`` the settings it reads (``"clip"``: ``clip_low`` /
    ``clip_high``; ``"dual_clip"``): setting one it does not read is an error, not a silent no-op. The first line
    of ``fn``'s docstring is its one-line description. ``default_clip`` is ``(clip_low, clip_high)`` where the
    user sets no clip (a loss whose paper clips on another scale than PPO's 0.2 says so here, with its source).
    Registering a taken name raises unless ``replace=True``.
    """
    check_agg_mode(agg_mode)
    unknown = set(uses) - set(LOSS_SETTINGS)
    if unknown:
        raise AlgoInputError("uses", f"unknown setting(s) {sorted(unknown)}.", f"Use some of {list(LOSS_SETTINGS)}.")
    names = [name, *aliases]
    for n in names:
        if not isinstance(n, str) or not n:
            raise AlgoInputError("name", f"policy loss names must be non-empty strings, got {n!r}.")

    def decorate(fn: LossFn) -> LossFn:
        taken = [n for n in names if n in _REGISTRY or n in _ALIASES]
        # The same function of the same file imported again (one file named by --plugins and --agent_func_path) is
        # no clash: the newer one takes its place.
        entries = [_REGISTRY.get(_ALIASES.get(n, n)) for n in taken]
        again = all(e is not None and _same_definition(e.fn, fn) for e in entries)
        if taken and not replace and not again:
            raise AlgoInputError(
                "name",
                f"policy loss name(s) {taken} are already registered.",
                "Pick another name, or pass replace=True to override.",
            )
        for n in taken:
            _REGISTRY.pop(n, None)
            _ALIASES.pop(n, None)
        _REGISTRY[name] = PolicyLoss(
            name,
            fn,
            agg_mode,
            tuple(uses),
            tuple(aliases),
            (float(default_clip[0]), float(default_clip[1])),
            default_clip_source,
        )
        for alias in aliases:
            _ALIASES[alias] = name
        return fn

    return decorate


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered under ``name`` or one of its aliases; unknown names list the known ones."""
    canonical = _ALIASES.get(name, name)
    if canonical not in _REGISTRY:
        raise AlgoInputError(
            "policy_loss_type", f"unknown policy loss {name!r}.", f"Choose one of: {', '.join(list_policy_losses())}."
        )
    return _REGISTRY[canonical]


def list_policy_losses(include_aliases: bool = True) -> list[str]:
    """Sorted names accepted by :func:`get_policy_loss` (canonical names only if not ``include_aliases``)."""
    return sorted(set(_REGISTRY) | (set(_ALIASES) if include_aliases else set()))


def _check_clip(
    clip_low: float, clip_high: float, dual_clip: float | None, *, low_max: float = 1.0, low_inclusive: bool = False
) -> None:
    ok_low = 0.0 <= clip_low <= low_max if low_inclusive else 0.0 <= clip_low < low_max
    if not ok_low:
        bound = "]" if low_inclusive else ")"
        raise AlgoInputError("clip_low", f"must be in [0, {low_max:g}{bound}, got {clip_low}.", "Typical: 0.2.")
    if not clip_high >= 0.0:
        raise AlgoInputError("clip_high", f"must be >= 0, got {clip_high}.", "Typical: 0.2, or 0.28 for clip-higher.")
    if dual_clip is not None and not dual_clip > 1.0:
        raise AlgoInputError(
            "dual_clip",
            f"must be > 1 (it caps the loss at -A * dual_clip), got {dual_clip}.",
            "Typical: 3.0, or None to turn it off.",
        )


def compute_policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg_mode: str | None = None,
    norm_len: float | None = None,
    is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss ``name`` aggregated over valid tokens -> ``(loss, stats)``; gradients flow through ``logprobs``.

    Shapes ``[batch, len]``. ``agg_mode`` defaults to the loss's own, and so does the clip range when neither
    ``clip_low`` nor ``clip_high`` is given (PPO's 0.2; GSPO's paper 3e-4 / 4e-4; see :func:`register_policy_loss`);
    ``clip_high`` alone keeps the default low bound, ``clip_low`` alone is symmetric.
    ``is_weights``: per-token weights (e.g. :func:`hybrid_algos.rollout_correction`'s), detached and multiplied
    into the per-token loss before aggregation; a weight of 0 removes a token's contribution but not its place in
    the denominator. ``stats`` holds detached scalars over valid tokens: the loss's own (``clip_frac``, ...) plus
    ``approx_kl`` (k3 estimate of KL(old || new)), ``ratio_mean`` and ``ratio_max`` of the token ratios.
    """
    loss_def = get_policy_loss(name)
    if clip_low is None:
        clip_low = loss_def.default_clip[0]
        clip_high = loss_def.default_clip[1] if clip_high is None else clip_high
    clip_high = clip_low if clip_high is None else clip_high
    if dual_clip is not None and "dual_clip" not in loss_def.uses:
        raise AlgoInputError(
            "dual_clip",
            f"the {loss_def.name!r} policy loss has no dual clip.",
            "Leave dual_clip unset, or use the 'ppo' loss.",
        )
    _check_clip(clip_low, clip_high, dual_clip, low_inclusive=loss_def.name == "cispo")
    agg_mode = check_agg_mode(loss_def.agg_mode if agg_mode is None else agg_mode)
    _checks.positive_float("log_ratio_clamp", log_ratio_clamp)
    logprobs = _checks.tensor("logprobs", logprobs, ndim=2, floating=True)
    for arg, x in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        _checks.same_shape(arg, _checks.tensor(arg, x, ndim=2, floating=True), "logprobs", logprobs)
    valid = _checks.mask("mask", mask, like=logprobs, like_name="logprobs")
    value_checks = [
        ("logprobs", logprobs, valid),
        ("old_logprobs", old_logprobs, valid),
        ("advantages", advantages, valid),
    ]
    if is_weights is not None:
        _checks.same_shape(
            "is_weights", _checks.tensor("is_weights", is_weights, ndim=2, floating=True), "logprobs", logprobs
        )
        value_checks.append(("is_weights", is_weights, valid))
    _checks.finite(value_checks, masks=[("mask", mask)])

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    inputs = PolicyLossInputs(
        logprobs=torch.where(valid, logprobs.to(dtype), 0.0),
        old_logprobs=torch.where(valid, old_logprobs.detach().to(dtype), 0.0),
        advantages=torch.where(valid, advantages.detach().to(dtype), 0.0),
        mask=valid,
        clip_low=float(clip_low),
        clip_high=float(clip_high),
        dual_clip=dual_clip,
        log_ratio_clamp=float(log_ratio_clamp),
    )
    per_token, stats = loss_def.fn(inputs)
    if not isinstance(per_token, torch.Tensor) or per_token.shape != logprobs.shape:
        got = tuple(per_token.shape) if isinstance(per_token, torch.Tensor) else type(per_token).__name__
        raise AlgoInputError(
            "per_token_loss",
            f"policy loss {loss_def.name!r} returned {got}, expected {tuple(logprobs.shape)}.",
            "Fix the registered loss.",
        )
    if is_weights is not None:
        per_token = per_token * torch.where(valid, is_weights.detach().to(per_token.dtype), 0.0)
    loss = aggregate_loss(per_token, valid, agg_mode, norm_len)

    with torch.no_grad():
        log_ratio = inputs.log_ratio().detach()
        r = torch.exp(log_ratio)
        n = valid.sum().clamp(min=1)
        stats = {
            **{k: v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for k, v in stats.items()},
            "approx_kl": torch.where(valid, (r - 1) - log_ratio, 0.0).sum() / n,
            "ratio_mean": torch.where(valid, r, 0.0).sum() / n,
            "ratio_max": torch.where(valid, r, 0.0).amax() if r.numel() else r.new_zeros(()),
        }
    return loss, stats


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
    log_ratio_clamp: float = 20.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, aggregated with ``agg_mode``: ``compute_policy_loss("ppo", ...)``.

    Returns ``(loss, stats)``; ``stats`` holds detached scalars over valid tokens: ``clip_frac`` (tokens where
    clipping is active), ``dual_clip_frac``, ``approx_kl`` (k3 estimate of KL(old || new)) and ``ratio_mean``,
    ``ratio_max``.
    """
    return compute_policy_loss(
        "ppo",
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        agg_mode=agg_mode,
        norm_len=norm_len,
        is_weights=is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )


# ---- built-in losses --------------------------------------------------------------------------------------------


def _clipped_surrogate(
    adv: torch.Tensor, ratio: torch.Tensor, inputs: PolicyLossInputs
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - inputs.clip_low, 1.0 + inputs.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(inputs.mask)
    if inputs.dual_clip is not None:
        cap = -adv * inputs.dual_clip
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_active, cap, per_token)
    with torch.no_grad():
        stats = {
            "clip_frac": inputs.valid_fraction(clipped > unclipped),
            "dual_clip_frac": inputs.valid_fraction(dual_active),
        }
    return per_token, stats


@register_policy_loss("ppo", aliases=("ppo_clip",), uses=("clip", "dual_clip"))
def ppo_clip_loss(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (asymmetric clip-higher, optional dual clip)."""
    return _clipped_surrogate(inputs.advantages, inputs.ratio(), inputs)


@register_policy_loss("dr_grpo", agg_mode="seq-mean-token-sum-norm", uses=("clip", "dual_clip"))
def dr_grpo_loss(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with Dr. GRPO's constant normaliser (seq-mean-token-sum-norm, norm_len = max length)."""
    return _clipped_surrogate(inputs.advantages, inputs.ratio(), inputs)


# GSPO clips a sequence-level ratio (a geometric mean of token ratios), which stays far closer to 1 than token
# ratios: its paper's clip range is (3e-4, 4e-4), not PPO's 0.2 (which would almost never clip).
@register_policy_loss(
    "gspo",
    agg_mode="seq-mean-token-mean",
    default_clip=(3e-4, 4e-4),
    default_clip_source="GSPO's paper (Zheng et al. 2025, arXiv:2507.18071): 3e-4 / 4e-4",
)
def gspo_loss(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: one clipped ratio per sequence, the geometric mean of its token ratios."""
    mask = inputs.mask
    lengths = mask.sum(-1, keepdim=True)
    seq_log_ratio = (inputs.logprobs - inputs.old_logprobs).sum(-1, keepdim=True) / lengths.clamp(min=1)
    seq_log_ratio = seq_log_ratio.clamp(-inputs.log_ratio_clamp, inputs.log_ratio_clamp)
    # Value exp(seq_log_ratio) on every token; gradient seq_ratio * grad log pi(y_t) (GSPO-token with equal A).
    token_log_ratio = seq_log_ratio.detach() + inputs.logprobs - inputs.logprobs.detach()
    ratio = torch.where(mask, torch.exp(token_log_ratio), 1.0)
    return _clipped_surrogate(inputs.advantages, ratio, inputs)


# CISPO clips the importance weight from above only: its paper sets no lower bound (clip_low = 1, a weight floor of
# 0) and tunes the upper one without giving a value; 0.28 is DAPO's clip-higher, the usual choice in its ports.
@register_policy_loss(
    "cispo",
    default_clip=(1.0, 0.28),
    default_clip_source="CISPO's paper (MiniMax-M1, arXiv:2506.13585): no lower bound; upper 0.28",
)
def cispo_loss(inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: the clipped ratio as a stop-gradient weight on A * log pi (clipped tokens keep their gradient)."""
    ratio = inputs.ratio().detach()
    weight = ratio.clamp(1.0 - inputs.clip_low, 1.0 + inputs.clip_high)
    per_token = -weight * inputs.advantages * inputs.logprobs
    with torch.no_grad():
        stats = {"clip_frac": inputs.valid_fraction(weight != ratio)}
    return per_token, stats


__all__ = [
    "LOSS_AGG_MODES",
    "PolicyLoss",
    "PolicyLossInputs",
    "compute_policy_loss",
    "get_policy_loss",
    "list_policy_losses",
    "ppo_policy_loss",
    "register_policy_loss",
]
