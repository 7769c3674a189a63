"""The residency owner: the one place that moves state on and off the GPUs during a run, and knows what is where.

It holds the plan (:mod:`.plan`), the turn table (:class:`~hybrid_core.turnstile.Turnstile`) and the wake guard
(:mod:`.wake_guard`), and a handle per role that can take states off its GPUs and bring them back. The loop only
says which phase comes next::

    owner.enter("generate")      # what the plan removes in this phase leaves; what it needs comes back
    outputs = engines.generate(...)
    owner.enter("reward")        # e.g. the engines' KV cache is released while the rewards are computed
    ...

Moves overlap with work where the memory allows: states leaving are released asynchronously and only waited for
when the phase needs their memory (the engines free their KV cache while the driver scores rewards); in plans the
planner made (``auto``), states that the next phase needs are brought back during the current phase when the plan
and a fresh reading of the GPU say they fit beside it (the actor reloads its optimizer while the reference model
scores), and a state the next phase needs is not sent away if it fits beside this one. A wake that does not fit
waits for the moves ahead of it, and if it still does not fit the guard raises naming who holds the GPU.

Roles whose plan moves states take turns on their GPUs (the turnstile's table records who is working where); the
working role holds its turn from entering its phase until the next phase is entered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..remote import get_all_with_timeout
from ..stats import PhaseTimer
from .plan import ResidencyPlan, tracked
from .wake_guard import WakeGuard

if TYPE_CHECKING:
    from .refine import Refinement

log = logging.getLogger(__name__)


class RoleHandle(Protocol):
    """What the owner needs from a role: its GPUs, and asynchronous calls that move states off and back on."""

    role: str

    @property
    def gpus(self) -> list[int]: ...  # read-only: an engine group's is a property

    def offload(self, states: Sequence[str], moves: Mapping[str, str]) -> list[tuple[str, Any]]: ...

    def reload(self, states: Sequence[str]) -> list[tuple[str, Any]]: ...


@dataclass
class _Pending:
    """Moves in flight for one role (Ray refs named for errors), and what they will have done."""

    role: str
    direction: str  # "off" | "on"
    states: tuple[str, ...]
    refs: list[tuple[str, Any]]
    tag: Any = None  # the caller's tag (step) when the move started
    phase: str | None = None
    started: float = field(default_factory=time.perf_counter)


class ResidencyOwner:
    def __init__(
        self,
        plan: ResidencyPlan,
        handles: Mapping[str, RoleHandle],
        *,
        turnstile: Any = None,
        guard: WakeGuard | None = None,
        timeout_s: float = 600.0,
        overlap: bool = True,
    ):
        self.plan = plan
        self.handles = dict(handles)
        self.turnstile = turnstile
        self.guard = guard
        self.timeout_s = timeout_s
        # Early moves only where the plan is the planner's: in all-sleep / manual plans the user asked for the
        # absences themselves (bringing a state back early because it fits would undo them).
        self.overlap = overlap and plan.mode == "auto"
        # The one record of what is on the GPUs: role -> states resident now (every state starts resident).
        self.resident: dict[str, set[str]] = {r: set(self._states(r)) for r in self.handles}
        self.pending: list[_Pending] = []
        self.phase: str | None = None
        self.turn: tuple[str, list[int]] | None = None
        self.moved_bytes: dict[tuple[str, str], int] = {}  # (role, direction) -> bytes of its last move
        self.timer: PhaseTimer | None = None
        self.on_move: Callable[[str, str, tuple[str, ...], int, float], Any] | None = None
        self.tag: Any = None  # set by the caller (the step number): recorded with every move
        self.log: list[dict[str, Any]] = []  # every move and, per phase entered, what each GPU may hold (bounded)
        self.log_limit = 2000

    def add_role(self, role: str, handle: RoleHandle) -> None:
        """A role that joins after the others were moved (the engines start last): all its states are resident."""
        self.handles[role] = handle
        self.resident[role] = set(self._states(role))

    # ---- the loop's calls -------------------------------------------------------------------------------------------
    def enter(self, phase: str, timer: PhaseTimer | None = None) -> None:
        """Make the GPUs hold what ``phase`` needs (and only what the plan keeps there), then let it run."""
        self.timer = timer
        self._harvest()
        if phase == self.phase:
            return  # already there (the loop may announce a phase early, then enter it)
        role = self._role_of(phase)
        if self.turn is not None and self.turn[0] != role:
            self._release_turn()
        self.phase = phase
        leaving, coming = self._transition(phase)
        for role, states in leaving.items():
            self._start_off(role, states)
        if coming:
            # What comes back may need the memory of what is leaving: let those moves finish first.
            self._wait(lambda p: p.direction == "off" and self._shares_gpu(p.role, coming), "sleep")
        self._take_turn(phase)
        try:
            for role, states in coming.items():
                self._bring_on(role, states)
        except BaseException:
            self.release_turn_quietly()  # the phase will not run: its turn goes back, the wake's error is reported
            raise
        if not self._fits_with_pending(phase):
            self._wait(lambda p: p.direction == "off", "sleep")
        if self.overlap:
            self._prefetch_next(phase)
        self._note({"event": "enter", "phase": phase, "held": {g: self.held_at_most(g) for g in self.plan.layout}})

    def settle(self) -> None:
        """Wait for every move in flight (before a checkpoint, at the end of a run)."""
        self._wait(lambda p: True, "sleep")

    def refine(self, after_step: int, replan: Callable[[dict[int, float]], ResidencyPlan]) -> Refinement | None:
        """Measure what each GPU really holds against what this owner has there now, and make the plan again with
        the difference as its overhead when it grew (:mod:`.refine`; ``replan``: overhead -> plan, the run's planner);
        a new plan becomes this owner's. None where nothing can be read (no wake guard, no CUDA)."""
        from .refine import refine_plan

        guard = self.guard
        if guard is None or not guard.enabled:
            return None
        self.settle()  # every move landed: the record is what the GPUs hold (early wakes included)
        used = {}
        for gpu in self.plan.layout:
            reading = guard.read(gpu)
            if reading is None:
                return None
            used[gpu] = reading.total - reading.free
        result = refine_plan(
            self.plan, used, phase=self.phase, on_gpu=self.on_gpu(), after_step=after_step, replan=replan
        )
        if result.replanned:
            self.plan = result.plan
        return result

    def finish(self) -> None:
        """The run is over: wait for moves and give the turn back."""
        try:
            self.settle()
        finally:
            self._release_turn()

    def to_phase_state(self, phase: str) -> None:
        """Put every role in the residency ``phase`` starts with, without running it (set-up, resume)."""
        self.enter(phase)
        self.settle()
        self._release_turn()

    def holders(self, gpu: int) -> dict[str, int | None]:
        """Roles holding memory on ``gpu`` now -> the bytes the plan gives their resident states there."""
        out: dict[str, int | None] = {}
        for share in self.plan.layout.get(gpu, ()):
            held = sum(share.size.states.get(s, 0.0) for s in self.resident.get(share.role, ()))
            if self.plan.move(share.role, "cache") == "resident":
                held += share.size.states.get("cache", 0.0)  # the allocator keeps its working peak reserved
            if held:
                out[share.role] = int(held * share.workers)
        return out

    def on_gpu(self) -> dict[str, set[str]]:
        """Role -> the states that may be on its GPUs right now by this owner's account: resident, still leaving or
        already coming back (after :meth:`settle`: exactly the resident ones, early wakes included); a role of the
        plan that has no handle yet holds all of them. What :mod:`.refine` compares a GPU reading with."""
        out = {}
        for role in self.plan.roles:
            if role not in self.handles:
                out[role] = set(self._states(role))
                continue
            out[role] = (
                set(self.resident.get(role, ()))
                | self._arriving(role)
                | {s for p in self.pending if p.role == role and p.direction == "off" for s in p.states}
            )
        return out

    def held_at_most(self, gpu: int) -> float:
        """The most ``gpu`` can hold right now by this owner's account: resident states, states still leaving and
        states already coming back, plus the contexts (the working memory of the phase comes on top)."""
        on_gpu = self.on_gpu()
        total = 0.0
        for share in self.plan.layout.get(gpu, ()):
            total += share.size.context * share.workers
            total += sum(share.size.states.get(s, 0.0) for s in on_gpu.get(share.role, ())) * share.workers
        return total

    def _note(self, entry: dict[str, Any]) -> None:
        if len(self.log) < self.log_limit:
            self.log.append({"tag": self.tag, **entry})

    # ---- transitions -----------------------------------------------------------------------------------------------
    def _transition(self, phase: str) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        leaving, coming = {}, {}
        for role in self.handles:
            want = set(self.plan.resident_states(role, phase))
            have = self.resident[role] | self._arriving(role)
            if self.overlap:  # what the next phase needs and may stay beside this one is not sent away and back
                want |= self._early(role, phase)
            gone = tuple(s for s in self._states(role) if s in have and s not in want)
            back = tuple(
                s
                for s in self._states(role)
                if s in want and s not in have and s in self.plan.resident_states(role, phase)
            )
            if gone:
                leaving[role] = gone
            if back:
                coming[role] = back
        return leaving, coming

    def _start_off(self, role: str, states: tuple[str, ...]) -> None:
        # A reload of this role still in flight must land first (and its states count as resident again).
        self._wait(lambda p: p.role == role and p.direction == "on", "wake")
        moves = {s: self.plan.move(role, s) for s in states}
        refs = self.handles[role].offload(states, moves)
        for s in states:
            self.resident[role].discard(s)
        self.pending.append(_Pending(role, "off", states, refs, self.tag, self.phase))

    def _bring_on(self, role: str, states: tuple[str, ...]) -> None:
        """A wake the phase needs: guarded, waited for."""
        handle = self.handles[role]
        need = self._need(role, states)
        what = "+".join(states)
        before = self.guard.before_wake(role, what, handle.gpus, need) if self.guard is not None else None
        start = time.perf_counter()
        try:
            results = get_all_with_timeout(handle.reload(states), self.timeout_s)
        except Exception as error:
            explained = (
                self.guard.explain_wake_failure(role, what, handle.gpus, need, error)
                if self.guard is not None
                else None
            )
            if explained is None:
                raise
            raise explained from error
        self.resident[role].update(states)
        if self.guard is not None:
            self.guard.after_wake(role, what, before)
        self._record(role, "on", states, results, time.perf_counter() - start, waited=True)

    def _early(self, role: str, phase: str) -> set[str]:
        """States of ``role`` the phase after ``phase`` needs that fit beside ``phase`` (by the plan)."""
        names = [p.name for p in self.plan.phases]
        nxt = names[(names.index(phase) + 1) % len(names)]
        early = set(self.plan.resident_states(role, nxt)) - set(self.plan.resident_states(role, phase))
        if not early:
            return set()
        extra = self._need(role, tuple(early))
        if not all(self.plan.fits_phase(g, phase, extra.get(g, 0.0)) for g in self.handles[role].gpus):
            return set()
        return early

    def _prefetch_next(self, phase: str) -> None:
        """Start bringing back what the next phase needs, where it fits beside this phase (plan + a fresh reading)."""
        names = [p.name for p in self.plan.phases]
        nxt = names[(names.index(phase) + 1) % len(names)]
        _, coming = self._transition_from(phase, nxt)
        for role, states in coming.items():
            extra = self._need(role, states)
            if not all(self.plan.fits_phase(g, phase, extra.get(g, 0.0)) for g in self.handles[role].gpus):
                continue
            if self.guard is not None and not self.guard.has_room(
                role, "+".join(states), self.handles[role].gpus, extra
            ):
                continue
            refs = self.handles[role].reload(states)
            self.pending.append(_Pending(role, "on", states, refs, self.tag, self.phase))

    def _transition_from(self, phase: str, nxt: str) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        leaving: dict[str, tuple[str, ...]] = {}
        coming: dict[str, tuple[str, ...]] = {}
        for role in self.handles:
            want = set(self.plan.resident_states(role, nxt))
            have = self.resident[role] | self._arriving(role)
            back = tuple(s for s in self._states(role) if s in want and s not in have)
            if back:
                coming[role] = back
        return leaving, coming

    def _harvest(self) -> None:
        """Account for the moves in flight that have finished (without waiting for the others)."""
        if not self.pending:
            return
        import ray

        refs = [ref for p in self.pending for _, ref in p.refs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        finished = [p for p in self.pending if all(ref in done for _, ref in p.refs)]
        if finished:
            ids = {id(p) for p in finished}
            self._wait(lambda p: id(p) in ids, "")

    def _arriving(self, role: str) -> set[str]:
        return {s for p in self.pending if p.role == role and p.direction == "on" for s in p.states}

    def _fits_with_pending(self, phase: str) -> bool:
        """Whether the phase fits while the states still leaving hold their memory."""
        leaving = {(p.role, s) for p in self.pending if p.direction == "off" for s in p.states}
        if not leaving:
            return True
        for gpu, shares in self.plan.layout.items():
            extra = sum(
                share.size.states.get(s, 0.0) * share.workers
                for share in shares
                for (r, s) in leaving
                if r == share.role
            )
            if not self.plan.fits_phase(gpu, phase, extra):
                return False
        return True

    def _wait(self, which: Callable[[_Pending], bool], label: str) -> None:
        done = [p for p in self.pending if which(p)]
        if not done:
            return
        self.pending = [p for p in self.pending if not which(p)]
        start = time.perf_counter()
        results = get_all_with_timeout([r for p in done for r in p.refs], self.timeout_s)
        waited = time.perf_counter() - start
        i = 0
        for p in done:
            part = results[i : i + len(p.refs)]
            i += len(p.refs)
            if p.direction == "on":
                self.resident[p.role].update(p.states)
            self._record(p.role, p.direction, p.states, part, waited, waited=True, tag=p.tag, phase=p.phase)
            waited = 0.0  # the wall time of a joint wait is counted once

    def _record(
        self,
        role: str,
        direction: str,
        states: tuple[str, ...],
        results: list[Any],
        seconds: float,
        *,
        waited: bool,
        tag: Any = None,
        phase: str | None = None,
    ) -> None:
        """Account one finished move; the log files it under the step and phase in which it started."""
        moved = sum(_bytes_of(r) for r in results)
        if len(self.log) < self.log_limit:
            self.log.append(
                {
                    "event": "move",
                    "tag": self.tag if tag is None else tag,
                    "phase": phase or self.phase,
                    "role": role,
                    "direction": direction,
                    "states": list(states),
                    "bytes": moved,
                }
            )
        self.moved_bytes[(role, direction)] = moved
        if self.timer is not None:
            phase = "wake" if direction == "on" else "sleep"
            self.timer.add(phase, seconds if waited else 0.0, moved)
        if self.on_move is not None:
            self.on_move(role, direction, states, moved, seconds)

    # ---- turns -----------------------------------------------------------------------------------------------------
    def _role_of(self, phase: str) -> str:
        return next(p.role for p in self.plan.phases if p.name == phase)

    def _take_turn(self, phase: str) -> None:
        role = self._role_of(phase)
        if self.turnstile is None or self.turn is not None or role not in self.handles or not self.plan.sleeps(role):
            return
        gpus = self.handles[role].gpus
        self.turnstile.acquire(role, gpus, timeout_s=self.timeout_s)
        self.turn = (role, gpus)

    def _release_turn(self) -> None:
        if self.turn is None or self.turnstile is None:
            self.turn = None
            return
        role, gpus = self.turn
        self.turn = None
        self.turnstile.release(role, gpus)

    def release_turn_quietly(self) -> None:
        """After a failed phase: give the turn back without hiding the phase's own error."""
        try:
            self._release_turn()
        except Exception:  # the step's budget may be spent; the original error is the one to report
            log.debug("turn release after a failure failed", exc_info=True)

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _states(self, role: str) -> list[str]:
        """The role's states that can be on its GPUs (not empty ones, not those kept in host memory)."""
        for shares in self.plan.layout.values():
            for share in shares:
                if share.role == role:
                    return [
                        s
                        for s, b in share.size.states.items()
                        if (b or tracked(s)) and s != "cache" and self.plan.move(role, s) != "host"
                    ]
        return []

    def _need(self, role: str, states: Sequence[str]) -> dict[int, float]:
        out: dict[int, float] = {}
        for gpu in self.handles[role].gpus:
            for share in self.plan.layout.get(gpu, ()):
                if share.role == role:
                    out[gpu] = sum(share.size.states.get(s, 0.0) for s in states) * share.workers
        return out

    def _shares_gpu(self, role: str, others: Mapping[str, Any]) -> bool:
        mine = set(self.handles[role].gpus)
        return any(mine & set(self.handles[o].gpus) for o in others)


def _bytes_of(result: Any) -> int:
    if isinstance(result, dict):
        return int(result.get("bytes", 0))
    if isinstance(result, (list, tuple)):
        return sum(_bytes_of(r) for r in result)
    return int(getattr(result, "bytes", 0) or 0)
