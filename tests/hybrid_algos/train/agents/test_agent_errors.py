"""Bad environments fail clearly: an exception in step, a wrong return shape, a turn that never ends (bounded by
--max_turns, by --agent_timeout_s, and by the watchdog when a blocking call freezes the event loop), a reply that
overflows the response budget, a broken or OpenRLHF-incompatible file. Each ends the sample or the run with a
message naming the agent file and the fix. Real engine (tiny model), real files loaded with --agent_func_path."""

from __future__ import annotations

import logging
import textwrap

import pytest

from hybrid_algos.train.agents import AgentError, AgentRollout, load_agent
from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.dynamic_sampling import shape_rewards
from hybrid_algos.train.tasks import EOS, SyntheticTask
from hybrid_core.errors import ConfigError
from hybrid_engines import HFEngine, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    from hybrid_algos.train.tiny import save_tiny_model

    path = save_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3)
    return HFEngine(path, device="cpu", dtype="float32"), AutoTokenizer.from_pretrained(path)


def _file(tmp_path, source: str, name: str = "env.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def _run(tiny, path: str, *, n: int = 2, budget: int = 12, **changes):
    engine, tok = tiny
    settings = dict(
        task="copy",
        task_length=1,
        rollout_batch_size=2,
        n_samples_per_prompt=n,
        train_batch_size=2 * n,
        micro_train_batch_size=2 * n,
        agent_func_path=path,
        generate_max_len=budget,
        max_new_tokens_per_turn=3,
        seed=1,
    )
    cfg = GRPOConfig(**{**settings, **changes}).validate()
    agent = AgentRollout(load_agent(path), cfg.rollout_settings(), tok, context_limit=256)
    prompts = SyntheticTask("copy", prompt_symbols=1).prompts(2, seed=1)
    try:
        return agent.run(
            engine, prompts, SamplingParams(max_new_tokens=budget, n=n, stop_token_ids=(EOS,), seed=2), step=4
        )
    finally:
        agent.close()


RAISES = """
    class Environment:
        def reset(self, prompt, label):
            self.label = label

        def step(self, action):
            if self.label[0] % 2 == 0:
                raise ValueError("the tool crashed")
            return {"feedback": "", "reward": 1.0, "done": True}
"""


def test_exception_in_step_ends_the_run_naming_the_file_and_the_fix(tiny, tmp_path):
    path = _file(tmp_path, RAISES)
    with pytest.raises(AgentError) as e:
        _run(tiny, path)
    msg = str(e.value)
    assert f"agent {path}: step raised ValueError: the tool crashed" in msg
    assert "step 5, sample" in msg and "Fix:" in msg and "--agent_on_error end_sample" in msg


def test_exception_in_step_with_end_sample_ends_only_that_sample(tiny, tmp_path, caplog):
    path = _file(tmp_path, RAISES)
    prompts = SyntheticTask("copy", prompt_symbols=1).prompts(2, seed=1)
    assert {p.label[0] % 2 for p in prompts} == {0, 1}  # one prompt's samples fail, the other's do not
    with caplog.at_level(logging.WARNING):
        batch = _run(tiny, path, agent_on_error="end_sample")
    flat = [c for g in batch.conversations for c in g]
    failed = [c for c in flat if c.failed]
    assert len(failed) == 2 and all(path in c.failed and "the tool crashed" in c.failed for c in failed)
    assert all(c.reward == 0.0 and c.response == [] for c in failed)
    assert all(c.reward == 1.0 for c in flat if not c.failed)
    _, mask, _ = shape_rewards(GRPOConfig().algorithm_settings(), batch.outputs, batch.rewards, 12)
    assert mask.tolist() == [not c.failed for c in flat]  # left out of the policy loss
    assert any(path in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            """
     class Environment:
         def step(self, action):
             return [action, 1.0]
     """,
            "step returned a list",
        ),
        (
            """
     class Environment:
         async def step(self, action):
             return {"feedback": "", "reward": "high", "done": True}
     """,
            "reward is a str ('high'); it must be a number",
        ),
        (
            """
     import torch
     from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

     class AgentInstance(AgentInstanceBase):
         def __init__(self, *args, **kwargs):
             pass

         async def step(self, states, **kwargs):
             return {"rewards": torch.tensor(1.0), "environment_feedback": ""}

     class AgentExecutor(MultiTurnAgentExecutor):
         def __init__(self):
             super().__init__(AgentInstance)
     """,
            "step returned a dict without 'done'",
        ),
    ],
)
def test_wrong_return_shape_names_what_was_expected(tiny, tmp_path, source, expected):
    path = _file(tmp_path, source)
    with pytest.raises(AgentError) as e:
        _run(tiny, path)
    msg = str(e.value)
    assert path in msg and "wrong shape" in msg and expected in msg and "Fix: return" in msg


def test_episode_that_never_ends_stops_at_max_turns(tiny, tmp_path, caplog):
    path = _file(
        tmp_path,
        """
        class Environment:
            def step(self, action):
                return {"feedback": "s1", "reward": 0.25, "done": False}
    """,
    )
    with caplog.at_level(logging.WARNING):
        batch = _run(tiny, path, max_turns=3, budget=20)
    flat = [c for g in batch.conversations for c in g]
    assert all(c.turns == 3 and c.hit_max_turns and c.reward == 0.75 for c in flat)
    warning = [r.getMessage() for r in caplog.records if "--max_turns" in r.getMessage()]
    assert warning and path in warning[0] and "Fix:" in warning[0]


def test_openrlhf_episode_that_never_ends_stops_at_max_turns(tiny, tmp_path):
    path = _file(
        tmp_path,
        """
        import torch
        from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

        class AgentInstance(AgentInstanceBase):
            def __init__(self, *args, **kwargs):
                pass

            async def step(self, states, **kwargs):
                return {"rewards": torch.tensor(0.5), "scores": torch.tensor(0.5), "environment_feedback": " s1",
                        "done": False}

        class AgentExecutor(MultiTurnAgentExecutor):
            def __init__(self):
                super().__init__(AgentInstance)
    """,
    )
    batch = _run(tiny, path, max_turns=2, budget=20)
    assert all(c.turns == 2 and c.hit_max_turns and c.reward == 1.0 for g in batch.conversations for c in g)


def test_step_that_hangs_times_out(tiny, tmp_path):
    path = _file(
        tmp_path,
        """
        import asyncio

        class Environment:
            async def step(self, action):
                await asyncio.sleep(60)
    """,
    )
    with pytest.raises(AgentError) as e:
        _run(tiny, path, agent_timeout_s=0.5)
    msg = str(e.value)
    assert f"agent {path}: step did not return within --agent_timeout_s 0.5 s" in msg and "Fix:" in msg


def test_blocking_call_inside_async_def_is_caught_by_the_watchdog(tiny, tmp_path):
    path = _file(
        tmp_path,
        """
        import time

        class Environment:
            async def step(self, action):
                time.sleep(8)  # blocks the event loop: no other sample, no timeout can run
                return {"feedback": "", "reward": 0.0, "done": True}
    """,
    )
    with pytest.raises(AgentError) as e:
        _run(tiny, path, agent_timeout_s=1.0)
    msg = str(e.value)
    assert path in msg and "event loop has been blocked" in msg and "plain def" in msg


def test_executor_waiting_on_something_else_is_caught_by_the_watchdog(tiny, tmp_path):
    path = _file(
        tmp_path,
        """
        import asyncio
        from openrlhf.utils.agent import AgentExecutorBase

        class AgentExecutor(AgentExecutorBase):
            async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
                await asyncio.Event().wait()  # never set
    """,
    )
    with pytest.raises(AgentError) as e:
        _run(tiny, path, agent_timeout_s=1.0)
    msg = str(e.value)
    assert path in msg and "neither the engine nor an environment call" in msg and "Fix:" in msg


def test_reply_that_overflows_the_response_budget_ends_the_sample(tiny, tmp_path, caplog):
    path = _file(
        tmp_path,
        """
        class Environment:
            def step(self, action):
                return {"feedback": " ".join(["s1"] * 40), "reward": 1.0, "done": False}
    """,
    )
    with caplog.at_level(logging.WARNING):
        batch = _run(tiny, path, budget=12)
    flat = [c for g in batch.conversations for c in g]
    assert all(c.turns == 1 and c.overflow_tokens > 0 and c.finish_reason == "length" for c in flat)
    assert all(len(c.response) <= 12 and sum(c.action_mask) == len(c.response) for c in flat)
    warning = [r.getMessage() for r in caplog.records if "did not fit" in r.getMessage()]
    assert warning and path in warning[0] and "--generate_max_len" in warning[0]


def test_openrlhf_reply_that_overflows_is_cut_to_the_budget(tiny, tmp_path):
    path = _file(
        tmp_path,
        """
        import torch
        from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

        class AgentInstance(AgentInstanceBase):
            def __init__(self, *args, **kwargs):
                pass

            async def step(self, states, **kwargs):
                return {"rewards": torch.tensor(1.0), "environment_feedback": " s1" * 40, "done": False}

        class AgentExecutor(MultiTurnAgentExecutor):
            def __init__(self):
                super().__init__(AgentInstance)
    """,
    )
    batch = _run(tiny, path, budget=12)
    for c in (c for g in batch.conversations for c in g):
        assert len(c.response) == 12 and c.overflow_tokens > 0 and c.turns == 1


# ---- loading ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "source, expected",
    [
        ("x = 1\n", "defines neither AgentExecutor (OpenRLHF's agent files) nor Environment"),
        ("from openrlhf.utils.logging_utils import init_logger\n", "stand-in provides only openrlhf.utils.agent's"),
        ("from openrlhf.utils.agent import GuidedMultiTurnAgentExecutor\n", "Install OpenRLHF"),
        ("raise RuntimeError('no API key')\n", "raised RuntimeError: no API key"),
        (
            "from openrlhf.utils.agent import MultiTurnAgentExecutor\n\n"
            "class AgentExecutor(MultiTurnAgentExecutor):\n"
            "    def __init__(self, env):\n        super().__init__(env)\n",
            "OpenRLHF builds the executor with no arguments",
        ),
        ("class AgentExecutor:\n    pass\n", "must inherit from openrlhf.utils.agent's AgentExecutorBase"),
    ],
)
def test_broken_agent_files_fail_before_the_run_naming_the_file(tmp_path, source, expected):
    path = _file(tmp_path, source)
    with pytest.raises(ConfigError) as e:
        load_agent(path)
    assert e.value.field == "agent_func_path" and path in str(e.value) and expected in str(e.value)
    assert e.value.fix


def test_config_refuses_what_an_agent_run_would_ignore(tmp_path):
    path = _file(tmp_path, "class Environment:\n    def step(self, action):\n        return ('', 0.0, True)\n")
    base = dict(
        task="copy",
        task_length=1,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        train_batch_size=4,
        micro_train_batch_size=4,
    )
    GRPOConfig(agent_func_path=path, **base).validate()
    cases = [
        (dict(agent_func_path=path, reward_fn=f"{path}:x"), "reward_fn", "rewarded by its environment"),
        (dict(max_turns=3), "max_turns", "no environment"),
        (dict(agent_on_error="end_sample"), "agent_on_error", "no environment"),
        (dict(agent_func_path=path, agent_on_error="skip"), "agent_on_error", "raise, end_sample"),
        (dict(agent_func_path=path, agent_timeout_s=0.0), "agent_timeout_s", "> 0"),
        (dict(agent_func_path=str(tmp_path / "missing.py")), "agent_func_path", "no file"),
        (dict(agent_func_path=path, max_new_tokens_per_turn=4096), "max_new_tokens_per_turn", "generate_max_len"),
    ]
    for changes, field, text in cases:
        with pytest.raises(ConfigError) as e:
            GRPOConfig(**{**base, **changes}).validate()
        assert e.value.field == field and text in str(e.value), (changes, str(e.value))
