"""Rule-based rewards (``--reward_fn module:function`` or a built-in task) and reward post-processing.

A reward function is called once per step with the whole batch::

    fn(prompts: list[str], completions: list[str], *, prompt_ids, completion_ids, labels) -> list[float]

(TRL's reward functions take ``prompts, completions, **kwargs`` too, so they plug in.)

Vision-language prompts (``--max_images_per_prompt``): the function also gets ``images``, one entry per completion,
the list of its prompt's images as RGB PIL images (the ``n`` completions of a prompt share the same list; the
prompt text it gets holds the model's image placeholders). It is passed only in runs whose prompts hold images, so
a text reward function needs no new argument; one for images declares it (or ``**kwargs``)::

    fn(prompts, completions, *, prompt_ids, completion_ids, labels, images) -> list[float]

It is user code running in the driver, so it is held to the same rules as the roles: it runs within the step's
budget (``--step_timeout_s``; in a thread the driver can give up on, its stack written to the log folder when it
hangs), and an exception or an answer that is not one finite number per completion ends the run with an error
naming the function, what it returned or raised and where.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from hybrid_core.errors import ConfigError, HybridError

CALL_SHAPE = "fn(prompts, completions, *, prompt_ids, completion_ids, labels) -> list of floats"


class RewardError(HybridError, ValueError):
    """The reward function raised, or returned something other than one finite number per completion."""


class RewardTimeout(HybridError, TimeoutError):
    """The reward function did not return within the step's budget."""

    dump_stacks = True  # the driver's stacks show where it hangs


class ExitCalled(BaseException):
    """``os._exit`` called by a reward function: raised in its thread instead (see :func:`_exit_or_refuse`)."""

    def __init__(self, status: Any):
        super().__init__(f"os._exit({status!r})")
        self.status = status


_user_code = threading.local()  # .pid: set in a thread running a reward function (of that process)
_os_exit = os._exit


def _exit_or_refuse(status: int) -> NoReturn:
    """``os._exit`` while reward functions run: from their thread it raises :class:`ExitCalled` -- the driver would
    end at once, with that status (0: the run looks complete) and no word of why; from any other thread, or from a
    process the function forked (multiprocessing's children end with ``os._exit``), it exits as always."""
    if getattr(_user_code, "pid", None) == os.getpid():
        raise ExitCalled(status)
    _os_exit(status)


def load_reward_fn(spec: str) -> Callable[..., list[float]]:
    """``package.module:function`` or ``path/to/file.py:function``; OpenRLHF's ``file.py`` (its ``reward_func``) or
    ``http(s)://`` reward servers (see :mod:`.remote_rewards`). A module that fails to import is a ConfigError naming
    the module, the error and the line."""
    from .remote_rewards import is_openrlhf_reward, load_openrlhf_reward

    if is_openrlhf_reward(spec):
        return load_openrlhf_reward(spec)
    module_name, _, func_name = spec.partition(":")
    try:
        if module_name.endswith(".py") or os.path.isfile(module_name):
            loader_spec = importlib.util.spec_from_file_location(f"hybrid_reward_{abs(hash(module_name))}", module_name)
            if loader_spec is None or loader_spec.loader is None:
                raise ConfigError(
                    "reward_fn",
                    f"cannot load {module_name!r} as a Python file.",
                    "Give a .py file or an importable module: --reward_fn path/to/file.py:function.",
                )
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as e:  # the user's module itself fails: ImportError, SyntaxError, anything at import time
        raise ConfigError(
            "reward_fn",
            f"importing {module_name!r} failed: {type(e).__name__}: {_message(e)}{_user_frame(e, module_name)}.",
            _import_fix(e),
        ) from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(
            "reward_fn",
            f"{module_name!r} has no function {func_name!r}.",
            f"Define it there ({CALL_SHAPE}), or name another: --reward_fn {module_name}:NAME.",
        )
    return fn


def _import_fix(e: Exception) -> str:
    if isinstance(e, ImportError) and e.name:
        return f"Install the package it imports (pip install {e.name.split('.')[0]}) or fix the import."
    if isinstance(e, SyntaxError):
        return "Fix the syntax error."
    return "Fix the module so that it imports (try: python -c 'import it')."


class RewardScorer:
    """Scores completions with a reward function; normalises (running mean/std) and clips like OpenRLHF."""

    def __init__(
        self,
        fn: Callable[..., list[float]] | None,
        decode: Callable[[Sequence[int]], str],
        *,
        normalize: bool = False,
        clip_range: tuple[float, float] = (-10.0, 10.0),
        name: str | None = None,
        timeout_s: float = 600.0,
    ):
        self.fn = fn
        self.decode = decode
        self.normalize_rewards = normalize
        self.clip_range = clip_range
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)
        self.timeout_s = timeout_s
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def score(self, prompts: Sequence[Any], outputs: Sequence[Sequence[Any]]) -> torch.Tensor:
        """``outputs[i]`` = the completions of ``prompts[i]``; returns one score per completion, prompt-major."""
        p_text, c_text, p_ids, c_ids, labels = [], [], [], [], []
        for prompt, outs in zip(prompts, outputs):
            for out in outs:
                p_text.append(prompt.text)
                p_ids.append(list(prompt.prompt_ids))
                c_ids.append(list(out.token_ids))
                c_text.append(self.decode(out.token_ids))
                labels.append(prompt.label)
        extra = {}
        if any(getattr(p, "images", None) is not None for p in prompts):  # vision-language: the images too
            from hybrid_engines.multimodal import decode_images

            per_prompt = [decode_images(p.images) if p.images is not None else [] for p in prompts]
            extra["images"] = [per_prompt[i] for i, outs in enumerate(outputs) for _ in outs]
        values = self._call(p_text, c_text, prompt_ids=p_ids, completion_ids=c_ids, labels=labels, **extra)
        return self._check(values, len(c_ids))

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """The reward function, in a thread given at most the step's remaining budget (a hung one is left behind:
        the run is ending, and a thread cannot be killed)."""
        from hybrid_core.remote import effective_timeout

        timeout_s, limit = effective_timeout(self.timeout_s)
        result: dict[str, Any] = {}
        fn = self.fn

        def call() -> None:
            _user_code.pid = os.getpid()
            try:
                if fn is None:  # score() is called only with a function (else the reward model scores)
                    raise TypeError("no reward function to call")
                result["value"] = fn(*args, **kwargs)
            except BaseException as e:  # reported from the driver's thread
                result["error"] = e

        os._exit = _exit_or_refuse  # set once and left so (a reward thread left hung behind stays refused too)
        worker = threading.Thread(target=call, name="hybrid-reward-fn", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            frame = sys._current_frames().get(worker.ident) if worker.ident is not None else None
            where = _frame_place(frame) if frame is not None else "unknown"
            raise RewardTimeout(f"the reward function {self.name} did not return {limit} (it was at {where}).")
        if "error" in result:
            e = result["error"]
            if isinstance(e, ExitCalled):
                raise RewardError(
                    f"the reward function {self.name} called os._exit({e.status!r}){_user_frame(e)}, "
                    f"which would end the whole run at once with status {e.status!r} (0 reads as a "
                    "completed run), without its checkpoint or summary. It must return the scores; to "
                    "stop the run, raise an exception."
                ) from None
            hint = ""
            if isinstance(e, ValueError) and "signal only works in main thread" in str(e):
                hint = (
                    " It uses signals (e.g. a timeout based on signal.alarm), which work only in a program's main "
                    "thread; hybrid calls reward functions in a thread of their own to enforce --step_timeout_s: "
                    "turn the function's own signal-based timeout off."
                )
            raise RewardError(
                f"the reward function {self.name} raised {type(e).__name__}: {_message(e)}"
                f"{_user_frame(e)}.{hint} It is called as {CALL_SHAPE}."
            ) from e
        return result.get("value")

    def _check(self, values: Any, expected: int) -> torch.Tensor:
        """One finite float per completion, or a :class:`RewardError` saying what came back instead."""
        fix = f"Return a list of {expected} floats, one per completion, in the order given."
        if values is None:
            raise RewardError(f"the reward function {self.name} returned None. {fix}")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise RewardError(
                f"the reward function {self.name} returned a {type(values).__name__} "
                f"({_short_repr(values)}), not one score per completion. {fix}"
            )
        if isinstance(values, torch.Tensor):
            values = values.detach().flatten().tolist()
        elif hasattr(values, "tolist"):  # numpy
            values = values.tolist()
        if len(values) != expected:
            raise RewardError(
                f"the reward function {self.name} returned {len(values)} scores for {expected} completions. {fix}"
            )
        bad = [(i, v) for i, v in enumerate(values) if isinstance(v, (str, bytes)) or not _is_number(v)]
        if bad:
            shown = ", ".join(f"{i}: {_short_repr(v)}" for i, v in bad[:5])
            raise RewardError(
                f"the reward function {self.name} returned values that are not numbers at "
                f"{len(bad)} position(s) ({shown}). {fix}"
            )
        scores = torch.tensor([float(v) for v in values], dtype=torch.float32)
        if not torch.isfinite(scores).all():
            positions = [i for i, v in enumerate(scores.tolist()) if not math.isfinite(v)]
            raise RewardError(
                f"the reward function {self.name} returned non-finite scores at positions "
                f"{positions[:10]}; return a finite float for every completion."
            )
        return scores

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        """What the advantages see: running-normalised (with --normalize_reward), then clipped."""
        if self.normalize_rewards:
            self._update(scores)
            std = math.sqrt(self.m2 / max(self.count - 1, 1))
            scores = (scores - self.mean) / (std + 1e-8) if self.count > 1 else scores - self.mean
        return scores.clamp(*self.clip_range)

    def _update(self, x: torch.Tensor) -> None:  # Chan et al. parallel running moments
        n, mean = x.numel(), x.mean().item()
        m2 = ((x - mean) ** 2).sum().item()
        delta = mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, (list, tuple, dict))


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else "(no message)"


def _frame_place(frame: Any) -> str:
    """Where a hung reward thread is: its reward function's frame and, if deeper, the innermost one."""
    stack = traceback.extract_stack(frame)
    here = os.path.abspath(__file__)
    calls = [i for i, f in enumerate(stack) if os.path.abspath(f.filename) == here and f.name == "call"]
    user = stack[calls[-1] + 1 :] if calls and calls[-1] + 1 < len(stack) else stack[-1:]
    places = [f"{f.filename}:{f.lineno} in {f.name}" for f in (user[0], user[-1])]
    return places[0] if places[0] == places[1] else f"{places[0]}, inside {places[1]}"


def _user_frame(e: BaseException, module: str | None = None) -> str:
    """`` (at file:line in function)`` for the innermost frame of ``e``'s traceback outside hybrid itself."""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:
        return f" (at {e.filename}:{e.lineno})"
    here = os.path.dirname(os.path.abspath(__file__))
    mine = [f for f in frames if not f.filename.startswith(here) and "importlib" not in f.filename]
    if not mine:
        return ""
    last = mine[-1]
    return f" (at {last.filename}:{last.lineno} in {last.name})"
