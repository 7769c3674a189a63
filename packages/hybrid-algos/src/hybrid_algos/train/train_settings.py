"""``TrainSettings``: a run's settings as the training loop reads them — one section per owning package.

The flat :class:`~hybrid_algos.train.config.RLConfig` (OpenRLHF's names, the ``vllm_*`` spellings) is what users
write; :meth:`RLConfig.settings` turns it into this once, after validation, through :data:`.sections.TABLE`. From
:func:`~hybrid_algos.train.prepare.prepare` down — the run's plan, the session, the step, the Ray workers — code reads
``settings.<section>.<name>`` in each section's own words, never a flat name. A section is frozen: a change the run
makes to it (the planner demoting ZeRO, say) is a new section, :meth:`TrainSettings.with_changes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybrid_algos.settings import AlgorithmSettings
from hybrid_core.placement.settings import PlacementSettings
from hybrid_core.residency.settings import ResidencySettings
from hybrid_engines.adapter import EngineSettings
from hybrid_engines.weight_sync.settings import SyncSettings

from .eval_settings import EvalSettings
from .model_settings import AGENT_TASKS, ModelSettings
from .rollout_settings import RolloutSettings
from .run_settings import RunSettings
from .workers.settings import TrainerSettings

#: the section names, in the order the fields below are declared
SECTION_NAMES: tuple[str, ...] = (
    "engine",
    "sync",
    "placement",
    "residency",
    "trainer",
    "algorithm",
    "rollout",
    "run",
    "models",
    "evaluation",
)


@dataclass(frozen=True)
class TrainSettings:
    """Every section of one run, plus ``name``: the algorithm's entry point (ppo | grpo | reinforce | rl)."""

    name: str
    engine: EngineSettings
    sync: SyncSettings
    placement: PlacementSettings
    residency: ResidencySettings
    trainer: TrainerSettings
    algorithm: AlgorithmSettings
    rollout: RolloutSettings
    run: RunSettings
    models: ModelSettings
    evaluation: EvalSettings

    def with_changes(self, **sections: dict[str, Any]) -> TrainSettings:
        """A copy with fields of some sections changed: ``with_changes(trainer={"zero_stage": 1})``."""
        unknown = set(sections) - set(SECTION_NAMES)
        if unknown:
            raise TypeError(f"no section {sorted(unknown)} (sections: {', '.join(SECTION_NAMES)})")
        changed = {name: dataclasses.replace(getattr(self, name), **fields) for name, fields in sections.items()}
        return dataclasses.replace(self, **changed)

    # ---- facts that cross sections (each read by several modules)
    @property
    def uses_agent(self) -> bool:
        """Samples are multi-turn conversations with an environment (an agent file, or a built-in agent task)."""
        return self.rollout.agent_func_path is not None or (
            self.rollout.prompt_data is None and self.models.task in AGENT_TASKS
        )

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether a step runs the actor's old log-prob pass (:meth:`AlgorithmSettings.needs_old_logprobs`; a
        teacher's distillation term needs them before the update, like KL as a reward penalty)."""
        teacher = self.models.teacher_pretrain is not None
        return teacher or self.algorithm.needs_old_logprobs(self.rollout.single_update)

    @property
    def actor_world_size(self) -> int:
        return self.placement.world_size("actor")

    @property
    def critic_world_size(self) -> int:
        return self.placement.world_size("critic")
