"""Which items of a run folder a run of hybrid wrote: the only ones ``--overwrite`` may delete.

A name such as ``logs`` or ``final`` says nothing about who made it: a user's ``final/report.md`` in the folder
given as ``--save_path`` is not a run's model. So a run *claims* the names it is about to write, before it writes
them, in the folder's marker ``.hybrid-marks.json``: a name is claimed only when nothing is there yet (or what is
there is empty, or already claimed by an earlier run of ours). ``--overwrite`` removes claimed items and nothing
else; an unclaimed item with content at a name the run would replace is refused, never deleted.
"""

from __future__ import annotations

import json
import os
import time
import uuid

MARKS = ".hybrid-marks.json"


def claimed(run_dir: str) -> set[str]:
    """The names in ``run_dir`` that runs of hybrid claimed (empty when the folder has no marker)."""
    try:
        with open(os.path.join(run_dir, MARKS), encoding="utf-8") as f:
            data = json.load(f)
        return {str(name) for name in data.get("items", [])}
    except (OSError, ValueError, AttributeError, TypeError):
        return set()


def is_claimed(run_dir: str, name: str) -> bool:
    return name in claimed(run_dir)


def claim(run_dir: str, names: list[str] | tuple[str, ...]) -> None:
    """Record ``names`` as written by a run of hybrid (added to those already claimed)."""
    items = claimed(run_dir) | set(names)
    _write(run_dir, sorted(items))


def has_content(path: str) -> bool:
    """Whether ``path`` holds anything to lose: a non-empty file, or a folder with such a file somewhere in it."""
    if os.path.isfile(path) or os.path.islink(path):
        return os.path.islink(path) or os.path.getsize(path) > 0
    return any(files for _, _, files in os.walk(path))


def _write(run_dir: str, items: list[str]) -> None:
    path = os.path.join(run_dir, MARKS)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(
            {
                "written_by": "hybrid",
                "note": "items of this folder written by hybrid runs: --overwrite deletes these and nothing else",
                "updated": time.time(),
                "items": items,
            },
            f,
            indent=1,
        )
    os.replace(tmp, path)
