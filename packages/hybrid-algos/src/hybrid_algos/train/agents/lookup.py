"""The built-in tool task (``--task lookup``): the answer is a value only a tool call returns.

Each prompt is ``<bos> s_k <sep>`` -- a key -- and hides a table drawn at random for that prompt (a value for every
key), so the prompt says nothing about the answer: no policy does better than chance (1 in ``num_symbols``) without
the tool. Two turns: the model's first turn calls the lookup tool with a key (its first word), and the environment
replies with the table's value for that key (a tool message, which the tiny tokenizer's chat template renders
``s_v <sep>``); the second turn is the answer (its first word), rewarded 1 if it is the value of the prompt's key.
What the model has to learn: ask for the prompt's key, then answer with what the tool said.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..tasks import BOS, FIRST_SYMBOL_ID, SEP, Prompt
from .environment import StepResult

#: Turns and new tokens per turn of the built-in task (unless --max_turns / --max_new_tokens_per_turn say otherwise).
MAX_TURNS, TURN_TOKENS = 2, 2
#: The most tokens a reply can have: the assistant's closing (when the turn was cut) + s_v <sep>.
REPLY_TOKENS = 3


@dataclass(frozen=True)
class LookupTask:
    """Prompts of the lookup task: ``prompt_symbols`` key symbols; the label holds the key and the hidden table."""

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
            table = [rng.randrange(self.num_symbols) for _ in range(self.num_symbols)]
            ids = [BOS, *(FIRST_SYMBOL_ID + s for s in key), SEP]
            text = " ".join(["<bos>", *(f"s{s}" for s in key), "<sep>"])
            out.append(Prompt(ids, text, label={"key": key[0], "table": table}))
        return out

    def response_budget(self, max_turns: int, turn_tokens: int) -> int:
        """Tokens a whole conversation may need: every turn and every reply between them."""
        return max_turns * turn_tokens + (max_turns - 1) * REPLY_TOKENS


class LookupEnvironment:
    """One sample of the lookup task: the first turn is a lookup, the second the answer."""

    def __init__(self) -> None:
        self.key, self.table, self.turn, self.asked = 0, [], 0, None

    def reset(self, prompt: str, label: dict) -> None:
        self.key, self.table = int(label["key"]), list(label["table"])
        return None  # the prompt stays as it is

    def step(self, action: str) -> StepResult:
        self.turn += 1
        symbol = _symbol(action, len(self.table))
        if self.turn == 1:  # the tool call: its first word is the key to look up
            self.asked = symbol
            value = "" if symbol is None else f"s{self.table[symbol]}"
            return StepResult(feedback=value, role="tool")
        right = symbol is not None and symbol == self.table[self.key]
        return StepResult(reward=float(right), done=True, info={"asked_right_key": float(self.asked == self.key)})


def _symbol(text: str, count: int) -> int | None:
    """The index of ``text``'s first word if it is a symbol ``s0 .. s{count-1}``, else None."""
    words = text.split()
    if words and words[0].startswith("s") and words[0][1:].isdigit() and int(words[0][1:]) < count:
        return int(words[0][1:])
    return None
