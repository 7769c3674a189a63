"""What a live :class:`~.session.TrainingSession` holds: the run's roles, engines, residency owner, checkpoints and
history. The session's parts build on it in one line — :class:`SessionState` <- ``SessionSaves`` (checkpoints, resume,
the final model: :mod:`.session_saves`) <- ``SessionStart`` (set-up: :mod:`.session_start`) <- ``TrainingSession``
(the steps: :mod:`.session`). What ``start()`` sets is declared here: every part reads it by one name and type.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import HybridError

from .checkpoint import CheckpointManager
from .timeline import TimelineWriter

if TYPE_CHECKING:
    from hybrid_core.placement import PlacedPlan
    from hybrid_core.residency import ResidencyOwner
    from hybrid_engines.ray_engines import EngineGroup

    from .agents import AgentRollout
    from .async_loop import AsyncRunner
    from .failures import Preemption
    from .prepare import Prepared
    from .step import StepContext


class SessionState:
    """The live job's state: what :meth:`__init__` sets, and (declared) what ``start()`` sets."""

    # set by start() (session_start.SessionStart); close() copes with a start that did not get that far
    turnstile: Any  # hybrid_core.turnstile.Turnstile
    roles: dict[str, Any]  # role name -> hybrid_core.roles.RoleGroup, one per worker role of the recipe
    actor: Any
    critic: Any  # the other trainer, if any: checkpoints save both
    weight_sync: Any  # hybrid_engines.weight_sync.WeightSync
    reward: Any  # rewards.RewardScorer
    agent: AgentRollout | None
    ctx: StepContext
    async_mode: str
    async_note: str
    setup_seconds: dict[str, float]

    def __init__(self, prep: Prepared):
        self.prep = prep
        self.settings = prep.settings  # the sections: a session never reads the flat config
        self.log_dir = os.path.join(prep.run_dir, "logs")
        run = self.settings.run
        self.ckpt = CheckpointManager(run.checkpoint_dir, run.max_ckpt_num)
        self.placed: PlacedPlan | None = None
        self.groups: list = []
        self.engines: EngineGroup | None = None
        self.timeline: TimelineWriter | None = None
        self.engine_where: list[dict] = []  # pid and node of each engine, for stack dumps when a step fails
        self.owner: ResidencyOwner | None = None  # start() makes it; close() checks (see started_owner)
        self.start_step = 0
        self.history: list[dict[str, float]] = []
        self.runner: AsyncRunner | None = (
            None  # async_loop.AsyncRunner with --async_train (split, or shared GPUs that fit)
        )
        self.restored_queue: list[dict] = []  # the generated batches a resumed asynchronous run continues with
        self.restored_in_flight: dict | None = None  # and the generation its checkpoint caught in flight
        self.preemption: Preemption | None = (
            None  # failures.Preemption (train() sets it): SIGTERM during a step waits for its end
        )

    @property
    def started_owner(self) -> ResidencyOwner:
        """The residency owner that :meth:`start` made (``owner`` is None before that; :meth:`close` checks it)."""
        if self.owner is None:
            raise RuntimeError("TrainingSession.start() makes the residency owner: call it first")
        return self.owner

    def _call_all(self, calls) -> list:
        from hybrid_core.remote import get_all_with_timeout

        named = []
        for group, method, args in calls:
            for r, w in enumerate(group.workers):
                named.append((group.name(r, method), getattr(w, method).remote(*args)))
        try:
            return get_all_with_timeout(named, self.settings.run.call_timeout_s)
        except HybridError:
            for group, _, _ in calls:
                group.dump_stacks()
            raise


def write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
