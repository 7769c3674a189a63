"""Per-GPU turn-taking: on a shared GPU at most one memory-heavy role is awake at a time.

A role asks for its turn on its GPUs before it wakes (reloads weights, optimizer state, KV cache) and gives the
turn back after it sleeps. A turn on several GPUs is taken all at once, never GPU by GPU, so two roles cannot each
hold half of what the other needs. Ranks of one role share its turn (re-entrant: each ``acquire`` is matched by a
``release``). Waiting roles are served first come, first served, except that a role already holding a turn may
extend it (it is mid-phase and would otherwise deadlock behind a waiter that waits for it).

Take a role's turn for all of its GPUs at once (from the driver, or from the role's rank 0 for the whole role):
per-rank turns of two roles whose ranks wait for each other in a collective can deadlock; the timeout then names
the role holding the GPU.

Every wait has a timeout, and the :class:`~hybrid_core.errors.TurnTimeout` names the role holding the GPU: the usual
cause is a role that crashed or forgot to sleep. This replaces the "Ray barriers" of the seeds.

The state lives in one named async Ray actor (``num_cpus=0``) so that waiting callers never block each other;
:class:`TurnTable` is its logic, usable and testable without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, HybridError, TurnTimeout
from .placement.ranges import describe_gpus as _gpus
from .remote import get_with_timeout

#: Extra seconds the caller waits for the turnstile actor beyond the turn's own timeout (the actor answers first).
RPC_GRACE_S = 30.0


class TurnstileMisuse(HybridError, RuntimeError):
    """A role released a GPU it does not hold (a bug in the caller's acquire/release pairing)."""


@dataclass(frozen=True)
class _Waiter:
    ticket: int
    role: str
    gpus: frozenset[int]
    since: float


class TurnTable:
    """Who holds which GPU, and the queue of roles waiting for a turn (asyncio; one event loop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._holder: dict[int, str] = {}
        self._count: dict[int, int] = {}
        self._since: dict[int, float] = {}
        self._seen: set[int] = set()
        self._queue: list[_Waiter] = []
        self._tickets = itertools.count()
        self._cond = asyncio.Condition()

    async def acquire(self, role: str, gpus: Sequence[int], timeout_s: float) -> str | None:
        """Wait until ``role`` may hold all of ``gpus``, then hold them. Returns None, or the timeout message."""
        waiter = _Waiter(next(self._tickets), role, frozenset(gpus), self._clock())
        self._seen.update(waiter.gpus)
        async with self._cond:
            self._queue.append(waiter)
            try:
                if not self._grantable(waiter):
                    try:
                        await asyncio.wait_for(self._cond.wait_for(lambda: self._grantable(waiter)), timeout_s)
                    except asyncio.TimeoutError:
                        return self._timeout_message(waiter, timeout_s)
                self._take(waiter)
                return None
            finally:
                self._queue.remove(waiter)
                self._cond.notify_all()  # a waiter queued behind this one may now go

    async def release(self, role: str, gpus: Sequence[int]) -> str | None:
        """Give back one hold of ``gpus``; returns None, or a message when ``role`` does not hold them all."""
        async with self._cond:
            wrong = {g: self._holder.get(g) for g in gpus if self._holder.get(g) != role}
            if wrong:
                detail = ", ".join(
                    f"GPU {g} is {'free' if h is None else 'held by ' + h}" for g, h in sorted(wrong.items())
                )
                return f"{role} released GPUs it does not hold ({detail}): every release must match an acquire."
            for g in set(gpus):
                self._count[g] -= 1
                if self._count[g] == 0:
                    del self._holder[g], self._count[g], self._since[g]
            self._cond.notify_all()
            return None

    async def release_all(self, role: str) -> list[int]:
        """Drop every hold of ``role`` (after it died or was restarted); returns the GPUs freed."""
        async with self._cond:
            freed = sorted(g for g, h in self._holder.items() if h == role)
            for g in freed:
                del self._holder[g], self._count[g], self._since[g]
            self._cond.notify_all()
            return freed

    def holders(self) -> dict[int, str | None]:
        """Every GPU seen so far -> the role holding it, or None."""
        return {g: self._holder.get(g) for g in sorted(self._seen)}

    def state(self) -> dict[str, Any]:
        """Holders, hold counts and the waiting queue (for debugging and error reports)."""
        now = self._clock()
        return {
            "holders": self.holders(),
            "counts": dict(sorted(self._count.items())),
            "waiting": [{"role": w.role, "gpus": sorted(w.gpus), "waited_s": now - w.since} for w in self._queue],
        }

    # ---- internals ------------------------------------------------------------------------------------------
    def _grantable(self, waiter: _Waiter) -> bool:
        if any(self._holder.get(g, waiter.role) != waiter.role for g in waiter.gpus):
            return False
        if waiter.role in self._holder.values():
            return True  # mid-turn: extending a turn never waits behind the queue
        return not any(self._blocks(w, waiter) for w in self._ahead_of(waiter))

    def _ahead_of(self, waiter: _Waiter) -> list[_Waiter]:
        return [w for w in self._queue if w.ticket < waiter.ticket]

    @staticmethod
    def _blocks(earlier: _Waiter, waiter: _Waiter) -> bool:
        return earlier.role != waiter.role and bool(earlier.gpus & waiter.gpus)

    def _take(self, waiter: _Waiter) -> None:
        now = self._clock()
        for g in waiter.gpus:
            if g not in self._holder:
                self._holder[g], self._count[g], self._since[g] = waiter.role, 0, now
            self._count[g] += 1

    def _timeout_message(self, waiter: _Waiter, timeout_s: float) -> str:
        now = self._clock()
        held: dict[str, list[int]] = {}
        for g in sorted(waiter.gpus):
            holder = self._holder.get(g)
            if holder is not None and holder != waiter.role:
                held.setdefault(holder, []).append(g)
        reasons = [
            f"{holder} holds {_gpus(gs)} (for {now - min(self._since[g] for g in gs):.1f} s) and has not released it"
            for holder, gs in held.items()
        ]
        ahead = [w for w in self._ahead_of(waiter) if self._blocks(w, waiter)]
        reasons += [
            f"{w.role} asked first for {_gpus(sorted(w.gpus & waiter.gpus))} and is still waiting" for w in ahead
        ]
        holders = " / ".join(held) or " / ".join(dict.fromkeys(w.role for w in ahead)) or "the holder"
        return (
            f"{waiter.role} waited {timeout_s:g} s for its turn on {_gpus(sorted(waiter.gpus))}: "
            f"{'; '.join(reasons) or 'the GPUs stayed busy'}. Fix: make sure {holders} sleeps and releases its "
            "turn after its phase (leave the `turn()` block); if it crashed, call release_all() for it; if its "
            "phase is just slow, raise timeout_s."
        )


class _TurnstileActor:
    """The Ray actor around a :class:`TurnTable` (async: waiting callers do not block each other)."""

    def __init__(self) -> None:
        self._table = TurnTable()

    async def acquire(self, role: str, gpus: list[int], timeout_s: float) -> str | None:
        return await self._table.acquire(role, gpus, timeout_s)

    async def release(self, role: str, gpus: list[int]) -> str | None:
        return await self._table.release(role, gpus)

    async def release_all(self, role: str) -> list[int]:
        return await self._table.release_all(role)

    async def holders(self) -> dict[int, str | None]:
        return self._table.holders()

    async def state(self) -> dict[str, Any]:
        return self._table.state()


class Turnstile:
    """Client of a named turnstile actor. Picklable: hand it to workers so ranks can take turns themselves.

    ``timeout_s`` is the default wait for a turn; calls to the actor itself time out ``RPC_GRACE_S`` later.
    """

    def __init__(self, actor: Any, name: str, timeout_s: float = 600):
        self.actor = actor
        self.name = name
        self.timeout_s = _check_timeout(timeout_s)

    @classmethod
    def create(
        cls, name: str, timeout_s: float = 600, *, detached: bool = False, namespace: str | None = None
    ) -> Turnstile:
        """Get the turnstile actor called ``name``, creating it if needed (``detached``: it outlives the driver)."""
        import ray

        if not isinstance(name, str) or not name:
            raise ConfigError("name", f"a turnstile needs a non-empty name, got {name!r}.")
        remote_cls = ray.remote(num_cpus=0, max_concurrency=10_000)(_TurnstileActor)
        actor = remote_cls.options(
            name=name, namespace=namespace, get_if_exists=True, lifetime="detached" if detached else None
        ).remote()
        return cls(actor, name, timeout_s)

    @classmethod
    def get(cls, name: str, timeout_s: float = 600, *, namespace: str | None = None) -> Turnstile:
        """Attach to an existing turnstile (raises ValueError if there is none called ``name``)."""
        import ray

        return cls(ray.get_actor(name, namespace=namespace), name, timeout_s)

    def acquire(self, role: str, gpus: Sequence[int], timeout_s: float | None = None) -> None:
        """Block until no *other* role holds any of ``gpus``, then hold them; raises :class:`TurnTimeout`."""
        role, gpu_list = _check_role(role), _check_gpus(gpus)
        wait_s = self.timeout_s if timeout_s is None else _check_timeout(timeout_s)
        message = get_with_timeout(
            self.actor.acquire.remote(role, gpu_list, wait_s),
            wait_s + RPC_GRACE_S,
            f"turnstile {self.name!r}: {role} acquiring {_gpus(gpu_list)}",
        )
        if message is not None:
            raise TurnTimeout(message)

    def release(self, role: str, gpus: Sequence[int]) -> None:
        """Give back the turn taken by the matching :meth:`acquire`."""
        role, gpu_list = _check_role(role), _check_gpus(gpus)
        message = get_with_timeout(
            self.actor.release.remote(role, gpu_list),
            RPC_GRACE_S,
            f"turnstile {self.name!r}: {role} releasing {_gpus(gpu_list)}",
        )
        if message is not None:
            raise TurnstileMisuse(message)

    def release_all(self, role: str) -> list[int]:
        """Drop every hold of ``role`` (e.g. after its workers died); returns the GPUs freed."""
        freed: list[int] = get_with_timeout(
            self.actor.release_all.remote(_check_role(role)),
            RPC_GRACE_S,
            f"turnstile {self.name!r}: release_all {role}",
        )
        return freed

    @contextlib.contextmanager
    def turn(self, role: str, gpus: Sequence[int], timeout_s: float | None = None) -> Iterator[Turnstile]:
        """``with ts.turn("rollout", gpus): wake; generate; sleep`` -- the turn is released even on error."""
        self.acquire(role, gpus, timeout_s)
        try:
            yield self
        finally:
            self.release(role, gpus)

    def holders(self) -> dict[int, str | None]:
        """Every GPU the turnstile has seen -> the role holding it now, or None."""
        holders: dict[int, str | None] = get_with_timeout(
            self.actor.holders.remote(), RPC_GRACE_S, f"turnstile {self.name!r}: holders"
        )
        return holders

    def state(self) -> dict[str, Any]:
        """Holders, hold counts and who is waiting for how long."""
        state: dict[str, Any] = get_with_timeout(
            self.actor.state.remote(), RPC_GRACE_S, f"turnstile {self.name!r}: state"
        )
        return state

    def kill(self) -> None:
        """End the turnstile actor (a detached one lives on until this is called)."""
        import ray

        ray.kill(self.actor, no_restart=True)

    def __repr__(self) -> str:
        return f"Turnstile({self.name!r}, timeout_s={self.timeout_s:g})"


def _check_role(role: object) -> str:
    if not isinstance(role, str) or not role:
        raise ConfigError("role", f"a turn is taken by a role name, got {role!r}.")
    return role


def _check_gpus(gpus: object) -> list[int]:
    if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Sequence) or not gpus:
        raise ConfigError("gpus", f"expected a non-empty list of GPU indices, got {gpus!r}.")
    if not all(isinstance(g, numbers.Integral) and not isinstance(g, bool) and int(g) >= 0 for g in gpus):
        raise ConfigError("gpus", f"GPU indices are whole numbers >= 0, got {list(gpus)!r}.")
    return sorted({int(g) for g in gpus})


def _check_timeout(timeout_s: object) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ConfigError("timeout_s", f"every wait needs a finite, positive timeout in seconds, got {timeout_s!r}.")
    return float(timeout_s)
