"""What every offloader offers: the trainer and the engines only need these two calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..stats import TransferStats


@runtime_checkable
class Sleepable(Protocol):
    """Something that can give its device memory back (``sleep``) and take it again (``wake``)."""

    def sleep(self) -> TransferStats: ...

    def wake(self) -> TransferStats: ...


@runtime_checkable
class StateMover(Protocol):
    """A role's states, moved by name for the residency owner (:mod:`hybrid_core.residency`): ``offload(["optimizer"])``
    moves those states to host memory, ``reload()`` brings back everything offloaded."""

    def offload(self, states: Sequence[str]) -> TransferStats: ...

    def reload(self, states: Sequence[str] | None = None) -> TransferStats: ...
