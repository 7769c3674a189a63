"""Rule-based rewards (``--reward_fn module:function`` or a built-in task) and reward post-processing.

A reward function is called once per step with the whole batch::

    fn(prompts: list[str], completions: list[str], *, prompt_ids, completion_ids, labels) -> list[float]

(TRL's reward functions take ``prompts, completions, **kwargs`` too, so they plug in.)
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from typing import Any, Callable, Sequence

import torch

from hybrid_core.errors import ConfigError


def load_reward_fn(spec: str) -> Callable[..., list[float]]:
    """``package.module:function`` or ``path/to/file.py:function``; OpenRLHF's ``file.py`` (its ``reward_func``) or
    ``http(s)://`` reward servers (see :mod:`.remote_rewards`)."""
    from .remote_rewards import is_openrlhf_reward, load_openrlhf_reward

    if is_openrlhf_reward(spec):
        return load_openrlhf_reward(spec)
    module_name, _, func_name = spec.partition(":")
    if module_name.endswith(".py") or os.path.isfile(module_name):
        loader_spec = importlib.util.spec_from_file_location(f"hybrid_reward_{abs(hash(module_name))}", module_name)
        if loader_spec is None or loader_spec.loader is None:
            raise ConfigError("reward_fn", f"cannot load {module_name!r} as a Python file.")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError("reward_fn", f"{module_name!r} has no function {func_name!r}.")
    return fn


class RewardScorer:
    """Scores completions with a reward function; normalises (running mean/std) and clips like OpenRLHF."""

    def __init__(self, fn: Callable[..., list[float]] | None, decode: Callable[[Sequence[int]], str], *,
                 normalize: bool = False, clip_range: tuple[float, float] = (-10.0, 10.0)):
        self.fn = fn
        self.decode = decode
        self.normalize_rewards = normalize
        self.clip_range = clip_range
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
        values = self.fn(p_text, c_text, prompt_ids=p_ids, completion_ids=c_ids, labels=labels)
        if len(values) != len(c_ids):
            raise ValueError(f"reward function returned {len(values)} scores for {len(c_ids)} completions")
        scores = torch.tensor([float(v) for v in values], dtype=torch.float32)
        if not torch.isfinite(scores).all():
            bad = [i for i, v in enumerate(scores.tolist()) if not math.isfinite(v)]
            raise ValueError(f"reward function returned non-finite scores at positions {bad[:10]}; "
                             "return a finite float for every completion")
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
