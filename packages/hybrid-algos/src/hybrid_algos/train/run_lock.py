"""One run per folder: ``.hybrid-run.lock`` in the run folder (and in ``--ckpt_path`` when it is elsewhere).

Two runs writing one folder at once destroy each other without either failing: their metrics interleave, each
prunes the other's checkpoints, an ``--overwrite`` deletes files under the running process. So a run takes the
folder's lock before it reads or writes anything there, and a second run is refused at once, naming the first
(pid, host, start time, command).

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic, also on NFS v3+), holding its owner's pid, host,
boot id, pid namespace and process start time. It is removed when the run ends; one left by a run that died
(SIGKILL, a crashed machine) never blocks the next run:

* same machine (host name, boot id and pid namespace all match): the owner is alive only if its pid is, *and* that
  pid is the same process (its start time matches; pids are reused);
* another machine: the owner touches the file every :data:`HEARTBEAT_S` seconds; a lock not touched for
  :data:`STALE_S` seconds is stale (generous: the hosts' clocks may differ by minutes).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from hybrid_core.errors import ConfigError

log = logging.getLogger(__name__)

LOCK = ".hybrid-run.lock"
HEARTBEAT_S = 30.0
STALE_S = 600.0
#: A lock file without its content yet (its owner is between creating and writing it) is that young at most.
_BEING_WRITTEN_S = 10.0


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # the fields after "pid (comm)": state is field 3, starttime 22


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def describe(owner: dict[str, Any]) -> str:
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    command = f" ({owner['command']})" if owner.get("command") else ""
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, started {when}{command}"


class RunLock:
    """The lock of one folder; :meth:`acquire` raises a :class:`ConfigError` naming ``field`` when it is held."""

    def __init__(self, folder: str, field: str = "save_path"):
        self.folder = os.path.abspath(folder)
        self.path = os.path.join(self.folder, LOCK)
        self.field = field
        self.token = uuid.uuid4().hex
        self.held = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def mine(self) -> dict[str, Any]:
        from .redact import redact_argv

        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "pid_ns": _pid_namespace(),
            "process_start": process_start(os.getpid()),
            "started": time.time(),
            "token": self.token,
            "command": " ".join(redact_argv(sys.argv))[:300],
        }

    def acquire(self) -> RunLock:
        for _ in range(5):  # another process may take a stale lock between our look and our try
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._clear_if_stale()
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.mine(), f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            self._beat = threading.Thread(target=self._heartbeat, name="hybrid-run-lock", daemon=True)
            self._beat.start()
            return self
        raise ConfigError(
            self.field,
            f"{self.folder} is being taken by other runs right now ({self.path} keeps reappearing).",
            f"Start one run per folder, or give this one another --{self.field}.",
        )

    def _clear_if_stale(self) -> None:
        """Refuse a live owner; remove the lock of one that is gone (only that lock, never a newer one)."""
        raw, owner, age = self._read()
        if raw is None:  # removed meanwhile: try again
            return
        verdict = self._owner_gone(owner, age)
        if verdict is None:
            what = describe(owner) if owner else f"its lock {self.path} is being written"
            raise ConfigError(
                self.field,
                f"{self.folder} is in use by another run: {what}. Two runs in one folder "
                "would overwrite each other's metrics and checkpoints.",
                f"Wait for that run to end (or stop it), or give this run another --{self.field}. "
                f"If that run is gone for sure, delete {self.path}.",
            )
        log.warning(
            "%s: removing the lock of a run that is gone (%s: %s)",
            self.folder,
            describe(owner) if owner else "an unreadable lock",
            verdict,
        )
        aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)  # atomic: of two runs clearing it, one succeeds
        except FileNotFoundError:
            return
        with open(aside, "rb") as f:
            if f.read() != raw:  # a newer lock took its place between our read and the rename: put it back
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
        os.remove(aside)

    def _read(self) -> tuple[bytes | None, dict[str, Any] | None, float]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None, None, 0.0
        try:
            owner = json.loads(raw)
        except ValueError:
            owner = None
        return raw, owner if isinstance(owner, dict) else None, age

    def _owner_gone(self, owner: dict[str, Any] | None, age: float) -> str | None:
        """Why the lock's owner is gone, or None when it may be alive."""
        if owner is None:
            return f"unreadable and {age:.0f} s old" if age > _BEING_WRITTEN_S else None
        same_machine = (
            owner.get("host") == socket.gethostname()
            and owner.get("boot_id") == _boot_id()
            and owner.get("pid_ns") == _pid_namespace()
        )
        if same_machine:
            pid = owner.get("pid")
            if not isinstance(pid, int) or not _pid_alive(pid):
                return f"no process {pid} on this machine"
            if owner.get("process_start") is not None and process_start(pid) not in (None, owner["process_start"]):
                return f"pid {pid} is another process now"
            return None
        if owner.get("host") == socket.gethostname() and owner.get("boot_id") != _boot_id():
            return "this machine restarted since"
        if age > STALE_S:
            return f"another machine's lock, not refreshed for {age:.0f} s"
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Remove the lock if it is still this run's (never another's that replaced it)."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        try:
            with open(self.path, "rb") as f:
                owner = json.loads(f.read())
            if isinstance(owner, dict) and owner.get("token") == self.token:
                os.remove(self.path)
        except (OSError, ValueError):
            pass


class RunLocks:
    """The locks of a run's folders, released together (a context manager, and safe to release twice)."""

    def __init__(self) -> None:
        self.locks: list[RunLock] = []

    def take(self, folder: str, field: str) -> None:
        folder = os.path.abspath(folder)
        if any(lock.folder == folder for lock in self.locks):
            return
        self.locks.append(RunLock(folder, field).acquire())

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> RunLocks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
