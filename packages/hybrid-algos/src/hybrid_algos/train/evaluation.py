"""Evaluation during training (``--eval_dataset``): held-out prompts generated on with the weights just trained, at
the steps ``--eval_steps`` names and after the last one, scored by the run's reward, summed up as ``eval/...``
metrics in that step's record (so every sink the run writes gets them: metrics.jsonl, TensorBoard, W&B).

* **Prompts.** Read by the training prompts' loader (:mod:`.data`) with the same ``--input_key`` / ``--label_key`` /
  ``--input_template`` / ``--apply_chat_template`` / ``--prompt_max_len`` / ``--max_samples``, from
  ``--eval_dataset`` (a comma list is concatenated) and its ``--eval_split``, before Ray starts
  (:func:`load_eval_prompts`).
* **When.** After step ``s`` (1-based) when ``s`` is a multiple of ``--eval_steps``, and after the run's last step;
  ``--eval_steps -1`` (the default): only after the last step. (OpenRLHF 0.11's PPO trainer never evaluates with -1:
  its dataset is then loaded for nothing; here giving a dataset means it is used.) A resumed run evaluates at the same
  steps.
* **How.** The recipe's ``eval`` phase (:data:`~.recipes.EVAL`), after the step's weight sync: a generate phase of the
  engines, so the residency plan includes it, and the step skips it (with its moves) at the other steps. The prompts
  go through the engines as the rollout's do (``EngineGroup.generate``), at ``--eval_temperature`` with
  ``--eval_n_samples_per_prompt`` samples each, the rollout's top-p / top-k and length limits, in calls of at most
  one rollout's worth of samples (the memory the plan gives the rollout). Every call carries a seed of its own
  (seed, step, call): the evaluation is reproducible and never draws from an engine's own random stream, so the
  training samples are those of the same run without evaluation. The scores are the reward function's raw ones
  (never normalised: the running statistics of ``--normalize_reward`` are the training rewards' alone).
* **Metrics.** ``eval/reward_mean`` (over every sample), ``eval/pass@k`` with k = ``--eval_n_samples_per_prompt``
  (the fraction of prompts of which at least one sample *passes*: its reward is >= ``--eval_pass_threshold``, 1.0 by
  default -- a right answer of the built-in tasks, whose rewards are the fraction of answer symbols right, and of a
  0/1 verifiable reward; OpenRLHF's ``pass{k}`` is the prompts' mean best reward, the same number for 0/1 rewards),
  ``eval/response_length`` (tokens per sample, the stop token included, as the rollout's ``response_len``),
  ``eval/prompts`` and ``time/eval``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_core.errors import ConfigError

from .eval_settings import AT_END, EvalSettings


def evaluates_after(done: int, every: int, total: int) -> bool:
    """Whether the evaluation runs after step ``done`` (1-based) of a run of ``total`` steps, every ``every`` steps
    (``-1``: only after the last)."""
    return done == total or (every != AT_END and done % every == 0)


def eval_steps_of(every: int, total: int) -> list[int]:
    """The (1-based) steps after which a run of ``total`` steps evaluates."""
    return [s for s in range(1, total + 1) if evaluates_after(s, every, total)]


def eval_metrics(scores: torch.Tensor, lengths: torch.Tensor, k: int, threshold: float) -> dict[str, float]:
    """The summary of ``scores`` (prompt-major: the ``k`` samples of each prompt in a row) and their response
    ``lengths``: mean reward, pass@k at ``threshold``, mean response length."""
    passed = (scores >= threshold).view(-1, k).any(dim=1)
    return {
        "eval/reward_mean": scores.float().mean().item(),
        f"eval/pass@{k}": passed.float().mean().item(),
        "eval/response_length": lengths.float().mean().item(),
        "eval/prompts": float(passed.numel()),
    }


def eval_seed(seed: int, step: int, call: int) -> int:
    """The seed of the evaluation's ``call``-th engine call after ``step``: its own, apart from the rollout's
    (``seed * 1_000_003 + step``), so the two never draw the same samples."""
    digest = hashlib.blake2b(struct.pack("<qqq", seed, step, call), digest_size=8, person=b"hybrid-eval").digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Evaluation:
    """A run's evaluation: its prompts, its steps, its sampling; :meth:`run` evaluates once."""

    prompts: list  # tasks.Prompt
    settings: EvalSettings
    sampling: Any  # hybrid_engines SamplingParams: the rollout's, at the evaluation's temperature and n
    total_steps: int
    seed: int
    prompts_per_call: int  # a rollout's worth of samples per engine call

    def due(self, step: int) -> bool:
        """Whether the evaluation runs after ``step`` (0-based, as the step loop counts)."""
        return evaluates_after(step + 1, self.settings.steps, self.total_steps)

    def run(self, engines: Any, reward: Any, step: int) -> dict[str, float]:
        """Generate on every prompt through ``engines`` (an EngineGroup), score with ``reward`` (the run's
        RewardScorer), and return the ``eval/...`` metrics."""
        scores: list[torch.Tensor] = []
        lengths: list[int] = []
        for call, start in enumerate(range(0, len(self.prompts), self.prompts_per_call)):
            chunk = self.prompts[start : start + self.prompts_per_call]
            params = dataclasses.replace(self.sampling, seed=eval_seed(self.seed, step, call))
            outputs = engines.generate([p.prompt_ids for p in chunk], params)
            scores.append(reward.score(chunk, outputs))  # the raw scores: no normalisation state is touched
            lengths.extend(len(o.token_ids) for group in outputs for o in group)
        k = self.settings.n_samples_per_prompt
        return eval_metrics(torch.cat(scores), torch.tensor(lengths), k, self.settings.pass_threshold)


def calls_of(settings: EvalSettings, samples_per_step: int) -> int:
    """Prompts per engine call: a rollout's worth of samples (``samples_per_step``), at least one prompt."""
    return max(1, samples_per_step // settings.n_samples_per_prompt)


def describe(settings: EvalSettings, source: str, *, total_steps: int, samples_per_step: int) -> str:
    """One line for the start of the run and ``--dry-run``: what is evaluated, how, and after which steps (in
    section words: ``flag_text`` turns them into flags)."""
    steps, k = eval_steps_of(settings.steps, total_steps), settings.n_samples_per_prompt
    shown = ", ".join(map(str, steps[:6])) + (f", ... {steps[-1]}" if len(steps) > 6 else "")
    when = (
        f"once, after the last step ({total_steps}; evaluation.steps -1: OpenRLHF's PPO would not evaluate at all)"
        if settings.steps == AT_END
        else f"after steps {shown} (every {settings.steps}, and the last)"
    )
    return (
        f"evaluation: {source}, {k} sample{'s' if k != 1 else ''} each at temperature {settings.temperature:g}, "
        f"scored by the run's reward (eval/pass@{k}: a sample passes at reward >= {settings.pass_threshold:g}); "
        f"{when}; up to {calls_of(settings, samples_per_step)} prompts per engine call"
    )


def make_evaluation(
    prompts: Sequence[Any], settings: EvalSettings, sampling: Any, *, total_steps: int, seed: int, samples_per_step: int
) -> Evaluation:
    """The evaluation of a run whose rollout samples with ``sampling`` (``samples_per_step`` samples a step)."""
    k = settings.n_samples_per_prompt
    params = dataclasses.replace(sampling, temperature=settings.temperature, n=k, seed=None, logprobs=False)
    return Evaluation(list(prompts), settings, params, total_steps, seed, calls_of(settings, samples_per_step))


def load_eval_prompts(rollout: Any, settings: EvalSettings, tokenizer: Any) -> tuple[list, Any]:
    """The held-out prompts (and their ``PromptStats``), read like the training prompts (``rollout``: the rollout
    section, whose prompt fields and limits apply) from the evaluation's dataset and split. A problem names the
    evaluation dataset."""
    from .data import load_prompt_set

    assert settings.dataset is not None  # only a run with an evaluation dataset loads one
    source = dataclasses.replace(
        rollout, prompt_data=settings.dataset, prompt_split=settings.split, prompt_data_probs=None
    )
    try:
        return load_prompt_set(source, tokenizer)
    except ConfigError as e:  # the loader speaks of the training prompts' flags
        field = "eval_dataset" if e.field in ("prompt_data", "prompt_split") else e.field
        words = {"--prompt_data": "--eval_dataset", "--prompt_split": "--eval_split"}
        problem, fix = e.problem, e.fix or ""
        for old, new in words.items():
            problem, fix = problem.replace(old, new), fix.replace(old, new)
        raise ConfigError(field, f"the evaluation prompts ({settings.dataset}): {problem}", fix or None) from e
