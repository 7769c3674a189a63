"""OpenRLHF's agent files run unchanged: a file written from OpenRLHF 0.11.2's documented interface, importing from
``openrlhf.utils.agent`` as OpenRLHF's examples do, trains for several steps through the public API -- real local
Ray with a fake GPU, the built-in engine, DeepSpeed -- without OpenRLHF installed (hybrid's stand-in is in
``sys.modules`` only while the file loads, and a log line says so). The flag in OpenRLHF's spelling reaches it."""

from __future__ import annotations

import logging
import sys

import pytest

from hybrid_algos.train import GRPOConfig, train

AGENT_FILE = """
import re
from typing import Any, Dict

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


# The lookup task's protocol: a turn that does not start with a symbol calls the tool, which answers with the hidden
# value; a symbol is the answer.
class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.calls = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        words = states["action_text"].split()
        symbol = int(words[0][1:]) if words and re.fullmatch(r"s[0-7]", words[0]) else None
        if symbol is None:
            self.calls += 1
            return {"rewards": torch.tensor(0.0), "scores": torch.tensor(0.0),
                    "environment_feedback": f" <sep> s{states['label']}", "done": False,
                    "sampling_params": states.get("sampling_params", None), "extra_logs": {"calls": float(self.calls)}}
        reward = torch.tensor(1.0 if symbol == states["label"] else 0.0)
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True,
                "sampling_params": states.get("sampling_params", None),
                "extra_logs": {"calls": float(self.calls), "answered": 1.0}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text(AGENT_FILE)
    return str(path)


def test_openrlhf_agent_file_trains_for_several_steps(agent_file, tmp_path, caplog):
    assert "openrlhf" not in sys.modules
    config = GRPOConfig(
        save_path=str(tmp_path / "run"),
        task="lookup",
        task_length=1,
        agent_func_path=agent_file,
        max_turns=3,
        max_new_tokens_per_turn=2,
        generate_max_len=12,
        max_steps=4,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        train_batch_size=16,
        micro_train_batch_size=16,
        micro_rollout_batch_size=16,
        actor_learning_rate=2e-3,
        seed=3,
        call_timeout_s=120,
        step_timeout_s=300,
    )
    with caplog.at_level(logging.INFO, logger="hybrid_algos.train.agents.loader"):
        summary = train(config)
    assert any("OpenRLHF is not installed" in r.getMessage() and agent_file in r.getMessage() for r in caplog.records)
    assert "openrlhf" not in sys.modules and "openrlhf.utils.agent" not in sys.modules  # only while it loaded
    history = summary["history"]
    assert len(history) == 4
    for m in history:
        assert 0.0 <= m["reward"] <= 1.0 and m["agent/turn1/samples"] == 16 and m["agent/turns_max"] <= 3
        # a sample's turns: its tool calls, plus the answer unless --max_turns ended it first
        assert m["agent/turns"] == pytest.approx(m["agent/info/calls"] + 1 - m["agent/max_turns_frac"])
        assert m["agent/model_tokens"] >= 1 and m["actor/micro_batches"] >= 1 and m["time/train"] > 0
    assert any(m["agent/env_tokens"] > 0 for m in history)  # the tool answered (its tokens are in the samples)
    assert any(m.get("agent/info/answered") == 1.0 for m in history)
    assert summary["final_model"]


def test_openrlhf_flag_spellings_reach_the_agent(agent_file):
    from hybrid_cli.main import load_config

    # an OpenRLHF line takes OpenRLHF's default of one sample per prompt, which GRPO refuses: give several
    for flag, samples in (
        ("--train.agent_func_path", "--rollout.n_samples_per_prompt"),
        ("--agent_func_path", "--n_samples_per_prompt"),
    ):
        config, _, _ = load_config("grpo", ["--task", "lookup", "--task_length", "1", flag, agent_file, samples, "4"])
        assert config.agent_func_path == agent_file and config.uses_agent
