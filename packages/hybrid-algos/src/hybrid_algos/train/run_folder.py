"""The run folder (``--save_path``) and the checkpoint folder (``--ckpt_path``), checked before anything starts.

Both must be folders this process can write: that is found out at start, not at the first save N steps later. A
folder that already holds a run is never silently reused: a new run into it would truncate its metrics, overwrite
its checkpoints and, through pruning, mix two runs in one folder. It is continued (``--resume``), or replaced as a
whole (``--overwrite``: the previous run's files are removed first), or the new run goes elsewhere. Only what a run
of hybrid wrote is ever deleted (:mod:`.marks`); a folder a live run holds is refused outright (:mod:`.run_lock`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from hybrid_core.errors import ConfigError

from . import marks
from .checkpoint import CheckpointManager

log = logging.getLogger(__name__)

#: What a run writes into its folder and replaces whole when it is there (a file rewritten, a folder swapped).
REPLACED = ("metrics.jsonl", "summary.json", "timeline.jsonl", "residency.json", "final")
#: Folders a run adds its files to (a user's own files in them are never touched).
ADDED_TO = ("logs", "tensorboard", "profile", "wandb")
#: Everything a run writes into its folder besides its checkpoints (``tiny-model`` is a cache keyed by its settings,
#: not part of a run). Only the names a run claimed (:mod:`.marks`) are ever deleted.
RUN_FILES = REPLACED + ADDED_TO


def check_writable(field: str, path: str) -> str:
    """Create ``path`` if needed and prove it can hold files; a :class:`ConfigError` names ``field`` otherwise."""
    path = os.path.abspath(path)
    fix = f"Give --{field} a folder you can write to (or fix its permissions)."
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(field, f"{path} is a file, not a folder.", fix)
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hybrid-write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        what = "cannot be created" if not os.path.isdir(path) else "is not writable"
        raise ConfigError(field, f"{path} {what} ({e.strerror or e}).", fix) from None
    return path


#: What makes a folder hold a run worth keeping: recorded steps, a summary, a model or a checkpoint. Logs and empty
#: files alone are what a run that failed before its first step leaves.
_RESULTS = ("metrics.jsonl", "summary.json", "final")


def previous_run(run_dir: str, ckpt: CheckpointManager) -> list[str]:
    """What of an earlier run is in ``run_dir`` (and the checkpoint folder), as names to show; empty if nothing.
    Only items a run claimed count: a user's own ``final/`` is not a run (see :func:`foreign_items`)."""
    found = []
    mine = marks.claimed(run_dir)
    for name in _RESULTS:
        path = os.path.join(run_dir, name)
        if name in mine and (os.path.isdir(path) or (os.path.isfile(path) and os.path.getsize(path) > 0)):
            found.append(name)
    if ckpt.complete_checkpoints() or os.path.exists(os.path.join(ckpt.root, "latest.json")):
        found.append(os.path.relpath(ckpt.root, run_dir) if ckpt.root.startswith(run_dir + os.sep) else ckpt.root)
    return found


def foreign_items(run_dir: str) -> list[str]:
    """Items with content at names a run would replace that no run of hybrid claimed: someone else's files."""
    mine = marks.claimed(run_dir)
    return [
        name
        for name in REPLACED
        if name not in mine
        and os.path.lexists(os.path.join(run_dir, name))
        and marks.has_content(os.path.join(run_dir, name))
    ]


def refuse_or_clear(run_dir: str, ckpt: CheckpointManager, *, overwrite: bool, resuming: bool) -> None:
    """Make ``run_dir`` ready for this run, then claim the names it will write (:mod:`.marks`).

    A new (not resumed) run into a folder holding an earlier one is refused, or, with ``overwrite``, the earlier
    run's files -- the items a run claimed, and the checkpoints -- are removed so that nothing of it mixes with the
    new one. Files that no run wrote are never deleted: where the run would replace one of them, it is refused."""
    if resuming:  # the folder is the run being continued: what is there of it is its own
        marks.claim(run_dir, [n for n in RUN_FILES if n in REPLACED or _free(run_dir, n)])
        return
    foreign = foreign_items(run_dir)
    if foreign:
        shown = ", ".join(f"{n}/" if os.path.isdir(os.path.join(run_dir, n)) else n for n in foreign)
        raise ConfigError(
            "save_path",
            f"{run_dir} holds {shown}, which no hybrid run wrote (the folder's marker "
            f"{marks.MARKS} does not list {'it' if len(foreign) == 1 else 'them'}); a run there would "
            "replace "
            + ("it" if len(foreign) == 1 else "them")
            + (", and --overwrite deletes only what a run of hybrid wrote." if overwrite else "."),
            f"Move {'it' if len(foreign) == 1 else 'them'} out of the folder, or start the run in "
            f"another folder (--save_path {_fresh_name(run_dir)}).",
        )
    found = previous_run(run_dir, ckpt)
    mine = [n for n in RUN_FILES if marks.is_claimed(run_dir, n) and os.path.lexists(os.path.join(run_dir, n))]
    if found and not overwrite:
        raise ConfigError(
            "save_path",
            f"{run_dir} already holds a run ({', '.join(found)}); a new run there would overwrite it.",
            f"Continue it with --resume, start the new run in a fresh folder "
            f"(--save_path {_fresh_name(run_dir)}), or pass --overwrite to delete the old run first.",
        )
    if found or overwrite:
        for name in mine:
            _remove(os.path.join(run_dir, name))
        ckpt.clear()  # step-NNNNNNNN folders, temp folders and latest.json only: other files there stay
        if found or mine:
            log.warning("--overwrite: removed the earlier run in %s (%s)", run_dir, ", ".join(found or mine))
    else:  # a start that failed before its first step: its logs stay, the rest would mix with this run
        for name in ("tensorboard", "timeline.jsonl", "metrics.jsonl"):
            if name in mine:
                _remove(os.path.join(run_dir, name))
    marks.claim(run_dir, [n for n in RUN_FILES if _free(run_dir, n)])


def _free(run_dir: str, name: str) -> bool:
    """Whether this run may take ``name``: nothing there, nothing in it to lose, or an earlier run's own."""
    path = os.path.join(run_dir, name)
    return not os.path.lexists(path) or marks.is_claimed(run_dir, name) or not marks.has_content(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):  # a file, or a link (removed, never followed)
        os.remove(path)


def _fresh_name(run_dir: str) -> str:
    for n in range(2, 1000):
        candidate = f"{run_dir}-{n}"
        if not os.path.exists(candidate):
            return os.path.relpath(candidate) if not os.path.relpath(candidate).startswith("..") else candidate
    return f"{run_dir}-new"
