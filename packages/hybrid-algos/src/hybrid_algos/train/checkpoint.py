"""Atomic checkpoints: a checkpoint either exists completely or not at all.

Each save writes into a hidden temp folder, marks it complete, renames it to ``step-NNNNNNNN`` and then points
``latest`` at it (temp file + rename). A process killed at any moment leaves the previous checkpoint and ``latest``
untouched; unfinished temp folders are swept at the next start.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Any, Callable

import torch

COMPLETE = "COMPLETE.json"
DRIVER_STATE = "driver_state.pt"


class CheckpointManager:
    def __init__(self, root: str, max_keep: int = 3):
        self.root = os.path.abspath(root)
        self.max_keep = max_keep

    def save(self, step: int, save_roles: Callable[[str], None], driver_state: dict[str, Any]) -> str:
        """``save_roles(folder)`` writes the roles' states into ``folder``; returns the final checkpoint folder."""
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        save_roles(tmp)
        torch.save(driver_state, os.path.join(tmp, DRIVER_STATE))
        _write_json(os.path.join(tmp, COMPLETE), {"step": step, "time": time.time()})
        _fsync_dir(tmp)
        final = os.path.join(self.root, f"step-{step:08d}")
        if os.path.exists(final):  # saving the same step again (after a resume): keep the old one until the swap
            old = final + f".old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _write_json(os.path.join(self.root, "latest.json"), {"step": step, "path": os.path.basename(final)})
        _fsync_dir(self.root)
        self._prune()
        return final

    def latest(self) -> tuple[str, int] | None:
        """The newest complete checkpoint as ``(folder, step)``, or None."""
        pointer = os.path.join(self.root, "latest.json")
        if os.path.exists(pointer):
            with open(pointer) as f:
                info = json.load(f)
            path = os.path.join(self.root, info["path"])
            if os.path.exists(os.path.join(path, COMPLETE)):
                return path, int(info["step"])
        complete = self.complete_checkpoints()
        return complete[-1] if complete else None

    def complete_checkpoints(self) -> list[tuple[str, int]]:
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith("step-") and "." not in name and os.path.exists(os.path.join(path, COMPLETE)):
                out.append((path, int(name.split("-")[1])))
        return sorted(out, key=lambda x: x[1])

    def load_driver_state(self, path: str) -> dict[str, Any]:
        return torch.load(os.path.join(path, DRIVER_STATE), weights_only=False)

    def sweep_incomplete(self) -> list[str]:
        """Remove temp folders of saves that never finished (a crash mid-save)."""
        removed = []
        if os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".tmp-step-") or ".old-" in name:
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                    removed.append(name)
        return removed

    def _prune(self) -> None:
        complete = self.complete_checkpoints()
        for path, _ in complete[: max(0, len(complete) - self.max_keep)]:
            shutil.rmtree(path, ignore_errors=True)


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
