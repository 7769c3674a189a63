"""Which tensor pieces a weight sync checks: all of them, a rotating sample, or none (``--verify_weight_sync``).

Checking every piece of every sync reads the whole model twice more (the sender's bucket, the engine's parameters)
and launches a few kernels per piece on each side: on an H200, 1.9 GB synced in ~10 ms, that is far more than the 2 %
a check may cost (issue 34). The failures that matter most are not local, so a sample sees them:

* stale weights after a sleep, a load that never happened, a wrong name mapping, a LoRA adapter that never arrived
  -- they touch every piece (or every piece of a kind), so *any* sample catches them in the same sync;
* the first sync of a run (and the first after a resume, which starts a new run's count) checks every piece, so a
  broken loading path is caught before the first rollout;
* a single corrupted byte (the transport, the hardware) is caught only in a sync that samples its piece: every piece
  is sampled at least once every ``period`` syncs, so such damage can stay unseen for up to ``period - 1`` syncs
  (and is missed if the next sync overwrites it first). ``full`` checks every piece of every sync, at its price.

The sample: pieces, in stream order, go to ``period`` groups balanced by bytes (each to the group with the fewest
bytes so far: the same groups every sync, as the stream is the same); sync ``n >= 1`` checks group ``(n - 1) %
period``. The sender decides; a receiver is told which pieces it checks (``wire.py``).

``PERIOD`` (32): a sync then checks about 1/32 of the bytes (the largest tensors, e.g. an embedding, form groups of
their own) and ~1/32 of the pieces' kernel launches: on the H200 bench that is what brings the check within 2 % of
the sync's time (``bench/weight_sync.py`` measures both modes); a corrupted byte is found within 32 syncs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import ConfigError

MODES = ("full", "sampled", "off")
PERIOD = 32


@dataclass(frozen=True)
class VerifyPolicy:
    """What one sync checks: ``mode`` full | sampled | off; ``sync``: this sync's number in the run (0: the first,
    checked in full); ``period``: sampled mode's rotation."""

    mode: str = "sampled"
    sync: int = 0
    period: int = PERIOD

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(
                "verify_weight_sync",
                f"{self.mode!r} is not one of {', '.join(MODES)}.",
                "Use --verify_weight_sync full, sampled (the default) or off.",
            )
        if self.period < 1 or self.sync < 0:
            raise ConfigError(
                "verify_weight_sync",
                f"period {self.period} and sync {self.sync} must be >= 1 and >= 0.",
                "Build it with as_policy(mode, sync).",
            )

    @property
    def active(self) -> bool:
        return self.mode != "off"


def as_policy(verify: bool | str | VerifyPolicy | None, sync: int = 0) -> VerifyPolicy:
    """``verify`` as a policy: a policy as it is; a mode name at sync ``sync``; True: every piece (what a caller of
    the sender that counts no syncs asks for), False / None: nothing."""
    if isinstance(verify, VerifyPolicy):
        return verify
    if verify is None or verify is False:
        return VerifyPolicy("off")
    if verify is True:
        return VerifyPolicy("full")
    return VerifyPolicy(str(verify), sync)


def mode_of(value: bool | str | None) -> str:
    """A ``verify_weight_sync`` setting as a mode name (True, from configs written before the modes: the default)."""
    if value is True:
        return "sampled"
    if value is False or value is None:
        return "off"
    if value not in MODES:
        raise ConfigError(
            "verify_weight_sync",
            f"{value!r} is not one of {', '.join(MODES)}.",
            "Use --verify_weight_sync full, sampled (the default) or off.",
        )
    return str(value)


class Rotation:
    """Feed the pieces' sizes in stream order; ``take`` says whether this sync checks each one.

    The groups of the last stream seen are kept (per period): a sync whose stream is the same as the last one's (the
    usual case) reads its groups back instead of balancing again (no per-piece search on the sync's path)."""

    def __init__(self, policy: VerifyPolicy):
        self.policy = policy
        self.group = (policy.sync - 1) % policy.period
        self.count = 0
        self.loads: list[int] | None = None  # set once the stream leaves the remembered one
        groups = _LAST.__dict__.setdefault("groups", {})
        self.known = groups.setdefault(policy.period, [])

    def take(self, nbytes: int) -> bool:
        p = self.policy
        if not p.active:
            return False
        if p.mode == "full":
            return True
        i, self.count = self.count, self.count + 1
        if self.loads is None and i < len(self.known) and self.known[i][0] == nbytes:
            g = self.known[i][1]
        else:
            if self.loads is None:  # a new stream from here on: balance again, from what came before
                self.loads = [0] * p.period
                for size, group in self.known[:i]:
                    self.loads[group] += size
                del self.known[i:]
            g = min(range(p.period), key=self.loads.__getitem__)  # the lightest group so far (lowest on ties)
            self.loads[g] += nbytes
            self.known.append((nbytes, g))
        return p.sync == 0 or g == self.group


# per thread and period: (bytes, group) of each piece of the last stream balanced
_LAST = threading.local()
