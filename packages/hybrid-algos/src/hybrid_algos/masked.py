"""Statistics over valid tokens only.

Every helper takes ``values`` and a ``mask`` of the same shape (bool, or 0/1 numbers; non-zero = valid) and ignores
masked entries *exactly*: they are selected away with ``torch.where`` rather than multiplied by 0, so NaN/inf
padding cannot leak in (``nan * 0`` is ``nan``). With no valid entry, sums and means are 0 instead of NaN, so an
all-padding micro-batch contributes nothing rather than poisoning a step.
"""

from __future__ import annotations

import torch

from . import _checks
from .errors import AlgoInputError

Dim = int | tuple[int, ...] | None


def _valid(values: torch.Tensor, mask: torch.Tensor, floating: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _checks.tensor("values", values, floating=floating)
    _checks.tensor("mask", mask)
    if mask.shape != values.shape:
        raise AlgoInputError(
            "mask",
            f"shape {tuple(mask.shape)} does not match values {tuple(values.shape)}.",
            "Pass one mask entry per value.",
        )
    m = mask if mask.dtype == torch.bool else mask != 0
    return torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device)), m


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (over all entries, or along ``dim``)."""
    v, _ = _valid(values, mask)
    return v.sum() if dim is None else v.sum(dim=dim, keepdim=keepdim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """Mean of ``values`` over valid entries; 0 where there is none."""
    v, m = _valid(values, mask)
    if dim is None:
        total, count = v.sum(), m.sum()
    else:
        total, count = v.sum(dim=dim, keepdim=keepdim), m.sum(dim=dim, keepdim=keepdim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries (a scalar). ``unbiased`` divides by n - 1 (Bessel); 0 when n - ddof < 1."""
    v, m = _valid(values, mask, floating=True)
    count = m.sum().to(v.dtype)
    mean = v.sum() / count.clamp(min=1)
    centered = torch.where(m, v - mean, torch.zeros((), dtype=v.dtype, device=v.device))
    ddof = 1 if unbiased else 0
    return (centered.square().sum() / (count - ddof).clamp(min=1)) * (count - ddof > 0)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` over the valid entries; masked entries come out as 0.

    ``shift_mean=False`` adds the mean back (scale only), as used for value targets. Mean and variance are over the
    whole tensor given: to whiten over a data-parallel global batch, gather it first (or all-reduce the moments).
    """
    _checks.positive_float("eps", eps, allow_zero=True)
    v, m = _valid(values, mask, floating=True)
    mean = masked_mean(v, m)
    var = masked_var(v, m, unbiased=unbiased)
    # Equal values must whiten to exactly 0: their float mean is rarely exact (0.7 x 20 sums to 14.000001), and the
    # rounding left in ``v - mean`` would be scaled up by 1 / sqrt(eps). Detected exactly, as min == max.
    constant, value = _all_equal(v, m)
    mean = torch.where(constant, value, mean)
    var = torch.where(constant, torch.zeros_like(var), var)
    scale = var + eps
    out = (v - mean) * torch.where(scale > 0, torch.rsqrt(scale), 0.0)  # constant values -> 0, not NaN
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _all_equal(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether every valid entry holds the same value (False with no valid entry), and that value."""
    inf = torch.tensor(float("inf"), dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=values.device), torch.zeros_like(inf)
    low = torch.where(mask, values, inf).amin()
    high = torch.where(mask, values, -inf).amax()
    return low == high, torch.where(low == high, high, torch.zeros_like(high))


def last_valid_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a 2-D mask: the index of its last valid token, and whether the row has one at all."""
    m = mask if mask.dtype == torch.bool else mask != 0
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).amax(dim=-1)
    return last.clamp(min=0), last >= 0
