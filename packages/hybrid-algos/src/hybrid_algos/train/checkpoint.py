"""Atomic checkpoints: a checkpoint either exists completely or not at all.

Each save writes into a hidden temp folder, marks it complete, renames it to ``step-NNNNNNNN`` and then points
``latest.json`` at it (temp file + rename). A process killed at any moment leaves the previous checkpoint and
``latest.json`` untouched; unfinished temp folders are swept at the next start.

The driver's own state (step, KL controller, reward normaliser, metrics history, config without its credentials) is
plain JSON, and ``COMPLETE.json`` holds its SHA-256 and the size and CRC-32 of every role file
(:mod:`.checkpoint_files`), so a damaged or missing file is found before it is used. Nothing the driver reads from a
checkpoint can run code: the ``driver_state.pt`` of older versions is read with ``torch.load(weights_only=True)``
(plain containers and numbers only) and refused otherwise. The roles' model and optimizer states are DeepSpeed's
files, which DeepSpeed loads with ``torch.load(weights_only=False)`` -- that is, a pickle that can run code: only
resume from checkpoints you (or someone you trust) wrote. See the README's "Reliability" section.

Old checkpoints are pruned *before* a save, so the disk holds at most ``max_keep`` of them at any time (but never
fewer than one complete checkpoint: with ``max_keep=1`` the previous one stays until the new one is complete).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any

from hybrid_core.errors import HybridError

from . import checkpoint_files
from .redact import redact

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE.json"
DRIVER_STATE = "driver_state.json"
LEGACY_DRIVER_STATE = "driver_state.pt"  # hybrid <= 0.1: a torch.save'd dict of plain values
LATEST = "latest.json"


class CheckpointError(HybridError, RuntimeError):
    """A checkpoint cannot be written (no space, unwritable folder) or read (damaged, unsafe)."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file would run code when loaded: refused, never skipped."""


class CheckpointManager:
    def __init__(self, root: str, max_keep: int = 3):
        self.root = os.path.abspath(root)
        self.max_keep = max_keep

    # ---- saving ----------------------------------------------------------------------------------------------------
    def save(self, step: int, save_roles: Callable[[str], None], driver_state: dict[str, Any]) -> str:
        """``save_roles(folder)`` writes the roles' states into ``folder``; returns the final checkpoint folder.

        A failed save leaves nothing behind (its temp folder is removed); running out of disk space raises a
        :class:`CheckpointError` that says so, with the free space and what to do.
        """
        os.makedirs(self.root, exist_ok=True)
        self.prune(self.max_keep - 1)  # room for the new one first: peak disk = max_keep checkpoints
        tmp = os.path.join(self.root, f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(tmp)
            save_roles(tmp)
            began = time.perf_counter()
            files = checkpoint_files.record(tmp)  # the roles' files as written: checked before a resume loads them
            if time.perf_counter() - began > 10:
                log.info("checkpoint %d: %d files checksummed in %.1f s", step, len(files), time.perf_counter() - began)
            digest = _write_json(os.path.join(tmp, DRIVER_STATE), redact(driver_state))
            _write_json(
                os.path.join(tmp, COMPLETE),
                {"step": step, "time": time.time(), "sha256": {DRIVER_STATE: digest}, "files": files},
            )
            _fsync_dir(tmp)
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(error, Exception) and out_of_space(error, self.root):
                raise CheckpointError(self._no_space_message(step)) from error
            raise
        final = os.path.join(self.root, f"step-{step:08d}")
        if os.path.exists(final):  # saving the same step again (after a resume): keep the old one until the swap
            old = final + f".old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _write_json(os.path.join(self.root, LATEST), {"step": step, "path": os.path.basename(final)})
        _fsync_dir(self.root)
        self.prune(self.max_keep)
        return final

    def _no_space_message(self, step: int) -> str:
        free = _free_bytes(self.root)
        previous = self.complete_checkpoints()
        size = f"; the last checkpoint takes {_human(_folder_bytes(previous[-1][0]))}" if previous else ""
        return (
            f"no space left on device: the checkpoint of step {step} did not fit in {self.root} "
            f"({_human(free)} free{size}). Nothing of it was kept, and the previous checkpoints are intact. "
            f"Fix: free disk space, keep fewer checkpoints (--max_ckpt_num, now {self.max_keep}) or put them on "
            "a larger disk (--ckpt_path DIR), then continue with --resume."
        )

    # ---- finding ---------------------------------------------------------------------------------------------------
    def latest(self) -> tuple[str, int] | None:
        """The newest complete checkpoint as ``(folder, step)``, or None."""
        found = self.candidates()
        return found[0] if found else None

    def candidates(self) -> list[tuple[str, int]]:
        """Complete checkpoints, newest first: the one ``latest.json`` names, then the others by step.

        A damaged ``latest.json`` is reported (a warning) and the folder is scanned instead."""
        complete = self.complete_checkpoints()
        pointed = None
        pointer = os.path.join(self.root, LATEST)
        if os.path.exists(pointer):
            try:
                _only_regular_files(pointer)
                with open(pointer, encoding="utf-8") as f:
                    info = json.load(f)
                pointed = (os.path.join(self.root, str(info["path"])), int(info["step"]))
            except (OSError, ValueError, KeyError, TypeError, CheckpointError) as e:
                log.warning(
                    "%s is damaged (%s); using the newest complete checkpoint in %s instead",
                    pointer,
                    _short(e),
                    self.root,
                )
        ordered = sorted(complete, key=lambda c: c[1], reverse=True)
        if pointed is not None and pointed in complete:
            ordered.remove(pointed)
            ordered.insert(0, pointed)
        return ordered

    def complete_checkpoints(self) -> list[tuple[str, int]]:
        """``(folder, step)`` of every checkpoint marked complete, oldest first."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith("step-") and "." not in name and os.path.exists(os.path.join(path, COMPLETE)):
                try:
                    out.append((path, int(name.split("-")[1])))
                except ValueError:
                    continue
        return sorted(out, key=lambda x: x[1])

    # ---- loading ---------------------------------------------------------------------------------------------------
    def load_driver_state(self, path: str) -> dict[str, Any]:
        """The driver state saved in checkpoint ``path``; a :class:`CheckpointError` says what is wrong with it."""
        state_file = os.path.join(path, DRIVER_STATE)
        if not os.path.exists(state_file) and os.path.exists(os.path.join(path, LEGACY_DRIVER_STATE)):
            return _load_legacy(os.path.join(path, LEGACY_DRIVER_STATE))
        try:
            with open(os.path.join(path, COMPLETE), "rb") as f:
                complete = json.loads(f.read())
            with open(state_file, "rb") as f:
                raw = f.read()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path} cannot be read: {_short(e)}") from e
        expected = (complete.get("sha256") or {}).get(DRIVER_STATE) if isinstance(complete, dict) else None
        if expected is not None and hashlib.sha256(raw).hexdigest() != expected:
            raise CheckpointError(f"{state_file} is damaged (its checksum does not match the one saved with it)")
        try:
            state = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{state_file} is damaged: {_short(e)}") from e
        if not isinstance(state, dict) or "next_step" not in state:
            raise CheckpointError(f"{state_file} is not a hybrid driver state (no next_step)")
        return state

    def verify_files(self, path: str) -> int:
        """Check every file of checkpoint ``path`` against the sizes and checksums saved with it (a checkpoint of an
        older version has none: nothing to check); a :class:`CheckpointError` names the first that differs."""
        try:
            with open(os.path.join(path, COMPLETE), "rb") as f:
                manifest = json.loads(f.read()).get("files")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path} cannot be read: {_short(e)}") from e
        if not isinstance(manifest, dict):
            return 0
        found = checkpoint_files.problems(path, manifest)
        if found:
            more = f" (and {len(found) - 1} more file(s))" if len(found) > 1 else ""
            raise CheckpointError(f"{found[0]}{more}")
        return len(manifest)

    def resume_point(self, *, trusted: bool = False) -> tuple[str, int, dict[str, Any]] | None:
        """The newest checkpoint whose files read back, as ``(folder, step, state)``; None when there is no complete
        checkpoint. Damaged ones (a pointer, driver state or role file that does not read back, or a file that differs
        from its saved size and checksum) are skipped with a warning naming them; if every one is damaged, a
        :class:`CheckpointError` lists why. A role file that would run code (see :func:`verify_role_files`) raises
        :class:`UnsafeCheckpoint` at once."""
        problems = []
        for path, step in self.candidates():
            try:
                _only_regular_files(path)  # a FIFO would block the first read of it forever
                state = self.load_driver_state(path)
                self.verify_files(path)
                verify_role_files(path, trusted=trusted)
            except UnsafeCheckpoint:
                raise  # never fall back past a file that would run code: someone put it there
            except CheckpointError as e:
                problems.append(str(e))
                log.warning("checkpoint %s is unusable (%s); trying the previous one", path, e)
                continue
            if problems:
                log.warning("resuming from %s (step %d), the newest checkpoint that reads back", path, step)
            return path, step, state
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.root}: " + "; ".join(problems))
        return None

    # ---- housekeeping ----------------------------------------------------------------------------------------------
    def sweep_incomplete(self) -> list[str]:
        """Remove temp folders of saves that never finished (a crash mid-save)."""
        removed = []
        if os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".tmp-step-") or ".old-" in name:
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                    removed.append(name)
        return removed

    def prune(self, keep: int) -> None:
        """Delete the oldest complete checkpoints until ``keep`` are left, always keeping the newest one."""
        complete = self.complete_checkpoints()
        for path, _ in complete[: max(0, len(complete) - max(keep, 1))]:
            shutil.rmtree(path, ignore_errors=True)

    def clear(self) -> None:
        """Remove every checkpoint, temp folder and ``latest.json`` (``--overwrite``); other files stay."""
        if not os.path.isdir(self.root):
            return
        for name in os.listdir(self.root):
            if name.startswith(("step-", ".tmp-step-")) or name == LATEST:
                path = os.path.join(self.root, name)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)


#: The Python objects DeepSpeed's checkpoint files hold besides tensors and plain containers (an enum and small
#: records, inert when built). A role file that references anything else is refused before DeepSpeed unpickles it.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def verify_role_files(path: str, *, trusted: bool = False) -> int:
    """Prove that every ``*.pt`` file under checkpoint ``path`` unpickles with torch's ``weights_only`` loader
    (tensors, plain containers and :data:`DEEPSPEED_GLOBALS` only), before DeepSpeed loads them with
    ``weights_only=False``: the same pickle stream then cannot call anything else either. Files are memory-mapped,
    so the check reads the pickles, not the tensors. Returns the number of files checked; ``trusted`` skips it
    (``--trust_checkpoint``: checkpoints you wrote, from a DeepSpeed that stores other objects)."""
    import glob
    import importlib
    import pickle

    import torch

    files = sorted(glob.glob(os.path.join(path, "**", "*.pt"), recursive=True))
    if trusted or not files:
        return 0
    allowed = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            allowed.append((getattr(importlib.import_module(module), attr), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: it cannot have written that object
            continue
    for file in files:
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            try:
                names = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(file)) - set(DEEPSPEED_GLOBALS))
            except Exception:
                names = []
            shown = f" ({', '.join(names[:5])})" if names else ""
            raise UnsafeCheckpoint(
                f"{file} refers to Python objects DeepSpeed does not write{shown}; DeepSpeed would "
                "unpickle it and run them. Refused: resume only from checkpoints you wrote (if "
                "you wrote this one with another DeepSpeed version, --trust_checkpoint loads it)"
            ) from e
        except Exception as e:
            raise CheckpointError(f"{file} is damaged: {_short(e)}") from e
    return len(files)


def _only_regular_files(path: str) -> None:
    """Refuse a checkpoint (or pointer) holding anything but files and folders: opening a FIFO (or a device) for
    reading waits for a writer that never comes, which hung ``--resume`` silently. ``stat`` follows links, so a link
    to one is refused too."""
    import stat

    entries = (
        [path]
        if not os.path.isdir(path)
        else [os.path.join(root, n) for root, dirs, names in os.walk(path) for n in names + dirs]
    )
    for entry in entries:
        try:
            mode = os.stat(entry).st_mode
        except OSError as e:
            raise CheckpointError(f"{entry} cannot be read: {_short(e)}") from e
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise CheckpointError(
                f"{entry} is {kind}, not a file: reading it would wait forever (a checkpoint holds only files)"
            )


def _load_legacy(path: str) -> dict[str, Any]:
    """An older checkpoint's ``driver_state.pt``, read without unpickling anything but plain data."""
    import pickle

    import torch

    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(
            f"{path} holds objects other than plain data, and loading it would run code; "
            "refused. Resume only from checkpoints you wrote."
        ) from e
    except Exception as e:  # truncated or not a torch file
        raise CheckpointError(f"{path} is damaged: {_short(e)}") from e
    if not isinstance(state, dict) or "next_step" not in state:
        raise CheckpointError(f"{path} is not a hybrid driver state (no next_step)")
    return state


def out_of_space(error: BaseException, path: str) -> bool:
    """Whether ``error`` (or what caused it) is a write that failed for lack of disk space on ``path``'s disk.

    Torch reports a full disk as ``enforce fail at inline_container.cc ... file write failed`` and a remote role's
    failure arrives as text, so the message is read too; a write failure only counts when the disk is nearly full.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(cause)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        if ("file write failed" in text or "inline_container" in text) and _free_bytes(path) < 64 << 20:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _free_bytes(path: str) -> int:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return 0


def _folder_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _write_json(path: str, data: Any) -> str:
    """Write ``data`` as JSON via a temp file and a rename; returns the SHA-256 of what was written."""
    raw = json.dumps(_plain(data), allow_nan=True).encode("utf-8")
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return hashlib.sha256(raw).hexdigest()


def _plain(value: Any) -> Any:
    """JSON-ready plain data: tuples become lists, numpy/torch scalars numbers; anything else is an error."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value  # NaN / inf are written as JSON's NaN / Infinity, which json reads back
    if hasattr(value, "item") and callable(value.item):
        return _plain(value.item())
    raise TypeError(f"the driver state holds a {type(value).__name__}, which is not plain data: {value!r}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
