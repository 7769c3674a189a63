"""Shared test helpers for the math: hypothesis strategies and plain-Python reference implementations.

The references loop over Python floats on purpose: they share no code with hybrid_algos.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def masks(
    draw, max_batch: int = 6, max_len: int = 7, right_padded: bool = False, min_valid: int = 0, min_batch: int = 1
):
    """A bool mask [B, T]; right-padded rows have >= ``min_valid`` tokens, otherwise any pattern (holes allowed)."""
    batch = draw(st.integers(min_batch, max_batch))
    length = draw(st.integers(max(1, min_valid), max_len))
    rows = []
    for _ in range(batch):
        if right_padded:
            n = draw(st.integers(min_valid, length))
            rows.append([True] * n + [False] * (length - n))
        else:
            row = draw(st.lists(st.booleans(), min_size=length, max_size=length))
            for i in range(min_valid):
                row[i] = True
            rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def randn(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def garbage_under(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with every masked (False) entry replaced by junk: huge values, NaN and inf."""
    g = torch.Generator().manual_seed(seed)
    junk = torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype) * 1e6
    flat = junk.view(-1)
    if flat.numel() > 0:
        flat[0::3] = float("nan")
        flat[1::5] = float("inf")
    return torch.where(mask, x, junk)


def ref_rtg(rewards: list[float], gamma: float) -> list[float]:
    """Discounted reward-to-go of one (compacted) sequence."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def ref_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE of one (compacted) sequence; the value after the end is 0."""
    adv = [0.0] * len(rewards)
    last = 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def per_row(fn, x: torch.Tensor, mask: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """Apply a list->list reference to the valid entries of each row; 0 elsewhere."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        idx = [t for t in range(x.shape[1]) if mask[i, t]]
        res = fn([float(x[i, t]) for t in idx], *[[float(o[i, t]) for t in idx] for o in others])
        for t, v in zip(idx, res):
            out[i, t] = v
    return out


def ref_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    mean = sum(vals) / len(vals) if vals else 0.0
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[i, t]:
                out[i, t] = (float(x[i, t]) - mean) / math.sqrt(var + eps)
    return out
