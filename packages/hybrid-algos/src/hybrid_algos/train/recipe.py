"""A recipe is data the step executes: the roles of a run (who they are, what they load, which worker runs them) and
the phases of its step (in order: which role works, what each role must hold on its GPUs, what runs).

    recipe = recipe_for(config)                   # recipes.py: PPO, GRPO, REINFORCE++, optional roles dropped
    recipe.kinds                                  # role -> trainer / frozen / engine   (the residency planner's input)
    recipe.residency_phases()                     # hybrid_core.residency.Phase, in order  (ditto)
    [p.run for p in recipe.phases]                # names in step.py's phase table: what the step calls, in order

The loop builds one role group per :class:`RoleSpec` (the engines from the ``engine`` role), the placement gives each
role the GPUs its name has there (OpenRLHF's count flags for the built-in roles, ``--placement`` ranges for any),
and :mod:`.step` runs each :class:`PhaseSpec`'s function. Adding a role is one :class:`RoleSpec` and the phase that
uses it (tests/hybrid_algos/train/test_recipe_new_role.py adds a judge; recipes.py's distillation teacher is one too).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hybrid_core.residency import KIND_STATES, Phase
from hybrid_core.residency.steps import check_phases

#: The policy's model folder: the run's --pretrain, or the demo's tiny model (the loop resolves it).
POLICY = "pretrain"


@dataclass(frozen=True)
class RoleSpec:
    """One role of a run.

    ``kind``: ``trainer`` (DeepSpeed, trained), ``frozen`` (loaded, never trained) or ``engine`` (the inference
    engines; launched by hybrid-engines, no worker class). ``worker``: the worker class, or its import path
    (``"package.module:Class"``, imported only when the run starts). ``model``: the settings whose folder the role
    loads, first one set wins (:data:`POLICY` is the policy's folder), or a function ``(config, policy_folder) ->
    folder``. ``value_head``: the model ends in a scalar head (critic, reward model): it is sized so.
    ``when``: for an optional role, ``config -> bool``: the role exists only when it says so (no reference without a
    KL term, no reward model with a rule reward)."""

    name: str
    kind: str
    worker: Any = None
    model: Sequence[str] | Callable[[Any, str | None], str | None] = (POLICY,)
    value_head: bool = False
    when: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KIND_STATES:
            raise ValueError(f"role {self.name}: kind {self.kind!r} is not one of {', '.join(KIND_STATES)}")
        if (self.worker is None) != (self.kind == "engine"):
            raise ValueError(
                f"role {self.name}: a {self.kind} "
                + (
                    "has no worker class (the engines are launched by hybrid-engines)"
                    if self.kind == "engine"
                    else "needs a worker class"
                )
            )

    def worker_class(self) -> type:
        if not isinstance(self.worker, str):
            return self.worker
        module, _, name = self.worker.partition(":")
        return getattr(importlib.import_module(module), name)

    def model_folder(self, config: Any, policy: str | None) -> str | None:
        """The folder this role loads (``policy``: the policy's folder; None: the demo's tiny model, not made yet)."""
        if callable(self.model):
            return self.model(config, policy)
        for setting in self.model:
            value = policy if setting == POLICY else getattr(config, setting)
            if value:
                return value
        return None


@dataclass(frozen=True)
class PhaseSpec:
    """One phase of the step, in order.

    ``role``: the role at work (its GPUs' turn). ``needs``: role -> states that must be on its GPUs during the phase.
    ``work``: what the roles named in ``needs`` do there (``generate``, ``infer``, ``train``, ``sync``: it sizes
    their working memory). ``run``: the function of step.py's phase table that runs it (default: the phase's name).
    ``holds``: (role, state) -> the later phase until which a state this phase fills must stay (the engines' weights
    after a sync). ``driver``: the phase still runs without its role, on the driver (the reward phase scores with a
    rule function when there is no reward model); it then has no GPU turn. ``when``: for an optional phase,
    ``config -> bool``: the phase exists only when it says so (the evaluation's, with an evaluation dataset)."""

    name: str
    role: str
    needs: Mapping[str, tuple[str, ...]]
    work: tuple[str, ...] = ()
    run: str = ""
    holds: Mapping[tuple[str, str], str] = field(default_factory=dict)
    driver: bool = False
    when: Callable[[Any], bool] | None = None

    @property
    def function(self) -> str:
        return self.run or self.name

    def residency_phase(self) -> Phase:
        return Phase(self.name, self.role, dict(self.needs), tuple(self.work), dict(self.holds))


@dataclass(frozen=True)
class Recipe:
    """The roles and the phases of a step. The first phase generates the rollout (asynchronous training runs it
    apart from the rest: :mod:`.async_rollout`)."""

    name: str
    roles: tuple[RoleSpec, ...]
    phases: tuple[PhaseSpec, ...]

    def __post_init__(self) -> None:
        names = [r.name for r in self.roles]
        if len(set(names)) != len(names):
            raise ValueError(f"recipe {self.name}: role names repeat: {names}")
        if [r.kind for r in self.roles].count("engine") != 1:
            raise ValueError(f"recipe {self.name}: needs exactly one engine role (the rollout's)")
        for p in self.phases:
            unknown = sorted({*([] if p.driver else [p.role]), *p.needs} - set(names))  # a driver phase may lack it
            if unknown:
                raise ValueError(
                    f"recipe {self.name}, phase {p.name}: no role {', '.join(unknown)} (roles: {', '.join(names)})"
                )
        check_phases(tuple(p.residency_phase() for p in self.phases), self.kinds)

    # ---- what a run of this recipe has -------------------------------------------------------------------------
    def for_config(self, config: Any) -> Recipe:
        """This recipe for ``config``: its optional roles that the config does not ask for are dropped, with the
        phases they work in (a ``driver`` phase stays, without its role) and their entries in other phases' needs; an
        optional phase the config does not ask for is dropped too."""
        kept = tuple(r for r in self.roles if r.when is None or r.when(config))
        names = {r.name for r in kept}
        phases = []
        for p in self.phases:
            if (p.role not in names and not p.driver) or (p.when is not None and not p.when(config)):
                continue
            phases.append(
                replace(
                    p,
                    needs={r: s for r, s in p.needs.items() if r in names},
                    holds={k: v for k, v in p.holds.items() if k[0] in names},
                )
            )
        return replace(self, roles=kept, phases=tuple(phases))

    def has(self, role: str) -> bool:
        return any(r.name == role for r in self.roles)

    def role(self, name: str) -> RoleSpec:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"recipe {self.name} has no role {name!r} (roles: {', '.join(r.name for r in self.roles)})")

    @property
    def kinds(self) -> dict[str, str]:
        return {r.name: r.kind for r in self.roles}

    @property
    def engine_role(self) -> str:
        return next(r.name for r in self.roles if r.kind == "engine")

    def model_folders(self, config: Any, policy: str | None) -> dict[str, str | None]:
        """Role -> the folder it loads (the engines: the policy's), resolved once from the flat config (the
        roles' ``model`` names its settings) so that the run below ``prepare`` reads folders, not flags."""
        return {r.name: policy if r.kind == "engine" else r.model_folder(config, policy) for r in self.roles}

    @property
    def workers(self) -> tuple[RoleSpec, ...]:
        """The roles the loop starts worker groups for (trainers and frozen models), in the recipe's order."""
        return tuple(r for r in self.roles if r.kind != "engine")

    def residency_phases(self) -> tuple[Phase, ...]:
        """The step as the residency planner takes it: the phases with a role at work on GPUs."""
        present = {r.name for r in self.roles}
        return tuple(p.residency_phase() for p in self.phases if p.role in present)

    def train_phase(self, role: str) -> str:
        """The phase in which ``role`` (a trainer) holds everything it trains with: DeepSpeed saves and loads its
        checkpoint from there."""
        for p in self.phases:
            if p.role == role and "train" in p.work:
                return p.name
        raise KeyError(f"recipe {self.name}: no phase trains {role!r}")

    def work_phase(self, work: str) -> str:
        """The first phase that does ``work`` (``generate``, ``sync``): where the loop puts the roles before it
        starts the engines (generate's residency) or gives them restored weights (sync's)."""
        for p in self.phases:
            if work in p.work:
                return p.name
        raise KeyError(f"recipe {self.name}: no phase does {work!r}")
