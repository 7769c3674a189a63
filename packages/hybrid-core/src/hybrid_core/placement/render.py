"""The plan as plain text: a GPU x role table and a per-role summary (the body of ``hybrid ppo --dry-run``).

Example (OpenRLHF's 8-GPU hybrid engine)::

    placement: 8 GPUs on 1 node (8 GPUs per node)

    GPU | actor   | rollout  | reference | reward
    ----+---------+----------+-----------+--------
      0 | #0 0.25 | #0 0.25  | #0 0.25   | #0 0.25
    ...
    cell: worker rank and the fraction of the GPU it asks Ray for (bookkeeping, not a memory limit)

What each role keeps on its GPUs phase by phase is the residency plan's table (:mod:`hybrid_core.residency`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .ranges import describe_gpus, format_gpus

if TYPE_CHECKING:
    from .plan import PlacementPlan, RolePlacement

EMPTY_CELL = "-"


def render_plan(plan: PlacementPlan) -> str:
    """The GPU table, its legend and the role summary, as one string (no trailing newline)."""
    lines = [_title(plan), ""]
    lines += _gpu_table(plan)
    lines.append("cell: worker rank and the fraction of the GPU it asks Ray for (bookkeeping, not a memory limit)")
    lines.append("")
    lines += _role_summary(plan)
    return "\n".join(lines)


def _title(plan: PlacementPlan) -> str:
    if plan.gpus_per_node:
        nodes = -(-plan.num_gpus // plan.gpus_per_node)
        where = f"on {nodes} node{'s' if nodes > 1 else ''} ({plan.gpus_per_node} GPUs per node)"
    else:
        where = "(node size not given)"
    return f"placement: {plan.num_gpus} GPU{'s' if plan.num_gpus > 1 else ''} {where}"


def _gpu_table(plan: PlacementPlan) -> list[str]:
    headers = ["GPU"] + list(plan.roles)
    rows: list[list[str]] = []
    for gpu in range(plan.num_gpus):
        row = [str(gpu)]
        for name in plan.roles:
            worker = plan.worker_on_gpu(name, gpu)
            row.append(EMPTY_CELL if worker is None else f"#{worker.rank} {_fmt_fraction(worker.num_gpus)}")
        rows.append(row)
    widths = [max(len(r[i]) for r in [headers] + rows) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].rjust(widths[0])
        rest = [c.ljust(w) for c, w in zip(cells[1:], widths[1:])]
        return " | ".join([first] + rest).rstrip()

    out = [line(headers), "-+-".join("-" * w for w in widths)]
    for gpu, row in enumerate(rows):
        if plan.gpus_per_node and gpu % plan.gpus_per_node == 0 and plan.num_gpus > plan.gpus_per_node:
            last = min(gpu + plan.gpus_per_node, plan.num_gpus) - 1
            out.append(f"{'':>{widths[0]}} | node {plan.node_of(gpu)} (GPUs {gpu}-{last})")
        out.append(line(row))
    return out


def _role_summary(plan: PlacementPlan) -> list[str]:
    headers = ["role", "workers", "tp", "GPUs", "fraction", "shares"]
    rows = [[name, str(role.world_size), str(role.tp), format_gpus(role.gpus), _fraction_span(role),
             _sharing(plan, name)] for name, role in plan.roles.items()]
    widths = [max(len(r[i]) for r in [headers] + rows) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers] + rows]


def _sharing(plan: PlacementPlan, name: str) -> str:
    shared = plan.shared_gpus(name)
    return describe_gpus(shared) if shared else "-"


def _fraction_span(role: RolePlacement) -> str:
    fractions = sorted({w.num_gpus for w in role.workers})
    if len(fractions) == 1:
        return _fmt_fraction(fractions[0])
    return f"{_fmt_fraction(fractions[0])}-{_fmt_fraction(fractions[-1])}"


def _fmt_fraction(value: float) -> str:
    return "1" if value >= 1 else f"{value:.4f}".rstrip("0")
