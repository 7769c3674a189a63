"""The evaluation section: held-out prompts generated on with the current weights at some steps, and how they are
scored (``--eval_dataset``, ``--eval_steps``, ``--eval_split``, ``--eval_temperature``, ``--eval_n_samples_per_prompt``,
``--eval_pass_threshold``).

:class:`EvalSettings` is built from the flat config by ``RLConfig.evaluation_settings()`` (the rows of
:data:`hybrid_algos.train.sections.TABLE`); its :meth:`~EvalSettings.validate` holds the checks of these settings,
naming each as ``evaluation.name`` (the config turns that into the flag the user wrote). The evaluation itself is
:mod:`.evaluation`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from hybrid_core.errors import ConfigError

#: ``evaluation.steps`` meaning "only once, after the last step" (OpenRLHF's default value).
AT_END = -1


@dataclass(frozen=True)
class EvalSettings:
    """The evaluation section (OpenRLHF's ``--eval.*`` in hybrid's words)."""

    dataset: str | None = None  # None: no evaluation
    steps: int = AT_END  # evaluate every N steps (and after the last); -1: only after the last step
    split: str = "train"  # the split of a datasets folder (OpenRLHF's default)
    temperature: float = 0.6
    n_samples_per_prompt: int = 4  # k of pass@k
    pass_threshold: float = 1.0  # a sample passes when its reward is >= this (1.0: a right answer of a 0/1 reward)

    @property
    def enabled(self) -> bool:
        return self.dataset is not None

    def validate(
        self,
        *,
        input_key: str | None = None,
        async_train: bool = False,
        reward_model: bool = False,
        agent: bool = False,
    ) -> EvalSettings:
        """Check these settings; return self. The checks that need another section take what they need from it:
        ``input_key`` (rollout: the field that holds a prompt, the same as the training prompts'), ``async_train``
        (rollout), ``reward_model`` (models: a reward model scores) and ``agent`` (rollout: multi-turn samples)."""
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps == 0 or steps < AT_END:
            raise ConfigError(
                "evaluation.steps",
                f"must be -1 (once, after the last step) or a whole number >= 1, got {steps!r}.",
                "E.g. evaluation.steps 10 evaluates after every 10th step (and after the last).",
            )
        n = self.n_samples_per_prompt
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(
                "evaluation.n_samples_per_prompt",
                f"must be a whole number >= 1, got {n!r}.",
                "E.g. evaluation.n_samples_per_prompt 4 (pass@4: a prompt passes when one of its 4 samples does).",
            )
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ConfigError(
                "evaluation.temperature",
                f"must be a finite number >= 0, got {self.temperature!r}.",
                "E.g. evaluation.temperature 0.6 (0: greedy).",
            )
        if not (isinstance(self.pass_threshold, (int, float)) and math.isfinite(self.pass_threshold)):
            raise ConfigError(
                "evaluation.pass_threshold",
                f"must be a finite number, got {self.pass_threshold!r}.",
                "E.g. evaluation.pass_threshold 1.0 (a sample passes when its reward is >= 1.0).",
            )
        if self.dataset is None:
            return self
        self._check_files()
        if not input_key:
            raise ConfigError(
                "evaluation.dataset",
                "the evaluation prompts are read like the training prompts, and rollout.input_key (the field that "
                "holds a prompt) is not given.",
                "Add e.g. rollout.input_key prompt (and rollout.label_key for the reward's labels).",
            )
        for on, what, fix in (
            (async_train, "an asynchronous run (rollout.async_train)", "drop rollout.async_train"),
            (reward_model, "a reward model (models.reward_pretrain)", "score with a rule: models.reward_fn"),
            (agent, "multi-turn samples (an environment)", "drop rollout.agent_func_path"),
        ):
            if on:
                raise ConfigError(
                    "evaluation.dataset",
                    f"evaluation during training is not built for {what} yet: it generates on the engines "
                    "between steps and scores with the run's rule reward.",
                    f"Drop evaluation.dataset, or {fix}.",
                )
        return self

    def _check_files(self) -> None:
        from .prompt_sources import split_sources

        assert self.dataset is not None  # validate() checks files only with a dataset
        for source in split_sources(self.dataset):
            if not os.path.exists(source.path):
                raise ConfigError(
                    "evaluation.dataset",
                    f"no file or folder at {source.path!r} (datasets are not downloaded at run time).",
                    "Give local JSONL/JSON/Parquet files or datasets folders, comma-separated.",
                )
