"""It learns to use a tool: on the built-in lookup task (``--task lookup``: the answer is a value only a tool call
returns, and an answer given without a lookup scores 0, so no single turn can earn the reward) GRPO lifts the reward
from <= 0.2 to >= 0.9 within 5 minutes on a 2-core CPU.

Through the public API: a real local Ray cluster with a fake GPU, the built-in engine, DeepSpeed, multi-turn
conversations whose tool replies are masked out of the loss. The final model, run greedily through the same
multi-turn rollout on prompts it never saw, calls the tool and then answers with what it said.
"""

from __future__ import annotations

import statistics

import pytest

from hybrid_algos.train import GRPOConfig, train
from hybrid_algos.train.deepspeed_ops import ensure_cpu_ops_built

SETTINGS = dict(
    task="lookup",
    task_length=1,
    max_steps=40,
    rollout_batch_size=16,
    n_samples_per_prompt=16,
    train_batch_size=128,
    micro_train_batch_size=128,
    micro_rollout_batch_size=64,
    max_epochs=2,
    actor_learning_rate=2e-3,
    adam_betas=(0.9, 0.999),
    use_kl_loss=True,
    kl_estimator="k3",
    init_kl_coef=1e-3,
    lr_scheduler="cosine_with_min_lr",
    min_lr_ratio=0.1,
    call_timeout_s=300,
    final_checkpoint=False,
)
BAR = 0.9
#: The reward must reach the bar by this step and the last HOLD steps must average above it. The cosine decay (as in
#: the demo) is what holds it: at a constant 2e-3, seed 2 crossed at step 23 and then swung between 0.66 and 0.98.
CROSS_BY, HOLD = 30, 8


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [1, 2])
def test_grpo_learns_to_call_the_tool_then_answer(seed, tmp_path):
    ensure_cpu_ops_built()  # a fresh clone compiles DeepSpeed's CPU ops once (minutes)
    summary = train(GRPOConfig(save_path=str(tmp_path / "run"), seed=seed, **SETTINGS))

    history = summary["history"]
    rewards = [m["reward"] for m in history]
    shown = [round(r, 2) for r in rewards]
    assert len(rewards) == SETTINGS["max_steps"]
    assert rewards[0] <= 0.2, f"the untrained policy should be near 0, got {rewards[0]:.3f}"
    crossed = next((i for i, r in enumerate(rewards) if r >= BAR), None)
    assert crossed is not None and crossed < CROSS_BY, f"seed {seed} did not reach {BAR} by step {CROSS_BY}: {shown}"
    assert statistics.mean(rewards[-HOLD:]) >= BAR, f"seed {seed} did not hold {BAR}: {shown}"
    # it got there by calling the tool: one call, then the answer (two turns, the reply masked in between)
    last = history[-1]
    assert last["agent/info/tool_calls"] >= 0.9 and last["agent/turns"] >= 1.9 and last["agent/env_tokens"] >= 1.5
    assert history[0]["agent/info/tool_calls"] < 0.8  # untrained, it often answers (a guess) without calling
    assert history[0]["agent/turn1/samples"] == 256 and last["agent/turn2/samples"] >= 0.9 * 256
    assert _greedy_accuracy(summary["final_model"]) >= BAR


def _greedy_accuracy(model_dir: str) -> float:
    from transformers import AutoTokenizer

    from hybrid_algos.train.agents import AgentRollout, builtin_agent
    from hybrid_algos.train.tasks import EOS, task_from_config
    from hybrid_engines import HFEngine, SamplingParams

    config = GRPOConfig(**SETTINGS).validate()
    prompts = task_from_config(config).prompts(64, seed=123)
    engine = HFEngine(model_dir, device="cpu", dtype="float32")
    rollout = AgentRollout(builtin_agent(config), config.rollout_settings(), AutoTokenizer.from_pretrained(model_dir))
    try:
        batch = rollout.run(
            engine, prompts, SamplingParams(temperature=0, max_new_tokens=12, n=1, stop_token_ids=(EOS,)), step=0
        )
    finally:
        rollout.close()
    return float(batch.rewards.mean())
