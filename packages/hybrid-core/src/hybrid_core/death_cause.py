"""Why a Ray actor died, in one line: what a "role died" error names.

Ray's error for an actor whose process exited (``os._exit``, a segfault, the OOM killer, a library aborting in a
child process) only says that the worker "unexpectedly exits"; the cause is the last thing the process wrote to its
stderr (vLLM's ``Address already in use``, CUDA's ``out of memory``). Ray keeps that in the node's log folder as
``worker-<id>-<job>-<pid>.err``: for an actor on the driver's node, its last line is read from there. An exception
raised in the actor (also in its constructor) is named by Ray's own message, whose last line is the exception.
"""

from __future__ import annotations

import glob
import os
import re
import time

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: lines Ray writes into a worker's log itself: not the cause
_RAY_MARKERS = (":job_id:", ":actor_name:", ":task_name:", ":task_attempt")


def death_cause(error: BaseException) -> str:
    """The last line that explains ``error`` (a Ray actor error): the exception's own last line, or, for a process
    that died without one, its last stderr line (on this node), else Ray's exit detail."""
    text = _ANSI.sub("", str(error)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last = lines[-1] if lines else type(error).__name__
    if "worker process has died" not in text and "unexpectedly" not in text:
        return last  # an exception in the actor: Ray's text ends with it
    pid = _pid(text)
    line = _wait_for_last_line(pid) if pid else ""
    if line:
        return f"{line} (the last line pid {pid} wrote to stderr)"
    detail = re.search(r"Worker exit detail: ([^.]*)", text)
    return f"its process {pid or ''} exited: {detail.group(1)}".replace("  ", " ") if detail else last


def _wait_for_last_line(pid: int, wait_s: float = 5.0) -> str:
    """The dead process's last stderr line, waiting up to ``wait_s`` for it: Ray may report the death before the
    worker's log file holds what the process wrote just before it exited (seen on a loaded 2-core machine)."""
    deadline = time.monotonic() + wait_s
    while True:
        line = last_log_line(pid)
        if line or time.monotonic() >= deadline:
            return line
        time.sleep(0.1)


def _pid(text: str) -> int | None:
    found = re.search(r"\bpid[:=]\s*(\d+)", text)
    return int(found.group(1)) if found else None


def last_log_line(pid: int, logs_dir: str | None = None) -> str:
    """The last line process ``pid`` (a Ray worker on this node) wrote to stderr; '' when not found."""
    logs_dir = logs_dir or _logs_dir()
    if not logs_dir:
        return ""
    for path in sorted(glob.glob(os.path.join(logs_dir, f"worker-*-{pid}.err")), key=os.path.getmtime, reverse=True):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 16384))
                tail = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        for line in reversed(tail.splitlines()):
            line = _ANSI.sub("", line).strip()
            if line and not line.startswith(_RAY_MARKERS):
                return line[:500]
    return ""


def _logs_dir() -> str:
    try:
        import ray

        node = ray._private.worker._global_node  # the node this driver started or joined
        return node.get_logs_dir_path() if node is not None else ""
    except Exception:  # no Ray, or a Ray without this internal: Ray's own message then
        return ""
