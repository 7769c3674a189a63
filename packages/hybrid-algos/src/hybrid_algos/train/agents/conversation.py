"""One finished sample: its prompt, its response (the model's turns and the environment's replies, interleaved), which
response tokens the model produced, the engine's log-probs of those, and what the environment said about it.

It travels to the trainer as a :class:`~hybrid_engines.protocol.GenerationOutput` whose ``token_ids`` are the whole
response and whose ``extra["action_mask"]`` marks the model's tokens (``Rollout.from_generations`` reads it):
environment tokens are attended to but get no loss, no KL and no mismatch-correction statistics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybrid_engines.protocol import GenerationOutput

from .environment import ShapeError, as_number, numbers_of, require_keys


@dataclass
class Conversation:
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)  # 1 = the model's token
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0 at environment tokens
    reward: float = 0.0  # the sum of the turns' rewards
    score: float = 0.0  # OpenRLHF's "scores" (the last turn's; default the reward)
    finish_reason: str = "stop"  # "length": a turn or the response was cut at its token limit
    turns: int = 0
    hit_max_turns: bool = False
    overflow_tokens: int = 0  # environment tokens cut because the response budget was full
    failed: str | None = None  # --agent_on_error end_sample: why this sample ended
    info: dict[str, float] = field(default_factory=dict)
    # the engine's weight version of every response token (environment tokens: the turn's before them); -1 where
    # the engine marks none, and then the batch's version stands for the whole sample
    versions: list[int] = field(default_factory=list)

    def segments(self) -> list[tuple[int, int]]:
        """``(model tokens, environment tokens after them)`` per turn."""
        out: list[list[int]] = []
        for m in self.action_mask:
            if m and (not out or out[-1][1]):
                out.append([0, 0])
            if not out:  # environment tokens before the first turn: none in practice
                out.append([0, 0])
            out[-1][0 if m else 1] += 1
        return [(a, b) for a, b in out]

    def output(self) -> GenerationOutput:
        versions = self.versions if self.versions and min(self.versions) >= 0 else None
        return GenerationOutput(
            self.prompt_ids,
            self.response,
            self.logprobs,
            self.finish_reason,
            weight_versions=versions,
            extra={
                "action_mask": self.action_mask,
                "agent_failed": self.failed is not None,
                "agent_reward": self.reward,
                "agent_score": self.score,
                "turns": self.turns,
            },
        )

    def add_turn(
        self, tokens: Sequence[int], logprobs: Sequence[float] | None, versions: Sequence[int] | None = None
    ) -> None:
        """A model turn; ``versions``: the engine's weight version per token (turns of one sample can straddle a
        weight update under --partial_rollout, and the staleness bound counts the oldest)."""
        self.response += list(tokens)
        self.action_mask += [1] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)
        known = versions is not None and len(versions) == len(tokens)
        self.versions += [int(v) for v in versions] if versions is not None and known else [-1] * len(tokens)

    def add_feedback(self, tokens: Sequence[int]) -> None:
        self.response += list(tokens)
        self.action_mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        # not generated: the version of the turn they answer, so they add no version of their own
        self.versions += [self.versions[-1] if self.versions else -1] * len(tokens)


def from_openrlhf(result: Any, generations: Sequence[Any], budget: int) -> Conversation:
    """The :class:`Conversation` an OpenRLHF executor's result dict stands for (a :class:`ShapeError` if it is not one).

    The prompt is what comes before the first action; log-probs are the engine's own (``generations``: what it
    produced for this sample), else the executor's ``rollout_log_probs``. A response longer than ``budget`` is cut
    (only environment tokens can be: the engine adapter keeps every turn within the budget)."""
    if not isinstance(result, Mapping):
        raise ShapeError(f"execute returned a {type(result).__name__}, not a dict")
    require_keys(result, ("observation_tokens", "action_ranges", "reward"), "execute")
    tokens = [int(t) for t in result["observation_tokens"]]
    ranges = [(int(a), int(b)) for a, b in result["action_ranges"]]
    last = 0
    for a, b in ranges:
        if not last <= a <= b <= len(tokens):
            raise ShapeError(
                f"action_ranges {ranges} are not ordered, disjoint spans of the {len(tokens)} observation_tokens"
            )
        last = b
    start = ranges[0][0] if ranges else len(tokens)
    if start == 0:
        raise ShapeError("the first action starts at token 0: there is no prompt before it")
    conv = Conversation(tokens[:start], tokens[start:], [0] * (len(tokens) - start), [0.0] * (len(tokens) - start))
    by_start = {g.start: g for g in generations}
    given = result.get("rollout_log_probs")
    conv.versions = [-1] * (len(tokens) - start)  # -1: an action the engine did not produce as given
    for a, b in ranges:
        conv.action_mask[a - start : b - start] = [1] * (b - a)
        g = by_start.get(a)
        if g is not None and g.token_ids[: b - a] == tokens[a:b]:
            conv.logprobs[a - start : b - start] = g.logprobs[: b - a]
            if g.versions is not None:
                conv.versions[a - start : b - start] = g.versions[: b - a]
        elif given is not None and len(given) == len(tokens):
            conv.logprobs[a - start : b - start] = [float(x) for x in given[a:b]]
    last = -1  # environment tokens: the version of the action before them
    for i, model in enumerate(conv.action_mask):
        last = conv.versions[i] if model else last
        conv.versions[i] = last
    reward = result["reward"]
    if reward is None:
        raise ShapeError("execute returned reward None")
    conv.reward = as_number(reward, "reward")
    scores = result.get("scores")
    conv.score = conv.reward if scores is None else as_number(scores, "scores")
    conv.turns = len(ranges)
    conv.finish_reason = "length" if result.get("truncated") else "stop"
    conv.info = numbers_of(result.get("extra_logs") or {}, "extra_logs")
    if len(conv.response) > budget:
        conv.overflow_tokens = len(conv.response) - budget
        cut_actions = sum(conv.action_mask[budget:])
        conv.response, conv.action_mask, conv.logprobs = (
            conv.response[:budget],
            conv.action_mask[:budget],
            conv.logprobs[:budget],
        )
        conv.versions = conv.versions[:budget]
        if cut_actions:
            conv.finish_reason = "length"
    return conv
