"""Ray calls with deadlines: nothing waits forever, and a timeout names what it was waiting for."""

from __future__ import annotations

from typing import Any, Sequence

from .errors import RemoteTimeout, RoleFailure


def get_with_timeout(refs: Any, timeout_s: float, what: str) -> Any:
    """``ray.get`` with a deadline.

    ``what`` describes the call for the error message, e.g. ``"rollout rank 1: generate"``. A timeout raises
    :class:`RemoteTimeout`; a dead actor or a remote exception raises :class:`RoleFailure`; both name ``what``.
    """
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise RemoteTimeout(f"{what}: no answer within {timeout_s:g} s") from e
    except ray.exceptions.RayActorError as e:
        raise RoleFailure(f"{what}: the actor died ({type(e).__name__}: {_first_line(e)})") from e
    except ray.exceptions.RayTaskError as e:
        raise RoleFailure(f"{what}: raised {_first_line(e)}") from e


def get_all_with_timeout(named_refs: Sequence[tuple[str, Any]], timeout_s: float) -> list[Any]:
    """Wait for several named calls under one deadline; the error names the first that failed or is late."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    pending = {ref: name for name, ref in named_refs}
    while pending:
        left = deadline - time.monotonic()
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=max(left, 0.0))
        for ref in ready:
            get_with_timeout(ref, 1.0, pending.pop(ref))  # raise the named error of a failed call at once
        if pending and time.monotonic() >= deadline:
            late = ", ".join(sorted(set(pending.values())))
            raise RemoteTimeout(f"{late}: no answer within {timeout_s:g} s")
    return [ray.get(ref) for _, ref in named_refs]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
