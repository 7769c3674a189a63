"""What every offloader offers: the trainer and the engines only need these two calls."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..stats import TransferStats


@runtime_checkable
class Sleepable(Protocol):
    """Something that can give its device memory back (``sleep``) and take it again (``wake``)."""

    def sleep(self) -> TransferStats: ...

    def wake(self) -> TransferStats: ...
