"""Errors that say what is wrong and how to fix it.

Every exception raised for bad user input or a failed role names the field (or role, phase, rank) and the fix.
Configuration errors are raised before Ray starts or any GPU is taken.
"""

from __future__ import annotations


class HybridError(Exception):
    """Base class of every error raised by hybrid."""


class ConfigError(HybridError, ValueError):
    """A configuration value, flag or file is invalid.

    ``field`` names the offending setting (e.g. ``"vllm_num_engines"``) so callers and tests can check it.
    """

    def __init__(self, field: str, problem: str, fix: str | None = None):
        self.field = field
        self.problem = problem
        self.fix = fix
        message = f"{field}: {problem}"
        if fix:
            message += f" Fix: {fix}"
        super().__init__(message)

    # raised in a Ray worker, it crosses to the driver pickled: rebuild from our arguments
    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str | None]]:
        return (type(self), (self.field, self.problem, self.fix))


class PlacementError(ConfigError):
    """A placement spec cannot be laid out on the cluster (arithmetic, ranges, sizes)."""


class TurnTimeout(HybridError, TimeoutError):
    """A role waited too long for its turn on a GPU; the message names the role holding it."""


class RemoteTimeout(HybridError, TimeoutError):
    """A Ray call or a collective did not finish within its deadline; the message names what was waited for."""


class RoleFailure(HybridError, RuntimeError):
    """A role's actor died or raised; the message names the role, the phase and the rank."""


class WeightSyncMismatch(RoleFailure):
    """After a weight sync an engine does not hold what the trainer sent (a checksum differs); the message names the
    parameter(s) and the engine (see ``hybrid_core.weight_sync.verify``)."""


class GpuMemoryError(HybridError, MemoryError):
    """A role cannot wake: its GPU lacks the free memory it needs; the message names who holds that memory."""
