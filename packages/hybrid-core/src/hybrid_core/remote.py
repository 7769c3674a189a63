"""Ray calls with deadlines: nothing waits forever, and a timeout names what it was waiting for.

Each call has its own timeout; :func:`deadline` adds a shared budget on top (e.g. one training step): inside the
block every call waits at most until the budget is spent, and the error then says which budget ran out.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import RemoteTimeout, RoleFailure


@dataclass(frozen=True)
class _Budget:
    ends: float  # time.monotonic()
    seconds: float
    label: str


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("hybrid_remote_budget", default=None)


@contextlib.contextmanager
def deadline(seconds: float, label: str) -> Iterator[None]:
    """Every timed call in the block finishes within ``seconds`` from now (``label`` names the budget in errors).

    Nested budgets keep the earlier end."""
    outer = _budget.get()
    ends = time.monotonic() + seconds
    budget = outer if outer is not None and outer.ends <= ends else _Budget(ends, seconds, label)
    token = _budget.set(budget)
    try:
        yield
    finally:
        _budget.reset(token)


def effective_timeout(timeout_s: float) -> tuple[float, str]:
    """The wait allowed now for a call of ``timeout_s``, and how to describe that limit in an error."""
    budget = _budget.get()
    if budget is None:
        return timeout_s, f"within {timeout_s:g} s"
    left = max(budget.ends - time.monotonic(), 0.0)
    if left < timeout_s:
        return left, f"within the {budget.seconds:g} s budget of {budget.label}"
    return timeout_s, f"within {timeout_s:g} s"


def get_with_timeout(refs: Any, timeout_s: float, what: str) -> Any:
    """``ray.get`` with a deadline.

    ``what`` describes the call for the error message, e.g. ``"rollout rank 1: generate"``. A timeout raises
    :class:`RemoteTimeout`; a dead actor or a remote exception raises :class:`RoleFailure`; both name ``what``.
    """
    import ray

    timeout_s, limit = effective_timeout(timeout_s)
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise RemoteTimeout(f"{what}: no answer {limit}") from e
    except ray.exceptions.RayActorError as e:
        from .death_cause import death_cause

        raise RoleFailure(f"{what}: the actor died ({type(e).__name__}: {death_cause(e)})") from e
    except ray.exceptions.RayTaskError as e:
        raise RoleFailure(f"{what}: raised {_first_line(e)}") from e


def get_all_with_timeout(named_refs: Sequence[tuple[str, Any]], timeout_s: float) -> list[Any]:
    """Wait for several named calls under one deadline; the error names the first that failed or is late."""
    import ray

    timeout_s, limit = effective_timeout(timeout_s)
    ends = time.monotonic() + timeout_s
    pending = {ref: name for name, ref in named_refs}
    while pending:
        left = ends - time.monotonic()
        # One at a time: a call that failed is raised as soon as it ends, not after the others (which may wait for
        # it forever: the other ranks of a collective, the other engines of a rendezvous) or the deadline.
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(left, 0.0))
        for ref in ready:
            get_with_timeout(ref, 1.0, pending.pop(ref))  # raise the named error of a failed call at once
        if pending and time.monotonic() >= ends:
            late = ", ".join(sorted(set(pending.values())))
            raise RemoteTimeout(f"{late}: no answer {limit}")
    return [ray.get(ref) for _, ref in named_refs]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
