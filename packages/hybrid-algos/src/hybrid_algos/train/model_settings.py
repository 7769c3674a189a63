"""The models section: the folders a run's roles load, where its rewards come from, the built-in task and model.

:class:`ModelSettings` is built from the flat config by ``RLConfig.models_settings()`` (the rows of
:data:`hybrid_algos.train.sections.TABLE`); :meth:`~ModelSettings.validate` holds the checks of these settings,
naming each as ``models.name`` (the config turns that into the flag the user wrote).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from hybrid_core.errors import ConfigError

#: Built-in synthetic tasks (prompts + rule-based reward) used when no prompt data is given.
TASKS = ("copy", "copy_first", "reverse", "add", "lookup")
#: Built-in tasks whose samples are multi-turn conversations with a built-in environment (hybrid_algos.train.agents).
AGENT_TASKS = ("lookup",)


@dataclass(frozen=True)
class ModelSettings:
    """The models section (field names: OpenRLHF's)."""

    pretrain: str | None = None  # None: the tiny built-in demo model (built from a config)
    trust_remote_code: bool = False
    reward_pretrain: str | None = None
    reward_random_head: bool = False
    reward_fn: str | None = None  # "module:function", a .py file or http(s) URL(s); None: the task's rule
    critic_pretrain: str | None = None
    teacher_pretrain: str | None = None  # on-policy distillation's teacher (the recipe's teacher role)
    task: str = "copy"  # the built-in task when there is no prompt data
    task_length: int = 2
    tiny_model: dict[str, Any] = field(default_factory=dict)  # overrides of the demo model's config
    plugins: str | None = None

    def validate(self, *, builtin_prompts: bool = True) -> ModelSettings:
        """Check these settings; return self. ``builtin_prompts``: the rollout has no prompt data of its own, so the
        built-in task makes the prompts (its name must be one of :data:`TASKS`)."""
        if builtin_prompts and self.task not in TASKS:
            raise ConfigError(
                "models.task",
                f"{self.task!r} is not one of {', '.join(TASKS)}.",
                "Or give your own prompts with rollout.prompt_data FILE rollout.input_key KEY.",
            )
        length = self.task_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(
                "models.task_length",
                f"must be a positive integer, got {length!r}.",
                "Give models.task_length a whole number >= 1.",
            )
        for name in ("pretrain", "reward_pretrain", "critic_pretrain", "teacher_pretrain"):
            path = getattr(self, name)
            if path is not None and not os.path.isdir(path):
                raise ConfigError(
                    f"models.{name}",
                    f"no model folder at {path!r} (models are not downloaded at run time).",
                    "Give a local Hugging Face model folder (config.json + weights).",
                )
        self._validate_reward()
        return self

    def _validate_reward(self) -> None:
        from .remote_rewards import check_openrlhf_reward, is_openrlhf_reward

        if self.reward_fn is not None and is_openrlhf_reward(self.reward_fn):
            check_openrlhf_reward(self.reward_fn)
        elif self.reward_fn is not None:
            module, _, func = self.reward_fn.partition(":")
            if not module or not func:
                raise ConfigError(
                    "models.reward_fn",
                    f"expected 'module:function', got {self.reward_fn!r}.",
                    "E.g. models.reward_fn my_rewards:score or models.reward_fn path/to/file.py:score.",
                )
            if not os.path.isfile(module) and not _module_exists(module):
                raise ConfigError(
                    "models.reward_fn",
                    f"cannot find module {module!r}.",
                    "Make it importable (PYTHONPATH) or give a .py path.",
                )
        if self.reward_pretrain is not None and self.reward_fn is not None:
            raise ConfigError(
                "models.reward_fn",
                "both models.reward_pretrain and models.reward_fn are set; a run uses one reward.",
                "Keep one of them.",
            )
        if self.reward_random_head and self.reward_pretrain is None:
            raise ConfigError(
                "models.reward_random_head",
                "there is no reward model (models.reward_pretrain) whose head it would initialise.",
                "Drop models.reward_random_head, or give models.reward_pretrain DIR.",
            )


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or the name is not a module path
        return False
