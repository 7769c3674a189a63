"""Which tensor pieces a weight sync checks: all of them, a rotating sample, or none (``sync.verify``).

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

The sample: the stream's bytes are cut into ``period`` contiguous groups of pieces (:class:`Rotation`); sync
``n >= 1`` checks group ``(n - 1) % period``. The sender decides; a receiver is told which pieces it checks
(``wire.py``).

``PERIOD`` (32): a sync checks 1/32 of the bytes on average, in one or two buckets (one fused checksum launch each
per side); a corrupted byte is found within 32 syncs. ``bench/weight_sync.py`` measures the cost of both modes.
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
                "sync.verify",
                f"{self.mode!r} is not one of {', '.join(MODES)}.",
                "Use sync.verify full, sampled (the default) or off.",
            )
        if self.period < 1 or self.sync < 0:
            raise ConfigError(
                "sync.verify",
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
            "sync.verify",
            f"{value!r} is not one of {', '.join(MODES)}.",
            "Use sync.verify full, sampled (the default) or off.",
        )
    return str(value)


class Rotation:
    """Feed the pieces' sizes in stream order; ``take`` says whether this sync checks each one.

    The groups are contiguous: the piece starting at byte ``c`` of the stream is in group ``min(period - 1,
    c * period // T)``, ``T`` being the size of the last stream seen (per thread and period; the stream is the same
    every sync, so the groups are too). A sync's pieces are therefore neighbours, in one bucket or two: the checksums
    of a sync cost one fused launch per bucket on each side (``checksum_kernel.py``), not one per piece. A group holds
    at most ``T / period`` bytes plus its last piece; a piece larger than that leaves the next groups empty (those
    syncs check nothing), so every sync checks ``1 / period`` of the bytes on average."""

    def __init__(self, policy: VerifyPolicy):
        self.policy = policy
        self.group = (policy.sync - 1) % policy.period
        self.offset = 0
        self.totals: dict[int, int] = _LAST.__dict__.setdefault("totals", {})
        self.total = self.totals.get(policy.period)  # None: no stream seen yet in this thread

    def take(self, nbytes: int) -> bool:
        p = self.policy
        start, self.offset = self.offset, self.offset + nbytes
        self.totals[p.period] = self.offset  # at the stream's end: its size, for the next sync's groups
        if not p.active:
            return False
        if p.mode == "full" or p.sync == 0 or not self.total:  # no stream seen yet: the groups are unknown, check all
            return True
        return bool(min(p.period - 1, start * p.period // self.total) == self.group)


# per thread: the size of the last stream seen, per period
_LAST = threading.local()
