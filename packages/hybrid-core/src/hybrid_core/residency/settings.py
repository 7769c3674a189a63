"""The residency section: what stays on each GPU between phases -- the planner's mode, the user's pins, the memory
budget, and the sleep switches of the trainers and the frozen models (the engines' are the engine section's: they
come as arguments where they are needed).

Roles are named by the caller; the sleep switches speak for roles by kind (:data:`~.steps.KIND_STATES`): the
trainers' switch for every trainer, the frozen models' for every frozen model, the engines' for every engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .planner import MODES
from .steps import KIND_STATES, STATE_MOVES

#: role kind -> the setting that asks such roles to sleep (the errors name it)
SLEEP_SETTINGS = {"engine": "engine.sleep", "trainer": "residency.trainer_sleep", "frozen": "residency.frozen_sleep"}


@dataclass(frozen=True)
class SleepAsks:
    """What the sleep switches say to the planner: the roles asked to sleep, the states they fix (a switch turned
    off keeps its roles' states resident; an engine sleep level says how the engines' weights leave), and role ->
    the setting that speaks for it."""

    roles: frozenset[str]
    pins: dict[tuple[str, str], str | tuple[str, str]] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ResidencySettings:
    """``mode``: auto (planned from the memory budget) | all-sleep (every shared role moves) | manual (only the sleep
    switches). ``pins``: ``"role.state" -> move`` decisions the plan must keep. ``gpu_memory_gb`` / ``host_memory_gb``:
    the budget per GPU / per node (None: the GPU's own / this machine's available memory). ``gpu_memory_usable``: the
    fraction of a GPU a phase may fill; ``gpu_context_gb``: what each process holds on its GPU whatever it keeps.
    ``overlap``: moves start early where the memory allows. ``trainer_sleep``: the trainers sleep between their
    phases (None: the plan decides; False: they keep everything); ``frozen_sleep``: the frozen models do."""

    mode: str = "auto"
    pins: Mapping[str, str] | None = None
    gpu_memory_gb: float | None = None
    host_memory_gb: float | None = None
    gpu_memory_usable: float = 0.92
    gpu_context_gb: float = 0.5
    overlap: bool = True
    trainer_sleep: bool | None = None
    frozen_sleep: bool = False

    def validate(self, *, zero_stage: int | None = None) -> ResidencySettings:
        """Refuse what no plan can follow; return self. ``zero_stage``: the trainers' ZeRO stage (the trainer
        section's), when it is known: DeepSpeed moves its states only under ZeRO 1-3."""
        if self.trainer_sleep and zero_stage == 0:
            raise ConfigError(
                "residency.trainer_sleep",
                "DeepSpeed can only offload/reload its states with ZeRO 1-3.",
                "Use trainer.zero_stage 1, 2 or 3, or drop residency.trainer_sleep.",
            )
        if self.mode == "all-sleep" and zero_stage == 0:
            raise ConfigError(
                "residency.mode",
                "all-sleep moves the trainers' states, which DeepSpeed can only do with ZeRO 1-3.",
                "Use trainer.zero_stage 1, 2 or 3, or residency.mode auto.",
            )
        if self.mode not in MODES:
            raise ConfigError(
                "residency.mode",
                f"{self.mode!r} is not one of {', '.join(MODES)}.",
                "auto plans from the memory budget; all-sleep moves every shared role between its phases; manual "
                "follows engine.sleep / residency.trainer_sleep.",
            )
        for key, move in (self.pins or {}).items():
            role, _, state = str(key).partition(".")
            if not role or state not in STATE_MOVES or move not in STATE_MOVES[state]:
                raise ConfigError(
                    "residency.pins",
                    f"{key}={move} is not ROLE.STATE=MOVE with a known state and move.",
                    "E.g. residency.pins actor.optimizer=offload rollout.kv_cache=release (states: "
                    + "; ".join(f"{s}: {'/'.join(m)}" for s, m in STATE_MOVES.items())
                    + ").",
                )
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ConfigError(
                "residency.gpu_memory_gb",
                f"must be > 0, got {self.gpu_memory_gb}.",
                "E.g. residency.gpu_memory_gb 80.",
            )
        if self.host_memory_gb is not None and not self.host_memory_gb > 0:
            raise ConfigError(
                "residency.host_memory_gb",
                f"must be > 0, got {self.host_memory_gb}.",
                "Give each node's host memory in GiB, e.g. residency.host_memory_gb 1000 (or leave it out: this "
                "machine's available memory).",
            )
        if not 0 <= self.gpu_context_gb < 64:
            raise ConfigError(
                "residency.gpu_context_gb",
                f"must be in [0, 64), got {self.gpu_context_gb}.",
                "E.g. residency.gpu_context_gb 0.5 (CUDA context and library workspaces of one process).",
            )
        if not 0 < self.gpu_memory_usable <= 1:
            raise ConfigError(
                "residency.gpu_memory_usable",
                f"must be in (0, 1], got {self.gpu_memory_usable}.",
                "E.g. residency.gpu_memory_usable 0.92.",
            )
        return self

    def state_pins(self) -> dict[tuple[str, str], Any]:
        """The user's pins as (role, state) -> move."""
        out: dict[tuple[str, str], Any] = {}
        for key, move in (self.pins or {}).items():
            role, _, state = str(key).partition(".")
            out[(role, state)] = move
        return out

    def sleep_asks(
        self, kinds: Mapping[str, str], *, engine_sleep: bool | None = None, engine_sleep_level: int | None = None
    ) -> SleepAsks:
        """What the sleep switches ask of the roles ``kinds`` names (role -> kind). ``engine_sleep`` /
        ``engine_sleep_level``: the engine section's switch and level."""
        switches = {"engine": engine_sleep, "trainer": self.trainer_sleep, "frozen": self.frozen_sleep or None}
        roles: set[str] = set()
        pins: dict[tuple[str, str], str | tuple[str, str]] = {}
        for role, kind in kinds.items():
            value = switches[kind]
            if value:
                roles.add(role)
            elif value is False:  # switched off: those roles keep everything on the GPU
                pins.update({(role, s): "resident" for s in KIND_STATES[kind] if s != "cache"})
        if engine_sleep_level is not None:
            # a level given with the planner on: when the engines' weights must leave, they leave this way
            how = "offload" if engine_sleep_level == 1 else "discard"
            for role, kind in kinds.items():
                if kind == "engine" and (role, "weights") not in pins:
                    pins[(role, "weights")] = ("resident", how)
        return SleepAsks(frozenset(roles), pins, {role: SLEEP_SETTINGS[kind] for role, kind in kinds.items()})
