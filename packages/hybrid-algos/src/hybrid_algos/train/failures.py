"""How a run that fails after it started ends: one error naming what failed, where the details are, and the
checkpoint to continue from -- the same shape as the errors before the start, whatever raised.

A hybrid error (a late or dead role, a bad reward) keeps its type; anything else (a bug, a library's exception)
becomes a :class:`RunFailure` whose traceback is written to the run's log folder rather than lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from hybrid_core.errors import ConfigError, HybridError, RemoteTimeout, RoleFailure, TurnTimeout


class RunFailure(HybridError, RuntimeError):
    """A run ended by an error that is not one of hybrid's own (the message says where its traceback is)."""


def resume_hint(ckpt: Any) -> str:
    """The sentence telling how to continue: the last complete checkpoint and ``--resume``, or that there is none."""
    try:
        latest = ckpt.latest()
    except Exception:  # a damaged checkpoint folder must not hide the error being reported
        latest = None
    if latest:
        return f"The last complete checkpoint is {latest[0]} (step {latest[1]}): continue with --resume."
    return "No checkpoint was saved yet (--save_steps N saves one every N steps)."


def saved_hint(ckpt: Any, run_dir: str | None = None, *, since: float | None = None) -> str:
    """What an interrupted or failed run leaves: the final model when it was saved (by this run: newer than
    ``since``, Unix seconds), then :func:`resume_hint` -- or, with a final model but no checkpoint, that there is
    nothing to continue (the run was complete)."""
    final = os.path.join(run_dir, "final") if run_dir else ""
    try:
        saved = bool(final) and os.path.isdir(final) and (since is None or os.path.getmtime(final) >= since - 1)
    except OSError:
        saved = False
    hint = resume_hint(ckpt)
    if not saved:
        return hint
    if hint.startswith("No checkpoint"):
        return f"The final model was saved: {final} (no checkpoint was written, so there is no run to continue)."
    return f"The final model was saved: {final}. {hint}"


def wants_stacks(error: BaseException) -> bool:
    """Whether the roles' stacks help explain ``error``: something late or dead, not a reward function's bug."""
    return isinstance(error, (RemoteTimeout, RoleFailure, TurnTimeout)) or bool(getattr(error, "dump_stacks", False))


def write_traceback(log_dir: str, error: BaseException) -> str:
    """Append ``error``'s traceback to ``<log_dir>/error.txt``; returns the path ('' if it cannot be written)."""
    path = os.path.join(log_dir, "error.txt")
    try:
        os.makedirs(log_dir, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
            f.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    except OSError:
        return ""
    return path


def write_driver_stacks(log_dir: str) -> str:
    """Every thread of this (the driver's) process into ``<log_dir>/stacks-driver.txt``; returns the path."""
    path = os.path.join(log_dir, "stacks-driver.txt")
    lines = [f"=== driver pid {os.getpid()} at {time.strftime('%H:%M:%S')} ==="]
    for thread_id, frame in sys._current_frames().items():
        lines.append(f"--- thread {thread_id} ---")
        lines.extend(line.rstrip() for line in traceback.format_stack(frame))
    try:
        os.makedirs(log_dir, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    except OSError:
        return ""
    return path


def explain(label: str, error: Exception, *, log_dir: str, ckpt: Any, stacks: str = "") -> HybridError:
    """The error that ends the run: ``<label> failed: <what>``, then the stacks' place (when dumped), where an
    unexpected error's traceback went, and :func:`resume_hint`. ``error`` becomes its ``__cause__``."""
    resume = resume_hint(ckpt)
    tail = f"{stacks} {resume}".strip()
    if isinstance(error, ConfigError):
        return ConfigError(error.field, f"{label} failed: {error.problem} {tail}", error.fix)
    if isinstance(error, HybridError):
        message = f"{label} failed: {error} {tail}"
        try:
            return type(error)(message)
        except TypeError:  # an error type with its own constructor arguments
            return RunFailure(message)
    where = write_traceback(log_dir, error)
    detail = f" (traceback: {where})" if where else ""
    text = str(error).strip().splitlines()
    return RunFailure(f"{label} failed: {type(error).__name__}: {text[0] if text else ''}{detail}. {tail}")


class Terminated(KeyboardInterrupt):
    """SIGTERM: the run stops (after the checkpoint of :class:`Preemption`), cleans up (roles, engines, Ray) and the
    command exits 143. ``note``: what happened to that checkpoint, when it could not be saved."""

    def __init__(self, note: str = ""):
        super().__init__(note)
        self.note = note


class ClusterLost(HybridError, ConnectionError):
    """Ray's GCS (the cluster's head process) stopped answering: no Ray call can succeed any more."""


class Preemption:
    """SIGTERM is how a scheduler takes the machine back (SLURM, Kubernetes, systemd, ``kill -- -PGID``), so it
    ends the run without losing its finished steps.

    Outside a step (start-up, the final save, tear-down) it raises :class:`Terminated` at once. During a step
    (``deferring``, set by the loop) it is noted and the step runs to its end: a step stopped halfway would leave the
    trainer's weights updated by half of it, which no checkpoint can hold. The loop then saves a checkpoint (when a
    step finished since the last one) and raises :class:`Terminated`; the step and that save are bounded by the
    step budget (``--step_timeout_s``). A second SIGTERM stops at once, without the checkpoint; after that, further
    ones are ignored while the run cleans up (SIGKILL still ends it)."""

    def __init__(self) -> None:
        self.requested_at: float | None = None
        self.deferring = False
        self.step = 0  # the step running (1-based), for the line said on SIGTERM
        self._forced = False

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def handler(self, signum: int, frame: Any) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            if self.deferring:
                print(
                    f"hybrid: SIGTERM: finishing step {self.step}, then saving a checkpoint and stopping "
                    "(SIGTERM again: stop at once, without it)",
                    file=sys.stderr,
                    flush=True,
                )
                return
            raise Terminated()
        if self.deferring and not self._forced:
            self._forced = True
            self.deferring = False
            raise Terminated("a second SIGTERM stopped the run before its checkpoint")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[Preemption]:
    """Within the block, SIGTERM is handled by the :class:`Preemption` yielded. ``ray.init`` installs its own handler,
    which kills Ray's processes under the running code and prints Ray's crash dumps, so this is (re)installed after
    Ray is connected. Outside the main thread nothing is installed (the object is still yielded)."""
    preemption = Preemption()
    if threading.current_thread() is not threading.main_thread():
        yield preemption
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, preemption.handler)
    try:
        yield preemption
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
