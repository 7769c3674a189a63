"""Every process a run started on this node, found by a tag in its environment, and ended when the run ends.

Ray kills an actor's own process (``ray.kill``, ``ray.shutdown``), but not what that process started: vLLM's engine
core and tensor-parallel workers, SGLang's scheduler, a DataLoader's workers. Killed from under them, those are
re-parented and keep their GPU memory (seen: 15 processes holding 59 GiB after a failed start on 4 H100s). So every
worker a run starts gets ``HYBRID_RUN_TAG=<a fresh id>`` in its environment (:func:`hybrid_core.runtime_env
.set_worker_env`), which its children inherit, and at the very end the run ends whatever still carries its tag
(:func:`end_leftovers`: SIGTERM, a short grace, then SIGKILL). Processes of other runs or users are never touched:
their tag differs, and /proc does not show another user's environment.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid

log = logging.getLogger(__name__)

RUN_TAG_ENV = "HYBRID_RUN_TAG"


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged(tag: str) -> list[int]:
    """Live processes on this node whose environment holds ``HYBRID_RUN_TAG=tag`` (never this process)."""
    marker = f"{RUN_TAG_ENV}={tag}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            if _zombie(int(entry)):  # exited, waiting for its parent to reap it: holds no memory
                continue
        except OSError:  # gone, or not ours to read
            continue
        found.append(int(entry))
    return found


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X")


def end_leftovers(tag: str, *, grace_s: float = 3.0, wait_s: float = 5.0) -> list[int]:
    """SIGTERM every process still tagged ``tag``, SIGKILL those left after ``grace_s``; returns those still alive
    ``wait_s`` later (logged: they need a manual ``kill``)."""
    pids = tagged(tag)
    if not pids:
        return []
    log.info("ending %d leftover process(es) of the run: %s", len(pids), " ".join(map(str, pids)))
    _signal(pids, signal.SIGTERM)
    left = _wait_gone(tag, grace_s)
    if left:
        _signal(left, signal.SIGKILL)
        left = _wait_gone(tag, wait_s)
    if left:
        log.warning(
            "processes of this run are still alive after SIGKILL: %s (kill -9 them; on a GPU node they may "
            "hold GPU memory)",
            " ".join(map(str, left)),
        )
    return left


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(tag: str, seconds: float) -> list[int]:
    ends = time.monotonic() + seconds
    while True:
        left = tagged(tag)
        if not left or time.monotonic() >= ends:
            return left
        time.sleep(0.1)
