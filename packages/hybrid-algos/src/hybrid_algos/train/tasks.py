"""Built-in verifiable tasks: synthetic prompts whose right answer depends on the prompt, and their rule rewards.

A task's reward has the signature every ``--reward_fn module:function`` has::

    fn(prompts: list[str], completions: list[str], *, prompt_ids, completion_ids, labels) -> list[float]

so the demo exercises the same reward path as a user's own verifiable reward. The multi-turn ``--task lookup``'s
prompts are here too (:class:`LookupTask`); its environment, which scores the answers, is
:mod:`hybrid_algos.train.agents.lookup`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .tiny import SPECIAL_TOKENS

if TYPE_CHECKING:
    from .model_settings import ModelSettings

FIRST_SYMBOL_ID = len(SPECIAL_TOKENS)  # symbol s0's token id
BOS, SEP, EOS = 1, 3, 2


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, its text and what a rule reward needs to score an answer; ``images``: a
    vision-language prompt's images (``hybrid_engines.MultimodalInput``; its placeholder tokens are in
    ``prompt_ids``, expanded), None for text."""

    prompt_ids: list[int]
    text: str
    label: Any = None
    images: Any = None


@dataclass(frozen=True)
class SyntheticTask:
    """``name`` decides the rule; prompts are ``<bos> s_a s_b ... <sep>`` over ``num_symbols`` symbols."""

    name: str = "copy"
    num_symbols: int = 8
    prompt_symbols: int = 2

    @property
    def answer_len(self) -> int:
        return 1 if self.name == "add" else self.prompt_symbols

    def prompts(self, count: int, seed: int) -> list[Prompt]:
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            symbols = [rng.randrange(self.num_symbols) for _ in range(self.prompt_symbols)]
            ids = [BOS, *(FIRST_SYMBOL_ID + s for s in symbols), SEP]
            text = " ".join(["<bos>", *(f"s{s}" for s in symbols), "<sep>"])
            out.append(Prompt(ids, text, label=self.answer(symbols)))
        return out

    def answer(self, symbols: list[int]) -> list[int]:
        """The right completion's symbol indices."""
        if self.name == "copy":
            return list(symbols)
        if self.name == "reverse":
            return list(reversed(symbols))
        if self.name == "add":
            return [sum(symbols) % self.num_symbols]
        if self.name == "copy_first":
            return [symbols[0]] * self.prompt_symbols
        raise ValueError(f"unknown task {self.name!r}")

    def score(self, completion_ids: list[int], label: list[int]) -> float:
        """Fraction of answer positions holding the right symbol (tokens after the answer are ignored)."""
        want = [FIRST_SYMBOL_ID + s for s in label]
        got = list(completion_ids[: len(want)])
        return sum(g == w for g, w in zip(got, want)) / len(want)

    def reward_fn(self) -> Callable[..., list[float]]:
        def reward(prompts, completions, *, prompt_ids, completion_ids, labels, **_: Any) -> list[float]:
            return [self.score(ids, label) for ids, label in zip(completion_ids, labels)]

        reward.__name__ = f"{self.name}_reward"
        return reward


#: The most tokens a reply can have: the assistant's closing (when the turn was cut) + <sep> s_v.
REPLY_TOKENS = 3


@dataclass(frozen=True)
class LookupTask:
    """Prompts of the lookup task (``prompt_symbols`` key symbols; the label is the hidden value's index). A
    multi-turn task: its rules and its environment are in :mod:`hybrid_algos.train.agents.lookup`."""

    name: str = "lookup"
    num_symbols: int = 8
    prompt_symbols: int = 1

    @property
    def answer_len(self) -> int:
        return 1

    def prompts(self, count: int, seed: int) -> list[Prompt]:
        rng = random.Random(f"lookup:{seed}")
        out = []
        for _ in range(count):
            key = [rng.randrange(self.num_symbols) for _ in range(self.prompt_symbols)]
            value = rng.randrange(self.num_symbols)
            ids = [BOS, *(FIRST_SYMBOL_ID + s for s in key), SEP]
            text = " ".join(["<bos>", *(f"s{s}" for s in key), "<sep>"])
            out.append(Prompt(ids, text, label=value))
        return out

    def response_budget(self, max_turns: int, turn_tokens: int) -> int:
        """Tokens a whole conversation may need: every turn and every reply between them."""
        return max_turns * turn_tokens + (max_turns - 1) * REPLY_TOKENS


def task_from_config(models: ModelSettings) -> SyntheticTask | LookupTask:
    """The built-in task the models section asks for (``task``, ``task_length`` symbols, the tiny model's symbol
    count)."""
    num_symbols = int(models.tiny_model.get("num_symbols", 8)) if models.tiny_model else 8
    if models.task == "lookup":  # a multi-turn task: its environment is in agents/lookup.py
        return LookupTask(num_symbols=num_symbols, prompt_symbols=models.task_length)
    return SyntheticTask(models.task, num_symbols=num_symbols, prompt_symbols=models.task_length)
