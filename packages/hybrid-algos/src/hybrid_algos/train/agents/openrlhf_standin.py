"""A stand-in for ``openrlhf.utils.agent`` (OpenRLHF 0.11.2), for agent files run where OpenRLHF is not installed.

OpenRLHF's ``--agent_func_path`` files import ``AgentInstanceBase`` and ``MultiTurnAgentExecutor`` (some also
``AgentExecutorBase``) from ``openrlhf.utils.agent``. :mod:`.loader` puts this module under that name in
``sys.modules`` only while such a file is loaded, and says so in a log line; with OpenRLHF installed the file gets
the real module and this one is not used.

The contract is OpenRLHF's (written here from its documented behaviour, not from its code):

* the executor is built with no arguments; ``MultiTurnAgentExecutor(AgentInstance)`` makes one ``AgentInstance()``
  per sample;
* ``await instance.reset({"observation": prompt, "label": label})`` returns ``{"observation": text}``;
* each turn, the engine generates from the token ids so far (``sampling_params.max_tokens`` set to what is left of
  ``max_length``), then ``await instance.step({"observation_text", "action_text", "label", "sampling_params"})``
  returns ``rewards`` (summed over turns), ``scores`` (the last; default: the sum), ``environment_feedback`` (text
  appended after the action, tokenized without special tokens), ``done``, optionally ``sampling_params`` (used from
  the next turn on) and ``extra_logs``;
* ``execute`` returns ``observation_tokens`` (everything), ``action_ranges`` (``[start, end)`` of each action in
  them), ``rollout_log_probs`` (the engine's, 0 for other tokens; None unless ``sampling_params.logprobs`` is set),
  ``reward``, ``scores``, ``truncated``, ``extra_logs``, and the ``prompt`` / ``label`` / ``images`` given.

Images (vision-language agents) are refused: the loop here trains text models.
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from typing import Any

log = logging.getLogger(__name__)

#: The names this stand-in provides (what OpenRLHF's agent files import).
NAMES = ("AgentInstanceBase", "AgentExecutorBase", "MultiTurnAgentExecutor")


class AgentInstanceBase(ABC):
    """One sample's environment: ``reset`` (optional) and ``step``."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs):
        raise NotImplementedError


class AgentExecutorBase(ABC):
    """Runs one sample from its prompt to its last turn."""

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Alternates generation and ``AgentInstance.step`` until the instance says done or ``max_length`` is used."""

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"{agent_instance_cls!r} must be a class inheriting from AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        if images:
            raise NotImplementedError("agent samples with images are not supported (hybrid trains text models)")
        instance = self.agent_instance_cls()
        text = (await instance.reset({"observation": prompt, "label": label}))["observation"]
        tokens = _encode(hf_tokenizer, text)
        room = max_length - (getattr(sampling_params, "max_tokens", None) or 1)
        if len(tokens) > room:  # keep the end of an overlong first observation, leaving room to generate
            log.warning(
                "agent: the first observation has %d tokens, more than max_length leaves (%d); its start is cut",
                len(tokens),
                room,
            )
            tokens = tokens[-room:] if room > 0 else []
            text = hf_tokenizer.decode(tokens, skip_special_tokens=False)
        logprobs = [0.0] * len(tokens) if sampling_params.logprobs is not None else None
        ranges: list[tuple[int, int]] = []
        reward, scores, extra, truncated = 0.0, None, {}, False
        while max_length - len(tokens) > 0:
            sampling_params.max_tokens = max_length - len(tokens)
            answer = await llm_engine.generate(tokens, copy.deepcopy(sampling_params), multi_modal_data=None)
            out = answer.outputs[0]
            action = list(out.token_ids)
            truncated = out.finish_reason == "length"
            ranges.append((len(tokens), len(tokens) + len(action)))
            result = await instance.step(
                {"observation_text": text, "action_text": out.text, "label": label, "sampling_params": sampling_params}
            )
            reward += _item(result["rewards"])
            scores = result.get("scores", reward)
            feedback = result["environment_feedback"]
            extra = result.get("extra_logs", {})
            feedback_tokens = _encode(hf_tokenizer, feedback)
            text = text + out.text + feedback
            tokens = tokens + action + feedback_tokens
            if logprobs is not None:
                logprobs += [out.logprobs[i][t].logprob for i, t in enumerate(action)]
                logprobs += [0.0] * len(feedback_tokens)
            if result.get("sampling_params"):
                sampling_params = result["sampling_params"]
            if result["done"]:
                break
        return {
            "prompt": prompt,
            "label": label,
            "images": images,
            "mm_train_inputs": None,
            "reward": reward,
            "scores": reward if scores is None else _item(scores),
            "observation_tokens": tokens,
            "action_ranges": ranges,
            "rollout_log_probs": logprobs,
            "truncated": truncated,
            "extra_logs": extra,
        }


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _item(value: Any) -> float:
    return float(value.item()) if hasattr(value, "item") else float(value)
