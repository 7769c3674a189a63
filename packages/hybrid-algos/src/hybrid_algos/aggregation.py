"""Reduce a per-token loss ``[batch, len]`` to a scalar over valid tokens; the choice changes what is optimised.

Modes (``l`` = per-token loss, ``m`` = mask, ``L_i = sum_t m_it`` = length of response i, sums over valid tokens):

- ``token-mean``: ``sum_it l_it / sum_i L_i`` -- every token weighs the same (DAPO, Yu et al. 2025,
  arXiv:2503.14476; OpenRLHF's and verl's default).
- ``seq-mean-token-mean``: ``mean_i (sum_t l_it / L_i)`` -- every response weighs the same, so tokens of short
  responses weigh more (the original GRPO objective, Shao et al. 2024).
- ``seq-mean-token-sum``: ``mean_i sum_t l_it`` -- per-response sums; the scale grows with length.
- ``seq-mean-token-sum-norm``: ``mean_i sum_t l_it / norm_len`` -- Dr. GRPO (Liu et al. 2025, arXiv:2503.20783):
  a *constant* normaliser instead of each response's own length, which removes GRPO's length bias. Pass
  ``norm_len`` = the max generation length; it defaults to the padded width ``len``, which varies between
  micro-batches unless responses are padded to a fixed length.

``mean_i`` is over responses with at least one valid token (all-padding rows are ignored). Masked positions are
excluded exactly (``torch.where``, so NaN/inf padding cannot leak in). With all responses of length ``L``:
token-mean = seq-mean-token-mean = seq-mean-token-sum / L, and seq-mean-token-sum-norm = token-mean when
``norm_len == L``.

The reduction is over the tensor given. With gradient accumulation over micro-batches, ``token-mean`` is the mean
of per-micro-batch means, not of all tokens of the mini-batch (the same holds in most frameworks).
"""

from __future__ import annotations

import torch

from . import _checks
from .errors import AlgoInputError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def check_agg_mode(mode: str) -> str:
    if mode not in LOSS_AGG_MODES:
        raise AlgoInputError(
            "loss_agg_mode", f"unknown aggregation mode {mode!r}.", f"Choose one of: {', '.join(LOSS_AGG_MODES)}."
        )
    return mode


def aggregate_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm_len: float | None = None
) -> torch.Tensor:
    """A scalar from the per-token ``loss`` ``[batch, len]`` over valid tokens of ``mask``; 0 if none is valid."""
    check_agg_mode(mode)
    loss = _checks.tensor("loss", loss, ndim=2, floating=True)
    valid = _checks.mask("mask", mask, like=loss, like_name="loss")
    masked = torch.where(valid, loss, 0.0)
    if mode == "token-mean":
        return masked.sum() / valid.sum().clamp(min=1)
    lengths = valid.sum(dim=-1)
    has_tokens = lengths > 0
    seq_sum = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / lengths.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        norm = loss.shape[-1] if norm_len is None else _checks.positive_float("norm_len", norm_len)
        per_seq = seq_sum / norm
    return torch.where(has_tokens, per_seq, 0.0).sum() / has_tokens.sum().clamp(min=1)
