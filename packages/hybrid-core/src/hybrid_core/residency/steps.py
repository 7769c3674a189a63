"""The vocabulary of residency: what a role keeps on a GPU (its *states*), the ways a state can leave (*moves*), the
kinds of work a phase runs (which size its working memory), and :class:`Phase`, one phase of a step with what it
needs resident.

The step itself is the caller's data: a training loop passes its phases in order (``hybrid_algos.train.recipes``
builds PPO's, GRPO's and REINFORCE++'s from their recipes), and the step runs them in that order, then starts over
(the last phase is followed by the next step's first). Nothing here names an algorithm's roles or phases; a phase
whose working role is absent from a run is skipped (:func:`present_phases`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: Role kinds and the states each kind holds on a GPU.
#: ``cache`` is what the torch caching allocator keeps reserved after the role's phase (its activations' peak):
#: it stays unless the role trims it (``torch.cuda.empty_cache``).
KIND_STATES = {
    "trainer": ("params", "grads", "optimizer", "cache"),
    "frozen": ("params", "cache"),
    "engine": ("weights", "kv_cache"),
}

#: What a role can do in a phase, by kind; the memory model (:func:`.memory.size_role`) sizes each one's working
#: memory: ``generate`` -- an engine samples (its KV cache, unless it has a pool); ``infer`` -- a forward pass without
#: gradients (log-probs, values, rewards); ``train`` -- forward, backward and the optimizer step; ``sync`` -- one
#: weight-sync bucket on each side while weights stream from a trainer into the engines.
WORK_KINDS = {
    "trainer": ("infer", "train", "sync"),
    "frozen": ("infer",),
    "engine": ("generate", "sync"),
}

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


@dataclass(frozen=True)
class Phase:
    """One phase of a step: the role that works in it, what must be on the GPU while it does, what it runs.

    ``needs``: role -> states that must be resident during the phase (every role named works in it: its working
    memory for ``work`` is counted). ``work``: the kinds of work (:data:`WORK_KINDS`) the phase runs one after another;
    its working memory is the largest of them. ``holds``: (role, state) -> a later phase: a state this phase fills
    (engine weights refreshed by a sync) stays on the GPU from here, around the end of the step, to that phase (a
    discard in between would lose it)."""

    name: str
    role: str
    needs: dict[str, tuple[str, ...]]
    work: tuple[str, ...] = ()
    holds: Mapping[tuple[str, str], str] = field(default_factory=dict)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.needs)


def present_phases(phases: Iterable[Phase], roles: Iterable[str]) -> tuple[Phase, ...]:
    """The phases of a step for a run with these roles: a phase runs when its working role is present."""
    present = set(roles)
    return tuple(p for p in phases if p.role in present)


def check_phases(phases: tuple[Phase, ...], kinds: Mapping[str, str]) -> None:
    """A step's phases make sense for roles of these kinds (role -> kind): distinct names, states and work each kind
    has, spans that end at a phase of the step. Raises ValueError naming the phase (a recipe's mistake)."""
    names = [p.name for p in phases]
    if len(set(names)) != len(names):
        raise ValueError(f"phase names repeat: {names}")
    for p in phases:
        for role, states in p.needs.items():
            kind = kinds.get(role)
            if kind is None:
                continue  # a role this run does not have: the phase is skipped, or the planner never sees it
            wrong = [s for s in states if s not in KIND_STATES[kind]]
            if wrong:
                raise ValueError(
                    f"phase {p.name}: {role} (kind {kind}) has no state {', '.join(wrong)} "
                    f"(it has {', '.join(KIND_STATES[kind])})"
                )
            bad = [w for w in p.work if w not in WORK_KINDS[kind]]
            if bad:
                raise ValueError(
                    f"phase {p.name}: {role} (kind {kind}) cannot {', '.join(bad)} "
                    f"(it can {', '.join(WORK_KINDS[kind])})"
                )
        for (role, state), end in p.holds.items():
            if role in kinds and end not in names:
                raise ValueError(
                    f"phase {p.name} holds {role}.{state} until {end!r}, which is no phase of the step "
                    f"({', '.join(names)})"
                )


def needed_in(phases: tuple[Phase, ...], role: str, state: str) -> frozenset[str]:
    """The phases in which ``state`` of ``role`` must be on the GPU, whatever the plan: those that need it, and every
    phase a ``holds`` span keeps it through."""
    needed = {p.name for p in phases if state in p.needs.get(role, ())}
    if not needed:
        return frozenset()
    names = [p.name for p in phases]
    for p in phases:
        end = p.holds.get((role, state))
        if end is None or end not in names:
            continue
        i = names.index(p.name)
        while True:  # every phase from the one that fills it, around the end of the step, to the one that uses it
            needed.add(names[i])
            if names[i] == end:
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
