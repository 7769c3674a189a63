"""GPU range strings as users write them (``"0-7"``, ``"0-3,6,7"``) and back.

Parsing is strict: a reversed range (``"7-3"``), a non-number (``"a-b"``) or a repeated GPU is an error naming the
setting, never silently fixed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..errors import PlacementError

#: What a role's GPUs may be given as: ``"0-7"``, ``"0-3,6"``, ``5`` or ``[0, 1, 2]``.
GpuRange = str | int | Sequence[int]

_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_gpu_range(value: GpuRange, field: str) -> tuple[int, ...]:
    """The sorted GPU indices of ``value``; raises :class:`PlacementError` naming ``field`` when malformed."""
    if isinstance(value, bool):  # bool is an int subclass: True would silently mean GPU 1
        raise PlacementError(field, f"expected a GPU range such as '0-7', got {value!r}.", _RANGE_FIX)
    if isinstance(value, int):
        items: list[int] = [value]
    elif isinstance(value, str):
        items = _parse_string(value, field)
    elif isinstance(value, Sequence) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        items = [int(v) for v in value]
    else:
        raise PlacementError(field, f"expected a GPU range such as '0-7', got {value!r}.", _RANGE_FIX)
    if not items:
        raise PlacementError(field, "the GPU range is empty.", _RANGE_FIX)
    negative = [g for g in items if g < 0]
    if negative:
        raise PlacementError(field, f"GPU index {negative[0]} is negative.", _RANGE_FIX)
    seen: set[int] = set()
    repeated = sorted({g for g in items if g in seen or seen.add(g)})  # type: ignore[func-returns-value]
    if repeated:
        raise PlacementError(
            field, f"{value!r} lists {describe_gpus(repeated)} twice.", "List each GPU once, e.g. '0-3,6'."
        )
    return tuple(sorted(items))


def format_gpus(gpus: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3,6"`` (the inverse of :func:`parse_gpu_range`)."""
    ordered = sorted(set(gpus))
    parts: list[str] = []
    start = prev = None
    for g in ordered:
        if prev is not None and g == prev + 1:
            prev = g
            continue
        if start is not None:
            parts.append(_span(start, prev))
        start = prev = g
    if start is not None:
        parts.append(_span(start, prev))
    return ",".join(parts)


def describe_gpus(gpus: Iterable[int]) -> str:
    """``"GPU 3"`` or ``"GPUs 0-3,6"``, for messages."""
    ordered = sorted(set(gpus))
    return f"GPU{'s' if len(ordered) > 1 else ''} {format_gpus(ordered)}"


def _span(start: int, end: int | None) -> str:
    return str(start) if end == start else f"{start}-{end}"


def _parse_string(text: str, field: str) -> list[int]:
    if not text.strip():
        raise PlacementError(field, "the GPU range is empty.", _RANGE_FIX)
    items: list[int] = []
    for part in text.split(","):
        match = _ITEM.match(part)
        if match is None:
            raise PlacementError(
                field, f"cannot read {part.strip()!r} in {text!r} as a GPU index or range.", _RANGE_FIX
            )
        start, end = int(match.group(1)), int(match.group(2) if match.group(2) is not None else match.group(1))
        if end < start:
            raise PlacementError(
                field, f"the range {part.strip()!r} runs backwards.", f"Write it low-high: '{end}-{start}'."
            )
        items.extend(range(start, end + 1))
    return items


_RANGE_FIX = "Write GPU indices as 'first-last' or a comma list, e.g. '0-7' or '0-3,6,7'."
