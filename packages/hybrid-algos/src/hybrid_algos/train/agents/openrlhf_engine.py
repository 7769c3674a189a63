"""What an OpenRLHF agent executor sees as its ``llm_engine`` and ``sampling_params``: vLLM's shapes, backed by the
run's engines through the :class:`~.batcher.TurnBatcher`.

``await llm_engine.generate(prompt_token_ids, sampling_params)`` returns an object shaped like vLLM's
``RequestOutput`` (``.outputs[0].token_ids`` / ``.text`` / ``.finish_reason`` / ``.logprobs[i][token].logprob``).
The sampling settings are read from vLLM's field names (``temperature``, ``top_p``, ``top_k``, ``max_tokens``,
``min_tokens``, ``skip_special_tokens``), whatever object carries them (an agent may return a ``vllm.SamplingParams``
from its step). Each sample's response -- its turns and the environment's replies -- stays within
``generate_max_len`` tokens (what the memory plan and the engines' context were sized for), and each turn within
``--max_new_tokens_per_turn``; a sample with no room left gets an empty turn (``finish_reason="length"``) and the
guard ends it. Every generation is recorded, so the trainer gets the engine's own log-probs of every action.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .batcher import TurnBatcher, TurnSampling
from .guard import SampleState


@dataclass
class AgentSamplingParams:
    """vLLM's ``SamplingParams`` field names, mutable and deep-copyable as OpenRLHF's executor needs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = False
    logprobs: int | None = 1  # OpenRLHF records the engine's log-probs when this is set
    n: int = 1
    seed: int | None = None  # unused: every turn's batch is seeded from --seed (see batcher)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: Any = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class Generation:
    """One turn as the engine produced it: where it starts in the sample's tokens, its tokens and log-probs."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int] | None = None  # the engine's weight version per token (None: it marks none)


@dataclass
class AgentEngine:
    """The ``llm_engine`` of one sample."""

    batcher: TurnBatcher
    state: SampleState
    tokenizer: Any
    renderer: Any  # templates.Renderer: decoding a turn
    response_budget: int  # generate_max_len
    turn_cap: int | None  # --max_new_tokens_per_turn
    max_turns: int = 1 << 30  # --max_turns: a custom executor asking for more is an error
    generations: list[Generation] = field(default_factory=list)
    prompt_len: int | None = None

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None, **_: Any) -> RequestOutput:
        if multi_modal_data:
            raise NotImplementedError("agent turns with images are not supported (hybrid trains text models)")
        context = [int(t) for t in prompt_token_ids]
        if self.prompt_len is None:
            self.prompt_len = len(context)
        self.state.turns += 1
        left = self.prompt_len + self.response_budget - len(context)
        if self.state.turns > self.max_turns:
            raise RuntimeError(
                f"the executor asked for turn {self.state.turns}, more than --max_turns {self.max_turns}"
            )
        cap = min(c for c in (left, self.turn_cap, _get(sampling_params, "max_tokens")) if c is not None)
        if cap < 1:
            self.state.out_of_budget = True
            return self._answer(context, [], [], "length", sampling_params)
        out = await self.batcher.generate(
            context,
            cap,
            TurnSampling(
                float(_get(sampling_params, "temperature", 1.0)),
                float(_get(sampling_params, "top_p", 1.0)),
                _top_k(_get(sampling_params, "top_k", -1)),
                int(_get(sampling_params, "min_tokens", 0) or 0),
            ),
            sample=self.state.index,
        )
        logprobs = list(out.logprobs) if out.logprobs is not None else [0.0] * len(out.token_ids)
        versions = list(out.weight_versions) if out.weight_versions is not None else None
        self.generations.append(Generation(len(context), list(out.token_ids), logprobs, versions))
        if len(context) + len(out.token_ids) >= self.prompt_len + self.response_budget:
            self.state.out_of_budget = True
        return self._answer(context, list(out.token_ids), logprobs, out.finish_reason, sampling_params)

    def _answer(self, context, tokens, logprobs, finish, sampling_params) -> RequestOutput:
        ids = (
            tokens[:-1] if tokens and tokens[-1] in self.renderer.stop_ids else tokens
        )  # vLLM's text has no stop token
        text = self.tokenizer.decode(ids, skip_special_tokens=bool(_get(sampling_params, "skip_special_tokens", False)))
        lps = [{t: Logprob(lp)} for t, lp in zip(tokens, logprobs)]
        completion = CompletionOutput(0, text, tokens, sum(logprobs) if logprobs else 0.0, lps, finish)
        return RequestOutput(f"sample-{self.state.index}-turn-{self.state.turns}", None, context, [completion])


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    value = getattr(obj, name, default)
    return default if value is None and default is not None else value


def _top_k(value: Any) -> int:
    k = int(value)
    return -1 if k <= 0 else k  # vLLM spells "off" as 0 or -1
