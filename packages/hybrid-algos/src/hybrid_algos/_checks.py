"""Input checks shared by the math: shapes, dtypes and devices (free), values (one host sync per call).

Shape/dtype/device checks cost nothing and always run. Value checks (NaN/inf at valid positions, masks that are not
0/1) need one device-to-host sync per call; they are on by default and can be turned off for a hot loop that is
known to be clean with :func:`set_value_checks`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import AlgoInputError

_VALUE_CHECKS = True


def set_value_checks(enabled: bool) -> bool:
    """Turn the value checks (NaN/inf, 0/1 masks) on or off process-wide; returns the previous setting."""
    global _VALUE_CHECKS
    previous, _VALUE_CHECKS = _VALUE_CHECKS, bool(enabled)
    return previous


def tensor(name: str, x: object, *, ndim: int | None = None, floating: bool = False) -> torch.Tensor:
    """``x`` must be a tensor (of ``ndim`` dimensions, floating point if asked)."""
    if not isinstance(x, torch.Tensor):
        raise AlgoInputError(name, f"expected a torch.Tensor, got {type(x).__name__}.", "Pass a tensor.")
    if ndim is not None and x.dim() != ndim:
        raise AlgoInputError(name, f"expected a {ndim}-D tensor, got shape {tuple(x.shape)}.", _shape_hint(ndim))
    if floating and not x.is_floating_point():
        raise AlgoInputError(
            name, f"expected a floating-point tensor, got dtype {x.dtype}.", f"Cast it, e.g. {name}.float()."
        )
    return x


def same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.shape != ref.shape:
        raise AlgoInputError(
            name,
            f"shape {tuple(x.shape)} does not match {ref_name} {tuple(ref.shape)}.",
            f"Pass {name} with the same shape as {ref_name} ([batch, response_len]).",
        )
    if x.device != ref.device:
        raise AlgoInputError(
            name,
            f"is on {x.device} but {ref_name} is on {ref.device}.",
            f"Move both to one device, e.g. {name}.to({ref_name}.device).",
        )


def mask(name: str, m: object, *, like: torch.Tensor | None = None, like_name: str = "") -> torch.Tensor:
    """A 2-D mask (bool, or integer/float holding 0/1) returned as bool. Non-zero means "valid token"."""
    t = tensor(name, m, ndim=2)
    if t.is_complex():
        raise AlgoInputError(name, f"a mask cannot be complex ({t.dtype}).", "Pass a bool or 0/1 integer tensor.")
    if like is not None:
        same_shape(name, t, like_name, like)
    if t.dtype == torch.bool:
        return t
    return t != 0


def finite(
    checks: Sequence[tuple[str, torch.Tensor, torch.Tensor | None]], masks: Sequence[tuple[str, torch.Tensor]] = ()
) -> None:
    """Raise if any tensor has NaN/inf where its mask is valid, or any mask holds values other than 0/1.

    All flags are gathered into one small tensor so the whole check costs a single host sync.
    """
    if not _VALUE_CHECKS or (not checks and not masks):
        return
    flags = []
    for _, x, valid in checks:
        bad = ~torch.isfinite(x)
        if valid is not None:
            bad = bad & valid
        flags.append(bad.sum())
    for _, m in masks:
        flags.append(
            ((m != 0) & (m != 1)).sum() if m.dtype != torch.bool else torch.zeros((), device=m.device, dtype=torch.long)
        )
    counts = torch.stack([f.to(device=flags[0].device, dtype=torch.long) for f in flags]).tolist()
    for (name, _, valid), n in zip(checks, counts):
        if n:
            where = "at valid (mask=1) positions" if valid is not None else "entries"
            raise AlgoInputError(
                name,
                f"has {n} NaN/inf {where}.",
                "Find where it is produced (a reward function returning NaN, an fp16 overflow) "
                "and fix or filter those samples before computing advantages or losses.",
            )
    for (name, _), n in zip(masks, counts[len(checks) :]):
        if n:
            raise AlgoInputError(
                name,
                f"has {n} entries that are neither 0 nor 1.",
                "A mask marks valid response tokens: pass a bool tensor or 0/1 values.",
            )


def positive_float(name: str, value: float, *, allow_zero: bool = False) -> float:
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not ok or value != value or value == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise AlgoInputError(name, f"must be a finite number {bound}, got {value}.")
    return value


def unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise AlgoInputError(name, f"must be in [0, 1], got {value}.")
    return value


def _shape_hint(ndim: int) -> str:
    return {
        1: "Pass one value per sequence: shape [batch].",
        2: "Pass per-token values: shape [batch, response_len].",
        3: "Pass logits: shape [batch, response_len, vocab].",
    }.get(ndim, f"Pass a {ndim}-D tensor.")
