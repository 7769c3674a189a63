"""The one error the math raises for bad input.

``hybrid_algos`` (the math) imports torch only, so it cannot use ``hybrid_core.errors``; :class:`AlgoInputError`
mirrors ``hybrid_core.errors.ConfigError`` (``field``, ``problem``, ``fix``) so callers can handle both alike.
"""

from __future__ import annotations


class AlgoInputError(ValueError):
    """An argument of an algorithm function is invalid (shape, dtype, device, NaN/inf, unknown name).

    ``field`` names the offending argument (e.g. ``"response_mask"``) so callers and tests can check it.
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
    def __reduce__(self) -> tuple[type[AlgoInputError], tuple[str, str, str | None]]:
        return (type(self), (self.field, self.problem, self.fix))
