"""``torch.no_grad()`` as a decorator that keeps the decorated function's signature for the type checker.

The lint env has no torch (mypy.ini), so ``@torch.no_grad()`` would turn every decorated function into ``Any`` for
its callers; wrapping it once here keeps the math's signatures checked. At run time it is ``torch.no_grad()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def no_grad(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run under ``torch.no_grad()`` (results detached), with ``fn``'s signature."""
    wrapped: Callable[P, R] = torch.no_grad()(fn)
    return wrapped
