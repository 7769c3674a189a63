"""The run folder (``--save_path``) and the checkpoint folder (``--ckpt_path``), checked before anything starts.

Both must be folders this process can write: that is found out at start, not at the first save N steps later. A
folder that already holds a run is never silently reused: a new run into it would truncate its metrics, overwrite
its checkpoints and, through pruning, mix two runs in one folder. It is continued (``--resume``), or replaced as a
whole (``--overwrite``: the previous run's files are removed first), or the new run goes elsewhere.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from hybrid_core.errors import ConfigError

from .checkpoint import CheckpointManager

log = logging.getLogger(__name__)

#: What a run writes into its folder (``tiny-model`` is a cache keyed by its settings, not part of a run).
RUN_FILES = ("metrics.jsonl", "summary.json", "timeline.jsonl", "final", "logs", "tensorboard", "checkpoints")


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
    """What of an earlier run is in ``run_dir`` (and the checkpoint folder), as names to show; empty if nothing."""
    found = []
    for name in _RESULTS:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) or (os.path.isfile(path) and os.path.getsize(path) > 0):
            found.append(name)
    if ckpt.complete_checkpoints() or os.path.exists(os.path.join(ckpt.root, "latest.json")):
        found.append(os.path.relpath(ckpt.root, run_dir) if ckpt.root.startswith(run_dir + os.sep) else ckpt.root)
    return found


def refuse_or_clear(run_dir: str, ckpt: CheckpointManager, *, overwrite: bool, resuming: bool) -> None:
    """A new (not resumed) run into a folder holding an earlier one: refused, or, with ``overwrite``, the earlier
    run's files are removed so that nothing of it mixes with the new one."""
    if resuming:
        return
    found = previous_run(run_dir, ckpt)
    leftovers = [name for name in RUN_FILES if os.path.exists(os.path.join(run_dir, name)) and name != "checkpoints"]
    if not found and not (overwrite and leftovers):
        if leftovers:  # a start that failed before its first step: its logs stay, the rest would mix with this run
            for name in ("tensorboard", "timeline.jsonl", "metrics.jsonl"):
                _remove(os.path.join(run_dir, name))
        return
    if not overwrite:
        raise ConfigError("save_path", f"{run_dir} already holds a run ({', '.join(found)}); a new run there would "
                          "overwrite it.", f"Continue it with --resume, start the new run in a fresh folder "
                          f"(--save_path {_fresh_name(run_dir)}), or pass --overwrite to delete the old run first.")
    for name in RUN_FILES:
        path = os.path.join(run_dir, name)
        if name == "checkpoints" and os.path.abspath(path) != ckpt.root:
            continue  # --ckpt_path elsewhere: cleared below, and a user's own "checkpoints" folder is left alone
        _remove(path)
    ckpt.clear()
    log.warning("--overwrite: removed the earlier run in %s (%s)", run_dir, ", ".join(found or leftovers))


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _fresh_name(run_dir: str) -> str:
    for n in range(2, 1000):
        candidate = f"{run_dir}-{n}"
        if not os.path.exists(candidate):
            return os.path.relpath(candidate) if not os.path.relpath(candidate).startswith("..") else candidate
    return f"{run_dir}-new"
