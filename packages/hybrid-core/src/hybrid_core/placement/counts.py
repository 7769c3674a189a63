"""Roles given by counts (nodes x GPUs per node, or engines x tensor-parallel size) -> the fields of a
:class:`~hybrid_core.placement.PlacementSpec`.

The caller says which roles a run has and how they sit (the training loop: OpenRLHF's count flags for its recipe's
roles, ``hybrid_algos.train.placement``); the rules here know no role by name:

* each role gets ``nodes x per_node`` GPUs, an engine role ``engines x tp`` (one worker per engine, its ``tp``
  GPUs within one node); 0 means the role is absent;
* a role ``on`` another sits on that role's GPUs (taking the first ones; an engine role must fill them exactly),
  every other role gets the next free block of GPUs, in the order given;
* nodes: without ``gpus_per_node``, a role placed on several nodes (``nodes`` > 1) says how large a node is (its GPUs
  per node), as OpenRLHF assumes; tensor-parallel engines then stay within a node.

What roles keep on their GPUs between phases is not placement: the residency planner (:mod:`hybrid_core.residency`)
decides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import PlacementError
from .checks import cluster_size, require_int


@dataclass(frozen=True)
class CountedRole:
    """One role of a layout by counts.

    ``count``: (nodes, GPUs per node); for an engine role (``engines``): (engines, GPUs per engine). ``fields``: the
    settings behind the two numbers, named by the errors. ``on``: the role (earlier in the list) whose GPUs this one
    sits on, put there by the setting ``on_field`` (a role on one that has no GPUs is an error naming it);
    ``required``: the role must have GPUs (for a role ``on`` another: the setting that colocates it asks for it).
    ``label``: how the errors call the role (default: its name)."""

    name: str
    count: tuple[int, int]
    fields: tuple[str, str]
    engines: bool = False
    on: str | None = None
    on_field: str = ""
    required: bool = False
    label: str = ""

    @property
    def called(self) -> str:
        return self.label or self.name


def spec_fields_from_counts(
    roles: Sequence[CountedRole],
    *,
    gpus_per_node: int | None = None,
    cluster_gpus: int | None = None,
    num_nodes: int | None = None,
) -> dict[str, Any]:
    """The spec's fields for ``roles`` (in order: a role's own block follows the earlier roles' blocks):
    ``PlacementSpec.from_counts(roles)`` is ``PlacementSpec(**spec_fields_from_counts(roles))``. (Fields, not the
    spec: this module sits below :mod:`.spec`, which builds the spec from them.)

    ``gpus_per_node`` is the cluster's GPUs per node (a role's GPUs-per-node may not exceed it; engines may not
    straddle nodes); the cluster size is ``cluster_gpus`` or ``num_nodes x gpus_per_node`` (unchecked when
    neither is given: :func:`~hybrid_core.placement.place` then checks it against Ray).
    """
    names = [r.name for r in roles]
    if len(set(names)) != len(names):
        raise ValueError(f"roles repeat: {names}")
    if gpus_per_node is None and num_nodes is None:
        gpus_per_node = _node_size_from_roles([r.count for r in roles if not r.engines])
    cluster_gpus = cluster_size(cluster_gpus, gpus_per_node, num_nodes)
    sizes: dict[str, int] = {}
    for role in [r for r in roles if not r.engines] + [r for r in roles if r.engines]:
        sizes[role.name] = _role_size(role, gpus_per_node)
    for role in roles:
        if role.required and role.on is None and sizes[role.name] == 0:  # one on another: the layout says why
            nodes, per_node = role.count
            raise PlacementError(
                role.fields[1],
                f"the {role.called} has no GPUs ({role.fields[0]} x {role.fields[1]} = {nodes} x {per_node}).",
                f"Give the {role.called} at least one GPU, e.g. {role.fields[1]} 1.",
            )
    gpus = _lay_out(roles, sizes)
    engines = [r for r in roles if r.engines]
    return dict(
        gpus=gpus,
        tp={r.name: r.count[1] for r in engines if r.name in gpus},
        cluster_gpus=cluster_gpus,
        gpus_per_node=gpus_per_node,
        gpu_fields={r.name: r.fields[1] if not r.engines else r.fields[0] for r in roles},
        tp_fields={r.name: r.fields[1] for r in engines},
    )


def _role_size(role: CountedRole, gpus_per_node: int | None) -> int:
    first, second = role.count
    first_field, second_field = role.fields
    if role.engines:
        require_int(first, first_field, minimum=0)
        tp = require_int(second, second_field, minimum=1)
        if gpus_per_node is not None and tp > gpus_per_node:
            raise PlacementError(
                second_field,
                f"an engine of {tp} GPUs does not fit on a node of "
                f"{gpus_per_node} GPUs (tensor parallelism stays within a node).",
                f"Use {second_field} <= {gpus_per_node}.",
            )
        return first * tp
    require_int(first, first_field, minimum=0)
    require_int(second, second_field, minimum=0)
    if gpus_per_node is not None and second > gpus_per_node:
        raise PlacementError(
            second_field,
            f"{second} GPUs per node, but the cluster's nodes have {gpus_per_node}.",
            f"Use more nodes ({first_field}) with at most {gpus_per_node} GPUs each.",
        )
    return first * second


def _node_size_from_roles(counts: list[tuple[int, int]]) -> int | None:
    """GPUs per node as the multi-node roles imply it (the largest of their GPUs per node), else None."""
    sizes = [
        per_node
        for nodes, per_node in counts
        if isinstance(nodes, int) and isinstance(per_node, int) and nodes > 1 and per_node > 0
    ]
    return max(sizes) if sizes else None


def _lay_out(roles: Sequence[CountedRole], sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Role -> GPUs: a role ``on`` another reuses that role's GPUs, the others get the next free block."""
    by_name = {r.name: r for r in roles}
    gpus: dict[str, tuple[int, ...]] = {}
    next_free = 0
    for role in roles:
        size = sizes[role.name]
        if role.on is None:
            if size:
                gpus[role.name] = tuple(range(next_free, next_free + size))
                next_free += size
            continue
        host = by_name.get(role.on)
        if host is None or roles.index(host) > roles.index(role):
            raise ValueError(f"role {role.name} sits on {role.on!r}, which is not an earlier role")
        if size == 0:
            if role.required:
                raise PlacementError(
                    role.on_field,
                    f"there is no {role.called} to colocate ({role.fields[0]} x {role.fields[1]} = 0).",
                    f"Drop {role.on_field}, or give the {role.called} GPUs.",
                )
            continue
        if role.on not in gpus:
            raise PlacementError(
                role.on_field,
                f"there is no {host.called} to colocate the {role.called} with "
                f"({host.fields[0]} x {host.fields[1]} = 0).",
                f"Drop {role.on_field}, or give the {host.called} GPUs.",
            )
        if role.engines:
            if size != sizes[host.name]:
                raise PlacementError(role.fields[0], *_engines_problem_and_fix(role, host, sizes[host.name]))
        elif size > sizes[host.name]:
            raise PlacementError(
                role.fields[1],
                f"{role.on_field} puts the {role.name} on the {host.name}'s GPUs, but the {role.name} asks "
                f"for {size} GPUs and the {host.name} has {sizes[host.name]}.",
                f"Give the {role.name} at most {sizes[host.name]} GPUs ({role.fields[0]} x {role.fields[1]}), "
                f"or drop {role.on_field}.",
            )
        gpus[role.name] = gpus[host.name][:size]
    return gpus


def _engines_problem_and_fix(role: CountedRole, host: CountedRole, host_gpus: int) -> tuple[str, str]:
    engines, tp = role.count
    count, width = role.fields
    problem = (
        f"{role.on_field} puts the engines on the {host.name}'s GPUs, so {host.fields[0]} x "
        f"{host.fields[1]} (= {host_gpus}) must equal {count} x {width} (= {engines} x {tp} = {engines * tp})."
    )
    if host_gpus % tp == 0:
        fix = f"Use {count} {host_gpus // tp} with {width} {tp}, or change the {host.name}'s GPUs to {count} x {width}."
    else:
        fix = (
            f"{host_gpus} {host.name} GPUs cannot hold engines of {tp} GPUs: pick a {width} that divides "
            f"{host_gpus}, or change the {host.name}'s GPUs to {count} x {width}."
        )
    return problem, fix
