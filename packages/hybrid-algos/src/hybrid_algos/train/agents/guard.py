"""Bad environments fail clearly: every environment call runs under a deadline, its answer's shape is checked, and
a failure names the agent file, the call, the sample and the fix.

``--agent_on_error raise`` (default) ends the run with an :class:`AgentError`; ``end_sample`` ends only that sample
(reward 0, left out of the policy loss), logs the message and counts it in the step's metrics.

OpenRLHF's executors call their ``AgentInstance`` themselves, so :func:`guard_instances` swaps the executor's
instance class for a subclass whose ``reset`` / ``step`` go through the guard (and end a sample at ``--max_turns``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybrid_core.errors import HybridError

from .environment import ShapeError, as_bool, as_number, as_text, numbers_of, require_keys

log = logging.getLogger(__name__)


class AgentError(HybridError, RuntimeError):
    """An environment failed (raised, timed out, answered in a wrong shape) or the rollout could not go on."""


class SampleFailed(Exception):
    """Ends one sample (``--agent_on_error end_sample``); the message is the same as :class:`AgentError`'s."""


@dataclass
class SampleState:
    """What the guard and the engine adapter know about the sample being run (one per sample)."""

    step: int
    index: int  # within the step's samples
    prompt: str
    turns: int = 0  # generations so far
    hit_max_turns: bool = False
    env_done: bool = False  # the environment itself ended the sample
    out_of_budget: bool = False  # the response budget is used up
    env_calls: int = 0  # in flight (the rollout's watchdog looks)
    extra: dict[str, float] = field(default_factory=dict)

    def where(self) -> str:
        prompt = self.prompt if len(self.prompt) <= 60 else self.prompt[:57] + "..."
        return f"step {self.step + 1}, sample {self.index}, turn {max(self.turns, 1)}, prompt {prompt!r}"


#: The sample the running coroutine belongs to (each sample's task has its own context).
CURRENT: contextvars.ContextVar[SampleState] = contextvars.ContextVar("hybrid_agent_sample")


@dataclass
class Guard:
    source: str  # the agent file (or "the built-in 'lookup' task")
    timeout_s: float
    on_error: str  # raise | end_sample
    max_turns: int

    def fail(self, state: SampleState, what: str, problem: str, fix: str, cause: BaseException | None = None):
        """Raise the error for ``what`` (e.g. ``"AgentInstance.step"``) going wrong in ``state``'s sample."""
        hint = (
            "; or pass --agent_on_error end_sample to end such samples (reward 0, left out of the loss) and keep "
            "training"
            if self.on_error == "raise"
            else ""
        )
        message = f"agent {self.source}: {what} {problem} ({state.where()}). Fix: {fix}{hint}."
        if self.on_error == "end_sample":
            raise SampleFailed(message) from cause
        raise AgentError(message) from cause

    async def call(self, state: SampleState, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)`` under ``--agent_timeout_s``: awaited when it is a coroutine function, else in a thread."""
        state.env_calls += 1
        try:
            if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__func__", None)):
                pending = fn(*args, **kwargs)
            else:
                pending = asyncio.to_thread(functools.partial(fn, *args, **kwargs))
            result = await asyncio.wait_for(pending, self.timeout_s)
            if inspect.isawaitable(result):  # a plain def returning an awaitable
                result = await asyncio.wait_for(result, self.timeout_s)
            return result
        except (SampleFailed, AgentError):
            raise
        except asyncio.TimeoutError as e:
            self.fail(
                state,
                what,
                f"did not return within --agent_timeout_s {self.timeout_s:g} s",
                "make it answer in time (inside async def, await I/O instead of blocking; or make it a plain "
                "def, which runs in a thread), or raise --agent_timeout_s",
                e,
            )
        except Exception as e:
            log.error("agent %s: %s raised (%s):", self.source, what, state.where(), exc_info=e)
            self.fail(
                state,
                what,
                f"raised {type(e).__name__}: {e}",
                "fix the environment (the traceback is in the log above)",
                e,
            )
        finally:
            state.env_calls -= 1

    def shape(self, state: SampleState, what: str, error: ShapeError, fix: str) -> None:
        self.fail(state, what, f"answered in a wrong shape: {error}", fix, error)


# ---- OpenRLHF's AgentInstance, guarded ----------------------------------------------------------------------------
STEP_FIX = (
    "return a dict with 'rewards' (a number or one-element tensor), 'scores' (optional, the same), "
    "'environment_feedback' (str), 'done' (bool), and optionally 'sampling_params' and 'extra_logs' (a dict of "
    "numbers), as OpenRLHF's AgentInstance.step does"
)
RESET_FIX = "return {'observation': str}, as OpenRLHF's AgentInstance.reset does"


def guard_instances(executor: Any, guard: Guard) -> None:
    """Make ``executor``'s per-sample ``AgentInstance`` class a guarded subclass (executors built on OpenRLHF's
    ``MultiTurnAgentExecutor`` keep it in ``agent_instance_cls``; others are checked by their results only)."""
    cls = getattr(executor, "agent_instance_cls", None)
    if not isinstance(cls, type) or getattr(cls, "_hybrid_guarded", False):
        return
    executor.agent_instance_cls = _guarded(cls, guard)


def _guarded(cls: type, guard: Guard) -> type:
    import torch

    class Guarded(cls):
        _hybrid_guarded = True

        async def reset(self, states, **kwargs):
            state = CURRENT.get()
            result = await guard.call(state, f"{cls.__name__}.reset", super().reset, states, **kwargs)
            try:
                if not isinstance(result, Mapping) or "observation" not in result:
                    raise ShapeError(f"reset returned {type(result).__name__} {_keys(result)}")
                as_text(result["observation"], "observation")
            except ShapeError as e:
                guard.shape(state, f"{cls.__name__}.reset", e, RESET_FIX)
            return result

        async def step(self, states, **kwargs):
            state = CURRENT.get()
            what = f"{cls.__name__}.step"
            result = await guard.call(state, what, super().step, states, **kwargs)
            try:
                if not isinstance(result, Mapping):
                    raise ShapeError(f"step returned a {type(result).__name__}")
                require_keys(result, ("rewards", "environment_feedback", "done"), "step")
                out = dict(result)
                # OpenRLHF's executor reads rewards with .item(): a plain number works there too
                out["rewards"] = torch.tensor(as_number(result["rewards"], "rewards"))
                if result.get("scores") is not None:
                    out["scores"] = torch.tensor(as_number(result["scores"], "scores"))
                else:
                    out.pop("scores", None)
                as_text(result["environment_feedback"], "environment_feedback")
                out["done"] = as_bool(result["done"], "done")
                state.extra = numbers_of(result.get("extra_logs"), "extra_logs")
            except ShapeError as e:
                guard.shape(state, what, e, STEP_FIX)
            state.env_done = out["done"]
            if not out["done"] and (state.turns >= guard.max_turns or state.out_of_budget):
                state.hit_max_turns = state.turns >= guard.max_turns
                out["done"] = True  # the sample ends here: --max_turns, or no room left for another turn
            return out

    Guarded.__name__, Guarded.__qualname__, Guarded.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    return Guarded


def _keys(value: Any) -> str:
    return f"(keys: {sorted(map(str, value))})" if isinstance(value, Mapping) else ""
