"""Per-token quantities from logits: the policy's entropy and the log-probability of the chosen tokens.

Both run in float32 (or wider) whatever the logits' dtype, since bf16 log-softmax loses the small probabilities
that entropy and PPO ratios depend on. Entropy bonuses are used to slow entropy collapse (e.g. in PPO; DAPO's
analysis, Yu et al. 2025, motivates clip-higher instead); add ``-coef * aggregate_loss(entropy, mask)`` to the loss.
"""

from __future__ import annotations

import torch

from . import _checks
from .errors import AlgoInputError


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` of ``softmax(logits)`` at every position: ``[..., vocab] -> [...]``.

    Differentiable. With ``mask`` (the shape of ``logits[..., 0]``), masked positions are exactly 0. Divide the
    logits by the sampling temperature first if the entropy of the sampling distribution is wanted.
    """
    logits = _checks.tensor("logits", logits, floating=True)
    if logits.dim() < 1:
        raise AlgoInputError("logits", "expected [..., vocab] logits, got a scalar.")
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = None
    if mask is not None:
        valid = _check_positions_mask(mask, x)
        x = torch.where(valid[..., None], x, 0.0)  # padding logits never reach softmax (no NaN in grads)
    log_p = torch.log_softmax(x, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return entropy if valid is None else torch.where(valid, entropy, 0.0)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[token]`` for each position: ``[..., vocab]`` and ``[...]`` -> ``[...]``.

    Uses ``logit[token] - logsumexp(logits)`` so the full log-softmax is never materialised. Align them first:
    the logits at position ``t`` predict token ``t + 1`` (``logits[:, :-1]`` with ``tokens[:, 1:]``).
    """
    logits = _checks.tensor("logits", logits, floating=True)
    tokens = _checks.tensor("tokens", tokens)
    if tokens.shape != logits.shape[:-1] or tokens.is_floating_point():
        raise AlgoInputError(
            "tokens",
            f"expected integer ids of shape {tuple(logits.shape[:-1])}, got {tokens.dtype} {tuple(tokens.shape)}.",
            "Pass the token ids aligned with the logits' positions.",
        )
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    chosen = x.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(x, dim=-1)


def _check_positions_mask(mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    mask = _checks.tensor("mask", mask)
    if mask.shape != logits.shape[:-1]:
        raise AlgoInputError(
            "mask",
            f"shape {tuple(mask.shape)} does not match the logits' positions {tuple(logits.shape[:-1])}.",
            "Pass one mask entry per position.",
        )
    return mask if mask.dtype == torch.bool else mask != 0
