"""Test-only fault injection: make a role hang, die or raise in a named phase, so that the reliability paths
(timeouts, stack dumps, dead actors, resume) can be tested on real processes instead of mocks.

Set ``HYBRID_FAULT`` in the driver's environment (it reaches every worker through :mod:`hybrid_core.runtime_env`)::

    HYBRID_FAULT=actor:train:hang          # every actor rank hangs in its first `train` call
    HYBRID_FAULT=actor/1:train:die:2       # actor rank 1 exits (os._exit) in its 2nd `train` call
    HYBRID_FAULT=critic:values:raise,actor:sleep:hang:3   # several faults, comma-separated
    HYBRID_FAULT=rollout/1:create:die      # engine 1 exits while it is being built (start-up)
    HYBRID_FAULT=receiver:bucket:corrupt:3  # a weight-sync receiver flips a byte of the 3rd bucket it receives

``role[/rank]:phase:action[:nth]``; ``action`` is ``hang`` (sleep forever), ``die`` (exit the process at once, like
a SIGKILL, after one line on stderr: what a crashing library leaves) or ``raise`` (a RuntimeError); ``nth`` counts
the calls of that phase in that process (default 1). A phase is a role worker's method (``train``, ``setup``, ...),
an engine's ``generate``, or ``create``: the actor's constructor (a role worker or an engine being built).
``corrupt`` is acted out by the code that holds the data (:func:`corrupt_due`): the weight-sync receivers (role
``receiver``, phase ``bucket``, rank = the weight-sync group rank; IPC receivers have none) flip one byte of a bucket
after it arrived, before it is loaded, which the sync's verification must catch.
Unset (the normal case) costs one dict lookup per call. Never set it outside tests.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

from .errors import ConfigError

ENV = "HYBRID_FAULT"
ACTIONS = ("hang", "die", "raise", "corrupt")


@dataclass(frozen=True)
class Fault:
    role: str
    rank: int | None
    phase: str
    action: str
    nth: int = 1


def parse_faults(text: str | None) -> list[Fault]:
    """The faults in a ``HYBRID_FAULT`` value (empty for None or "")."""
    faults = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        parts = item.strip().split(":")
        if len(parts) not in (3, 4):
            raise ConfigError(ENV, f"{item!r} is not role[/rank]:phase:action[:nth].", "E.g. actor:train:hang.")
        who, phase, action = parts[:3]
        role, _, rank = who.partition("/")
        if action not in ACTIONS or not role or not phase or (rank and not rank.isdigit()):
            raise ConfigError(
                ENV,
                f"{item!r}: action must be one of {', '.join(ACTIONS)}, rank a number.",
                "E.g. actor/0:train:die:2.",
            )
        nth = parts[3] if len(parts) == 4 else "1"
        if not nth.isdigit() or int(nth) < 1:
            raise ConfigError(ENV, f"{item!r}: nth must be a whole number >= 1.", "E.g. actor:train:hang:2.")
        faults.append(Fault(role, int(rank) if rank else None, phase, action, int(nth)))
    return faults


_calls: Counter[tuple[str, ...]] = Counter()  # (role, phase) and (role, phase, "corrupt")
_lock = threading.Lock()


def maybe_inject(role: str, phase: str, rank: int | None = None) -> None:
    """Called by a worker when it enters ``phase``; acts out a matching fault from ``HYBRID_FAULT``, if any."""
    text = os.environ.get(ENV)
    if not text:
        return
    matching = [
        f
        for f in parse_faults(text)
        if f.role == role and f.phase == phase and f.rank in (None, rank) and f.action != "corrupt"
    ]
    if not matching:
        return
    with _lock:
        _calls[(role, phase)] += 1
        count = _calls[(role, phase)]
    for fault in matching:
        if fault.nth == count:
            _act(fault, role, phase, rank)


def corrupt_due(role: str, phase: str, rank: int | None = None) -> bool:
    """True when a ``corrupt`` fault of ``HYBRID_FAULT`` is due in this call (counted like :func:`maybe_inject`'s);
    the caller then damages its data."""
    text = os.environ.get(ENV)
    if not text:
        return False
    matching = [
        f
        for f in parse_faults(text)
        if f.role == role and f.phase == phase and f.rank in (None, rank) and f.action == "corrupt"
    ]
    if not matching:
        return False
    with _lock:
        _calls[(role, phase, "corrupt")] += 1
        count = _calls[(role, phase, "corrupt")]
    return any(f.nth == count for f in matching)


def _act(fault: Fault, role: str, phase: str, rank: int | None) -> None:
    if fault.action == "die":
        print(f"injected fault ({ENV}): {role} rank {rank} exits in {phase}", file=sys.stderr, flush=True)
        time.sleep(1.0)  # Ray copies a worker's stderr into its log file from a thread: let the line get there
        os._exit(1)  # no clean-up, no exception: what a killed process looks like to the others
    if fault.action == "raise":
        raise RuntimeError(f"injected fault ({ENV}): {role} rank {rank} failed in {phase}")
    while True:  # hang: a stack dump shows this frame
        time.sleep(1.0)
