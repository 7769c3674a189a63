"""It must learn: PPO, REINFORCE++ and GRPO each lift the reward of a verifiable task from chance to >= 0.9, on any
machine: three seeds each, every one crossing the bar well before the step limit.

Through the public API, on a real local Ray cluster with a fake GPU, the built-in engine and DeepSpeed, every role
colocated on that GPU with sleep enabled, so each step really offloads and reloads the actor and the engine.
The task: copy the prompt's symbol (8 symbols; a random policy scores ~1/12). Every role is there: actor, engine,
reference (KL), the rule reward, and the critic for PPO.

Why these settings (measured on a 2-core machine, 4-8 seeds each; bench/NOTES.md has the table):
- Adam's beta2 = 0.999, not OpenRLHF's 0.95. With 0.95 the step-size normaliser forgets in ~20 updates; once most
  groups are solved, the few gradients left (and the KL term's) are scaled up to full learning-rate steps and knock
  solved prompts over: rewards of 0.98 fell back to 0.6-0.8 late in a run. That, with GRPO's zero advantage for a
  group whose samples are all wrong (a prompt whose answer the policy stopped sampling gets no signal, ever), was the
  GRPO plateau at ~0.83 on some CPUs: 2 of 3 seeds stayed below 0.9 at 48 steps with 0.95, 7 of 8 passed with 0.999.
- 16 samples per prompt instead of 8: an all-wrong group becomes rare (the 8th seed above was one), and the bar is
  reached in ~12-16 steps instead of ~20, so the runs are shorter.
- A cosine learning-rate decay to 0.1x (OpenRLHF's default schedule): at a constant 2e-3 the late updates keep
  knocking solved prompts over, and REINFORCE++ seed 1 hovered at 0.79-0.96 for its last 20 steps (last 8 averaging
  0.896, on CI and here alike); with the decay the same seed holds 0.96-0.99 from step 16.
- One symbol to copy, not two: with two, 80 steps were not enough on every seed (PPO and GRPO ended anywhere
  between 0.75 and 0.99 depending on the seed, with either beta2 and 8 or 16 samples).
- The float32 defects fixed alongside (k3 losing its gradient near the reference, equal group scores getting
  advantages, whitening of equal values not 0) do not explain the plateau: this task's scores (0 or 1) and their
  group sums are exact in float32. They matter with fractional scores and with --normalize_reward.
These are the demo's settings (DEMO_SETTINGS): what is tested is what ``hybrid ppo`` / ``hybrid grpo`` run.
"""

from __future__ import annotations

import statistics

import pytest

from hybrid_algos.train import CONFIGS, train
from hybrid_algos.train.config import DEMO_SETTINGS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_gpu_ray")]

#: The demo's own settings (``hybrid ppo`` / ``hybrid grpo`` with no flags), so the demo is what is tested -- but with
#: every role moving between its phases (on a CPU the residency planner would keep everything resident).
SETTINGS = {**DEMO_SETTINGS, "call_timeout_s": 300, "final_checkpoint": False, "residency": "all-sleep"}
SEEDS = (1, 2, 3)
BAR = 0.9
#: The reward must reach the bar by this step (3/4 of the run; typically it does by ~12-20), and the last quarter of
#: the run must average above it: the margin that makes the test portable (another CPU is another trajectory, as
#: another seed is).
CROSS_BY = 24
HOLD = 8


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("algo", ["ppo", "reinforce", "grpo"])
def test_algorithm_learns_the_copy_task(algo: str, seed: int, tmp_path) -> None:
    config = CONFIGS[algo](save_path=str(tmp_path / algo), seed=seed, **SETTINGS)
    summary = train(config)

    rewards = [m["reward"] for m in summary["history"]]
    shown = [round(r, 2) for r in rewards]
    assert len(rewards) == SETTINGS["max_steps"]
    assert rewards[0] <= 0.2, f"the untrained policy should be near chance, got {rewards[0]:.3f}"
    crossed = next((i + 1 for i, r in enumerate(rewards) if r >= BAR), None)
    assert crossed is not None and crossed <= CROSS_BY, (
        f"{algo} seed {seed}: reward >= {BAR} first at step {crossed}, wanted by step {CROSS_BY} (rewards: {shown})"
    )
    held = statistics.mean(rewards[-HOLD:])
    assert held >= BAR, f"{algo} seed {seed}: the last {HOLD} steps average {held:.3f} (rewards: {shown})"

    # Colocated with sleep: every role on the one GPU, and every step moved state off and back on.
    plan, residency = summary["plan"], summary["residency"]
    assert plan.num_gpus == 1 and residency.sleeps("actor") and residency.sleeps("rollout")
    assert ("critic" in plan.roles) == (algo == "ppo")
    lrs = [m["actor/lr"] for m in summary["history"]]  # the cosine schedule: from the rate down to its floor
    assert lrs[0] == pytest.approx(config.actor_learning_rate, rel=0.05)
    assert lrs[-1] == pytest.approx(config.actor_learning_rate * config.min_lr_ratio, rel=0.1)
    for m in summary["history"]:
        assert m["bytes/sleep"] > 0 and m["bytes/wake"] > 0 and m["time/generate"] > 0 and m["time/train"] > 0
    # The final policy is saved in Hugging Face format and is the trained one: greedy decoding answers far above
    # chance (1/12). Not >= 0.9: the last update alone can knock one symbol over for a step or two (GRPO seed 1:
    # step 32's update took symbol 6 from 1.0 to 0.17 after a 1-in-16 mistake on another prompt got advantage
    # -3.75 and the shared output embedding carried it over), which the sampled rewards above already saw as fine.
    greedy = _greedy_accuracy(summary["final_model"])
    assert greedy >= 0.75, f"{algo} seed {seed}: greedy accuracy {greedy:.3f} (rewards: {shown})"


def _greedy_accuracy(model_dir: str) -> float:
    from hybrid_algos.train.tasks import FIRST_SYMBOL_ID, SyntheticTask
    from hybrid_engines import HFEngine, SamplingParams

    task = SyntheticTask("copy", num_symbols=8, prompt_symbols=1)
    prompts = task.prompts(64, seed=123)
    engine = HFEngine(model_dir, device="cpu", dtype="float32")
    outs = engine.generate([p.prompt_ids for p in prompts], SamplingParams(temperature=0, max_new_tokens=1))
    return sum(o[0].token_ids[0] == FIRST_SYMBOL_ID + p.label[0] for p, o in zip(prompts, outs)) / len(prompts)
