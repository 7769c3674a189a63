"""Evaluation during training in a real run (local Ray, a fake GPU, the built-in engine, DeepSpeed on the CPU): the
held-out prompts are evaluated after the steps --eval_steps names and after the last, their reward tracks the
training reward as the demo learns the copy task, and a run with evaluation trains exactly as the same run without.
"""

from __future__ import annotations

import json

import pytest
from tiny_runs import TINY

from hybrid_algos.train import GRPOConfig, PPOConfig, train
from hybrid_algos.train.config import DEMO_SETTINGS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_gpu_ray")]

#: metrics that are not the training's own (the evaluation's, wall-clock times, memory moved)
NOT_TRAINING = ("eval/", "time/", "bytes/", "residency/")


@pytest.fixture
def held_out(tmp_path) -> str:
    """Every prompt of the demo's task (one symbol to copy), as a JSONL file: prompt text and the answer's label."""
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"<bos> s{s} <sep>", "label": [s]}) + "\n" for s in range(8)))
    return str(path)


class Recorder:
    """A training callback keeping what every sink is handed (metrics.jsonl, TensorBoard and W&B get on_step's)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_step(self, metrics: dict) -> None:
        self.steps.append(dict(metrics))


def test_eval_metrics_come_at_their_steps_and_track_the_training_reward(tmp_path, held_out):
    """The demo (GRPO, copy task) for 16 steps, evaluated every 4: after steps 4, 8, 12, 16 and no others. At the
    training's temperature (1.0) the evaluation samples the policy the next step's rollout samples (the weights just
    synced), so its reward is that step's training reward up to sampling noise, and it rises as training does."""
    settings = {**DEMO_SETTINGS, "max_steps": 16, "final_checkpoint": False, "call_timeout_s": 300}
    config = GRPOConfig(
        save_path=str(tmp_path / "run"),
        seed=1,
        eval_dataset=held_out,
        input_key="prompt",
        label_key="label",
        eval_steps=4,
        eval_temperature=1.0,
        eval_n_samples_per_prompt=8,
        logging_steps=5,  # evaluation steps are handed to the sinks whatever --logging_steps says
        **settings,
    )
    sinks = Recorder()
    summary = train(config, callbacks=[sinks])

    history = summary["history"]
    evaluated = [m["step"] + 1 for m in history if "eval/reward_mean" in m]
    assert evaluated == [4, 8, 12, 16]
    assert [m["step"] + 1 for m in sinks.steps] == [4, 5, 8, 10, 12, 15, 16]  # every 5th, the evaluations, the last
    assert all("eval/reward_mean" in m for m in sinks.steps if (m["step"] + 1) % 4 == 0)
    assert "eval" in [p.name for p in summary["residency"].phases]  # the plan includes the eval phase
    rewards = [m["reward"] for m in history]
    trace = []
    for step in evaluated:
        m = history[step - 1]
        assert m["eval/prompts"] == 8 and m["eval/response_length"] == pytest.approx(2.0, abs=0.2)  # s_i <eos>
        assert 0 <= m["eval/reward_mean"] <= m["eval/pass@8"] <= 1 and m["time/eval"] > 0
        same_policy = rewards[step] if step < len(rewards) else rewards[-1]  # the next rollout's weights
        trace.append((step, round(m["eval/reward_mean"], 3), round(same_policy, 3)))
    print("step, eval/reward_mean, training reward with the same weights:", trace)
    for _, eval_reward, train_reward in trace:
        assert abs(eval_reward - train_reward) <= 0.2, trace
    first, last = trace[0][1], trace[-1][1]
    assert first <= 0.6 and last >= 0.75 and last - first >= 0.25, trace  # it learns, and the evaluation sees it


def test_a_run_with_evaluation_trains_as_the_run_without(tmp_path, held_out):
    """Evaluation generates with seeds of its own and scores without normalising: the training samples, rewards and
    updates are those of the same run without it, step for step. The engine samples unseeded training calls from its
    own random stream here (no seed per sample), so an evaluation that drew from that stream would show. PPO (the
    eval phase comes after the critic's update) with every role sleeping between its phases: the evaluation wakes the
    engines and puts them back, and that changes nothing either."""
    runs = {}
    for name, extra in (
        ("plain", {}),
        ("evaluated", dict(eval_dataset=held_out, input_key="prompt", label_key="label", eval_steps=1)),
    ):
        config = PPOConfig(
            save_path=str(tmp_path / name),
            max_steps=2,
            final_checkpoint=False,
            normalize_reward=True,
            seeded_sampling=False,
            residency="all-sleep",
            **TINY,
            **extra,
        )
        runs[name] = train(config)["history"]
    plain, evaluated = runs["plain"], runs["evaluated"]
    assert all(m["bytes/wake"] > 0 for m in evaluated)  # the roles really moved
    assert [m["step"] + 1 for m in evaluated if "eval/reward_mean" in m] == [1, 2]  # step 2 trains after one
    for a, b in zip(plain, evaluated, strict=True):
        training = {k: v for k, v in a.items() if not k.startswith(NOT_TRAINING)}
        assert training == {k: v for k, v in b.items() if not k.startswith(NOT_TRAINING)}
