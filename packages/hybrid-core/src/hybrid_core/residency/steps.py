"""The vocabulary of residency: what a role keeps on a GPU (its *states*), the ways a state can leave (*moves*), and
the phases of a hybrid-engine RL step with what each phase needs resident.

A step runs these phases in order, then starts over (the last phase is followed by the next step's first)::

    generate -> reward -> reference -> critic_infer -> actor_train -> sync -> critic_train

Phases whose role is absent from a run are skipped (no critic in GRPO, no reward model with a rule reward).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Role kinds and the states each kind holds on a GPU.
#: ``cache`` is what the torch caching allocator keeps reserved after the role's phase (its activations' peak):
#: it stays unless the role trims it (``torch.cuda.empty_cache``).
KIND_STATES = {
    "trainer": ("params", "grads", "optimizer", "cache"),
    "frozen": ("params", "cache"),
    "engine": ("weights", "kv_cache"),
}

#: role name -> kind (any other role name is a trainer).
ROLE_KINDS = {"actor": "trainer", "critic": "trainer", "reference": "frozen", "reward": "frozen", "rollout": "engine"}

#: How a state can leave the GPU between the phases that need it:
#: ``resident`` -- it never leaves; ``offload`` -- copied to host memory and back (costs 2x its bytes over PCIe);
#: ``discard`` -- freed and refilled by the next weight sync (engine weights only: the sync overwrites them anyway);
#: ``release`` -- freed and re-allocated empty (engine KV cache, allocator cache: the contents are not needed);
#: ``host`` -- kept in host memory for the whole run and used there (the optimizer with CPU Adam).
MOVES = ("resident", "offload", "discard", "release", "host")

#: The moves allowed for each state, cheapest first.
STATE_MOVES = {
    "params": ("resident", "offload"),
    "grads": ("resident", "offload"),
    "optimizer": ("resident", "offload", "host"),
    "cache": ("resident", "release"),
    "weights": ("resident", "discard", "offload"),
    "kv_cache": ("resident", "release"),
}


def kind_of(role: str) -> str:
    return ROLE_KINDS.get(role, "trainer")


@dataclass(frozen=True)
class Phase:
    """One phase of a step: the role that works in it and what must be on the GPU while it does."""

    name: str
    role: str
    needs: dict[str, tuple[str, ...]]  # role -> states that must be resident during the phase

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.needs)


STEP = (
    Phase("generate", "rollout", {"rollout": ("weights", "kv_cache")}),
    Phase("reward", "reward", {"reward": ("params",)}),
    Phase("reference", "reference", {"reference": ("params",)}),
    Phase("critic_infer", "critic", {"critic": ("params",)}),
    # The actor's old-log-prob pass and its PPO epochs: forward, backward and the optimizer step.
    Phase("actor_train", "actor", {"actor": ("params", "grads", "optimizer")}),
    # The one moment two roles share the GPU on purpose: the actor's weights stream into the engines' weights.
    Phase("sync", "actor", {"actor": ("params",), "rollout": ("weights",)}),
    Phase("critic_train", "critic", {"critic": ("params", "grads", "optimizer")}),
)

#: Engine weights, once refreshed by the sync, must stay until the next generate (a discard would lose them).
HELD_UNTIL = {("rollout", "weights"): ("sync", "generate")}


def step_phases(roles) -> tuple[Phase, ...]:
    """The phases of a step for a run with these roles (a phase runs when its working role is present)."""
    present = set(roles)
    return tuple(p for p in STEP if p.role in present)


def needed_in(phases: tuple[Phase, ...], role: str, state: str) -> frozenset[str]:
    """The phases in which ``state`` of ``role`` must be on the GPU, whatever the plan."""
    needed = {p.name for p in phases if state in p.needs.get(role, ())}
    span = HELD_UNTIL.get((role, state))
    if span is not None and needed:
        names = [p.name for p in phases]
        start, end = names.index(span[0]), names.index(span[1])
        i = start
        while True:  # every phase from the sync, around the end of the step, to the generate
            needed.add(names[i])
            if i == end:
                break
            i = (i + 1) % len(names)
    return frozenset(needed)


def absent_runs(phases: tuple[Phase, ...], present: frozenset[str]) -> int:
    """How many separate stretches (cyclically) a state present only in ``present`` is off the GPU per step: each
    stretch costs one move off and one move back."""
    names = [p.name for p in phases]
    if not present or len(present) == len(names):
        return 0
    return sum(1 for i, n in enumerate(names) if n not in present and names[i - 1] in present)
