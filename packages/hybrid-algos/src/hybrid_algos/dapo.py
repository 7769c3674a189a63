"""DAPO's reward-side pieces (Yu et al. 2025, "DAPO", arXiv:2503.14476); clip-higher is the ``ppo`` loss's
``clip_high``.

- Dynamic sampling: a group (the samples of one prompt) whose rewards are all equal has advantage 0 for every
  group estimator -- it carries no signal and only dilutes the batch. :func:`informative_groups` marks the samples
  of groups worth keeping; the training loop then generates more prompts until the batch is full.
- Overlong reward shaping: :func:`overlong_penalty` is 0 up to ``max_len - buffer_len`` tokens, then falls
  linearly to ``-penalty_factor`` at ``max_len`` ("soft overlong punishment").
- Overlong filtering (truncated completions removed from the loss) needs only the engines' finish reasons; the
  loop does it with the response mask.
"""

from __future__ import annotations

import torch

from . import _checks
from ._no_grad import no_grad
from .errors import AlgoInputError


def _group_index(
    batch: int, n_samples_per_prompt: int | None, group_ids: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, int]:
    if (n_samples_per_prompt is None) == (group_ids is None):
        raise AlgoInputError(
            "group_ids",
            "pass exactly one of n_samples_per_prompt and group_ids.",
            "n_samples_per_prompt=n for consecutive blocks of n samples, group_ids otherwise.",
        )
    if n_samples_per_prompt is not None:
        n = n_samples_per_prompt
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or batch % n:
            raise AlgoInputError(
                "n_samples_per_prompt",
                f"must be a positive int dividing the batch ({batch}), got {n!r}.",
                "Pass the number of samples generated per prompt.",
            )
        return torch.arange(batch, device=device) // n, batch // n
    ids = _checks.tensor("group_ids", group_ids, ndim=1)
    if ids.shape[0] != batch or ids.is_floating_point():
        raise AlgoInputError(
            "group_ids",
            f"expected {batch} integer ids, got {ids.dtype} {tuple(ids.shape)}.",
            "Pass one integer prompt id per sample.",
        )
    uniq, index = torch.unique(ids.to(device), return_inverse=True)
    return index, int(uniq.numel())


@no_grad
def informative_groups(
    scores: torch.Tensor,
    *,
    n_samples_per_prompt: int | None = None,
    group_ids: torch.Tensor | None = None,
    reward_range: tuple[float, float] | None = None,
) -> torch.Tensor:
    """``[batch]`` bool: True for the samples of groups whose scores are not all equal.

    With ``reward_range = (low, high)`` a group must also have its mean score strictly inside it (OpenRLHF's
    ``--dynamic_filtering_reward_range``). A group of one sample is never informative.
    """
    scores = _checks.tensor("scores", scores, ndim=1)
    _checks.finite([("scores", scores, None)])
    if reward_range is not None and not reward_range[0] < reward_range[1]:
        raise AlgoInputError(
            "dynamic_filtering_reward_range",
            f"low must be below high, got {tuple(reward_range)}.",
            "E.g. (0, 1) for 0/1 rewards.",
        )
    index, groups = _group_index(scores.shape[0], n_samples_per_prompt, group_ids, scores.device)
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    low = torch.full((groups,), torch.inf, dtype=s.dtype, device=s.device).scatter_reduce(0, index, s, "amin")
    high = torch.full((groups,), -torch.inf, dtype=s.dtype, device=s.device).scatter_reduce(0, index, s, "amax")
    keep = high > low  # exact: a group whose scores are all equal gets exactly zero advantage
    if reward_range is not None:
        count = torch.zeros(groups, dtype=s.dtype, device=s.device).index_add_(0, index, torch.ones_like(s))
        mean = torch.zeros(groups, dtype=s.dtype, device=s.device).index_add_(0, index, s) / count
        keep = keep & (mean > reward_range[0]) & (mean < reward_range[1])
    return keep[index]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per response: ``-penalty_factor * clip(L - (max_len - buffer_len), 0,
    buffer_len) / buffer_len`` for ``L`` generated tokens (float32, ``[batch]``)."""
    lengths = _checks.tensor("lengths", lengths, ndim=1)
    if isinstance(max_len, bool) or int(max_len) != max_len or max_len < 1:
        raise AlgoInputError("generate_max_len", f"must be a positive integer, got {max_len!r}.")
    if isinstance(buffer_len, bool) or int(buffer_len) != buffer_len or not 1 <= buffer_len <= max_len:
        raise AlgoInputError(
            "overlong_buffer_len",
            f"must be an integer in [1, generate_max_len={max_len}], got {buffer_len!r}.",
            "E.g. a quarter of the generation length.",
        )
    factor = _checks.positive_float("overlong_penalty_factor", penalty_factor, allow_zero=True)
    excess = (lengths.float() - (max_len - buffer_len)).clamp(min=0, max=buffer_len)
    return -factor * excess / buffer_len
