"""The built-in tool task (``--task lookup``): the answer is a value only a tool call returns.

Each prompt is ``<bos> s_k <sep>`` (a key) and hides a value ``s_v`` drawn at random, independently of the key, so
the prompt says nothing about the answer. The model's turn is either an answer -- its first word is a symbol: the
sample ends, reward 1 if it is the value *and the tool was called before* (an answer without a lookup is a guess and
scores 0, so no single turn can earn the reward) -- or, when it starts with anything else, a call of the lookup
tool: the environment replies with the value (a tool message, which the tiny tokenizer's chat template renders
``<sep> s_v``) and the model gets another turn. Two turns, two tokens each (a symbol and ``<eos>``): a sample that
calls again in its second turn ends there, unanswered. What the model has to learn: call first (any non-symbol),
then answer with what the tool said.

Scoring guesses 0 also keeps the two skills from competing: were a guess worth its 1-in-``num_symbols`` chance, an
untrained model (which copies the tool's answer less often than that) would first learn to stop calling.

The prompts (and the response budget) are :class:`~hybrid_algos.train.tasks.LookupTask`'s, with the other built-in
tasks; this module is the environment that answers them.
"""

from __future__ import annotations

from .environment import StepResult

#: Turns and new tokens per turn of the built-in task (unless --max_turns / --max_new_tokens_per_turn say otherwise).
MAX_TURNS, TURN_TOKENS = 2, 2


class LookupEnvironment:
    """One sample of the lookup task: answers a tool call with the hidden value, scores an answer."""

    def __init__(self) -> None:
        self.value, self.calls = -1, 0

    def reset(self, prompt: str, label: int) -> None:
        self.value = int(label)
        return None  # the prompt stays as it is

    def step(self, action: str) -> StepResult:
        words = action.split()
        first = words[0] if words else ""
        if first.startswith("s") and first[1:].isdigit():  # an answer
            right = int(first[1:]) == self.value and self.calls > 0
            return StepResult(reward=float(right), done=True, info={"tool_calls": float(self.calls)})
        self.calls += 1
        return StepResult(feedback=f"s{self.value}", role="tool", info={"tool_calls": float(self.calls)})
