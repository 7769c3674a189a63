"""hybrid's own environment interface: the smallest thing a multi-turn task needs.

An environment is any class (or factory) callable with no arguments; one instance serves one sample::

    class Environment:
        async def reset(self, prompt: str, label) -> str | None:
            '''The sample starts: its prompt text and label. Return a new first message (rendered like the
            prompts, through the chat template when the run uses one), or None to keep the prompt as it is.'''

        async def step(self, action: str) -> StepResult:
            '''The model's turn, as text (special tokens kept, without its final stop token). Return the
            environment's reply, this turn's reward and whether the sample is done.'''

``reset`` and ``step`` may be plain ``def`` (they then run in a worker thread, so a blocking call does not hold
the other samples up) or ``async def``. ``step`` may return a :class:`StepResult`, a ``(feedback, reward, done)``
tuple or a dict with those keys (and ``info``). The sample's reward is the sum of its turns' rewards.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class StepResult:
    """What the environment answers to one model turn.

    ``feedback`` is appended to the conversation (not trained on: its tokens are masked out of the loss and the KL);
    ``role`` is the chat role it is rendered with when the run uses a chat template; ``info`` holds numbers logged
    as ``agent/info/<key>`` (the last turn's, averaged over the step's samples).
    """

    feedback: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)
    role: str = "user"


@runtime_checkable
class Environment(Protocol):
    """One sample's environment (see the module docstring)."""

    def reset(self, prompt: str, label: Any) -> Any: ...

    def step(self, action: str) -> Any: ...


STEP_SHAPE = (
    "a StepResult(feedback=str, reward=float, done=bool), a (feedback, reward, done) tuple, or a dict "
    "with 'feedback', 'reward' and 'done' (and optionally 'info')"
)


class ShapeError(ValueError):
    """An environment answered in a shape the loop cannot use; the message says what was expected."""


def require_keys(value: Mapping, keys: Sequence[str], what: str, expected: str = "") -> None:
    """A :class:`ShapeError` naming the keys of ``keys`` that the dict ``what`` returned lacks (and the ones it has)."""
    missing = [k for k in keys if k not in value]
    if missing:
        raise ShapeError(
            f"{what} returned a dict without {', '.join(map(repr, missing))} (keys: "
            f"{sorted(map(str, value))}){'; it must return ' + expected if expected else ''}"
        )


def as_number(value: Any, what: str) -> float:
    """A finite float from a Python number, a 0-d / one-element tensor or array; else :class:`ShapeError`."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        out = float(value)
    elif hasattr(value, "numel") and hasattr(value, "item"):  # torch
        if value.numel() != 1:
            raise ShapeError(f"{what} is a tensor of shape {tuple(value.shape)}; it must hold one number")
        out = float(value.item())
    elif hasattr(value, "size") and hasattr(value, "item"):  # numpy
        if value.size != 1:
            raise ShapeError(f"{what} is an array of {value.size} numbers; it must hold one number")
        out = float(value.item())
    else:
        raise ShapeError(f"{what} is a {type(value).__name__} ({_short(value)}); it must be a number")
    if not math.isfinite(out):
        raise ShapeError(f"{what} is {out}; it must be a finite number")
    return out


def as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if hasattr(value, "item") and getattr(value, "numel", lambda: getattr(value, "size", 2))() == 1:
        return bool(value.item())
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise ShapeError(f"{what} is a {type(value).__name__} ({_short(value)}); it must be True or False")


def as_text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    raise ShapeError(f"{what} is a {type(value).__name__} ({_short(value)}); it must be a str")


def numbers_of(values: Any, what: str) -> dict[str, float]:
    """A dict of numbers to log (tensors of one element become floats); anything else is a :class:`ShapeError`."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ShapeError(f"{what} is a {type(values).__name__}; it must be a dict of numbers")
    return {str(k): as_number(v, f"{what}[{k!r}]") for k, v in values.items()}


def coerce_step(value: Any) -> StepResult:
    """The :class:`StepResult` an environment's ``step`` answer stands for, or a :class:`ShapeError`."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 3:
        result = StepResult(*value)
    elif isinstance(value, Mapping):
        require_keys(value, ("feedback", "reward", "done"), "step", STEP_SHAPE)
        unknown = sorted(set(map(str, value)) - {"feedback", "reward", "done", "info", "role"})
        if unknown:
            raise ShapeError(f"step returned unknown keys {unknown}; it must return {STEP_SHAPE}")
        result = StepResult(
            value["feedback"], value["reward"], value["done"], value.get("info") or {}, value.get("role", "user")
        )
    else:
        raise ShapeError(f"step returned a {type(value).__name__} ({_short(value)}); it must return {STEP_SHAPE}")
    return StepResult(
        as_text(result.feedback, "feedback"),
        as_number(result.reward, "reward"),
        as_bool(result.done, "done"),
        numbers_of(result.info, "info"),
        as_text(result.role, "role"),
    )


def coerce_reset(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ShapeError(
        f"reset returned a {type(value).__name__} ({_short(value)}); it must return the first message "
        "as a str, or None to keep the prompt"
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
