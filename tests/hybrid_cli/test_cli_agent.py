"""``hybrid ppo`` / ``hybrid grpo`` with ``--agent_func_path``: an OpenRLHF agent file (imports from
``openrlhf.utils.agent`` as written, OpenRLHF not installed) and a file in hybrid's own interface, through the command
line, for a few steps each; the per-turn metrics reach metrics.jsonl and ``--max_turns`` bounds every sample."""

import json
import sys

import pytest

from hybrid_cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SMALL = [
    "--task",
    "lookup",
    "--task_length",
    "1",
    "--rollout_batch_size",
    "4",
    "--n_samples_per_prompt",
    "4",
    "--train_batch_size",
    "16",
    "--micro_train_batch_size",
    "16",
    "--seed",
    "5",
    "--no_use_tensorboard",
    "--no_final_checkpoint",
    "--max_steps",
    "3",
]

OPENRLHF_FILE = '''
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    """Never done by itself: --max_turns ends every sample."""

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        reward = torch.tensor(float(states["action_text"].startswith("s%d" % states["label"])))
        return {"rewards": reward, "scores": reward, "environment_feedback": " <sep> s%d" % states["label"],
                "done": False, "sampling_params": states.get("sampling_params"), "extra_logs": {"turn": self.turn}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''

HYBRID_FILE = '''
import asyncio

from hybrid_algos.train.agents import StepResult


class Environment:
    """Two turns: the first answers with the hidden value (as a tool), the second is scored."""

    def reset(self, prompt, label):
        self.value, self.turn = label, 0

    async def step(self, action):
        self.turn += 1
        await asyncio.sleep(0)
        if self.turn == 1:
            return StepResult(feedback="s%d" % self.value, role="tool")
        return StepResult(reward=float(action.split()[:1] == ["s%d" % self.value]), done=True, info={"second": 1.0})
'''


def _metrics(run):
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_openrlhf_agent_file_runs_with_the_command_line(algo, tmp_path):
    agent = tmp_path / "agent_func.py"
    agent.write_text(OPENRLHF_FILE)
    run = tmp_path / algo
    assert (
        main(
            [
                algo,
                "--save_path",
                str(run),
                "--agent_func_path",
                str(agent),
                "--max_turns",
                "2",
                "--max_new_tokens_per_turn",
                "2",
                "--generate_max_len",
                "12",
                *SMALL,
            ]
        )
        == 0
    )
    assert "openrlhf" not in sys.modules  # the stand-in was there only while the file loaded
    history = _metrics(run)
    assert len(history) == 3
    for m in history:  # never done by itself: --max_turns 2 ended every sample after its second turn
        assert m["agent/turns"] == 2 and m["agent/max_turns_frac"] == 1 and m["agent/info/turn"] == 2
        # " <sep> s5" after each turn (OpenRLHF's executor appends the last reply too; masked out like the others)
        assert m["agent/turn2/samples"] == 16 and m["agent/turn1/env_tokens"] == 2 and m["agent/turn2/env_tokens"] == 2
        assert m["agent/turn1/generate_s"] > 0 and m["agent/env_s"] >= 0 and 0 <= m["reward"] <= 2
        if algo == "ppo":
            assert "critic/loss" in m or any(k.startswith("critic/") for k in m)


def test_hybrid_environment_file_runs_with_the_command_line(tmp_path):
    env = tmp_path / "env.py"
    env.write_text(HYBRID_FILE)
    run = tmp_path / "grpo"
    assert (
        main(
            [
                "grpo",
                "--save_path",
                str(run),
                "--agent_func_path",
                f"{env}:Environment",
                "--max_new_tokens_per_turn",
                "2",
                "--generate_max_len",
                "8",
                *SMALL,
            ]
        )
        == 0
    )
    for m in _metrics(run):
        assert m["agent/turns"] == 2 and m["agent/info/second"] == 1 and m["agent/max_turns_frac"] == 0
        assert m["agent/turn1/env_tokens"] == 1 and m["agent/model_tokens"] <= 4  # "s5", as plain text: one token


def test_dry_run_names_the_environment_and_its_turns(tmp_path, capsys):
    agent = tmp_path / "agent_func.py"
    agent.write_text(OPENRLHF_FILE)
    assert (
        main(
            [
                "grpo",
                "--dry-run",
                "--save_path",
                str(tmp_path / "run"),
                "--task",
                "lookup",
                "--agent_func_path",
                str(agent),
                "--max_turns",
                "4",
            ]
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "OpenRLHF AgentExecutor" in out and "agent_func.py" in out and "up to 4 turns" in out


def test_broken_agent_file_exits_2_naming_the_file_and_the_fix(tmp_path, capsys):
    agent = tmp_path / "agent_func.py"
    agent.write_text("from openrlhf.utils.agent import AgentInstanceBase\n\nclass AgentExecutor:\n    pass\n")
    assert main(["grpo", "--dry-run", "--save_path", str(tmp_path / "run"), "--agent_func_path", str(agent)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "agent_func_path" in err and "agent_func.py" in err and "MultiTurnAgentExecutor" in err
