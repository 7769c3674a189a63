"""What a transfer moved and how long it took, for the step timeline."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TransferStats:
    """Bytes moved by one offload / reload / weight-sync call and its wall time."""

    bytes: int
    seconds: float
    what: str = ""

    @property
    def gbps(self) -> float:
        """Effective rate in GB/s (10^9 bytes per second); 0.0 when nothing was timed."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __add__(self, other: TransferStats) -> TransferStats:
        return TransferStats(self.bytes + other.bytes, self.seconds + other.seconds, self.what or other.what)

    def as_dict(self) -> dict[str, Any]:
        return {"what": self.what, "bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps}


@dataclass
class PhaseTimer:
    """Accumulates seconds and bytes per named phase (generate, sleep, wake, infer, train, sync).

    ``spans`` keeps each timed block as (phase, start, end) in wall-clock (Unix) seconds, so that what other
    processes saw at the same moment (a GPU memory sampler, say) can be attributed to the phase.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    spans: list[tuple[str, float, float]] = field(default_factory=list)

    def add(self, phase: str, seconds: float, nbytes: int = 0, *, end: float | None = None) -> None:
        """Add a block of ``seconds`` that ended at ``end`` (Unix time; now if not given)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.bytes[phase] = self.bytes.get(phase, 0) + nbytes
        end = time.time() if end is None else end
        self.spans.append((phase, end - seconds, end))

    def phase(self, name: str) -> _Phase:
        """``with timer.phase("generate"): ...`` adds the block's wall time to ``name``."""
        return _Phase(self, name)

    def total(self) -> float:
        return sum(self.seconds.values())


class _Phase:
    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> _Phase:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.add(self.name, time.perf_counter() - self.start)
