"""DAPO in the rollout phase with the real built-in engine and the built-in task's rule reward: dynamic sampling
keeps only informative groups and generates more prompts until the batch is full (or the cap is hit, then fills
with dropped groups and says so); the overlong penalty and the truncation mask."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybrid_algos import informative_groups
from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.dynamic_sampling import sample_rollout, shape_rewards
from hybrid_algos.train.rewards import RewardScorer
from hybrid_algos.train.tasks import SyntheticTask
from hybrid_engines import GenerationOutput, HFEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from hybrid_algos.train.tiny import save_tiny_model

    return HFEngine(save_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=3), device="cpu", dtype="float32")


def _ctx(engine, **changes):
    task = SyntheticTask("copy", prompt_symbols=1)
    cfg = GRPOConfig(
        task_length=1, rollout_batch_size=4, n_samples_per_prompt=4, dynamic_filtering=True, seed=7, **changes
    )
    pool = task.prompts(64, seed=11)
    ctx = SimpleNamespace(
        settings=cfg.settings(), engines=engine, reward=RewardScorer(task.reward_fn(), str), prompt_pool=pool
    )
    return ctx, pool[:4], SamplingParams(max_new_tokens=2, n=4, seed=5)


def test_keeps_only_informative_groups_and_generates_more_to_fill(engine):
    ctx, prompts, sampling = _ctx(engine)
    first = sample_rollout(
        ctx.__class__(**{**vars(ctx), "settings": ctx.settings.with_changes(algorithm={"dynamic_filtering": False})}),
        0,
        prompts,
        sampling,
    )
    first_scores = ctx.reward.score(first.prompts, first.outputs)
    dropped_in_first = int((~informative_groups(first_scores, n_samples_per_prompt=4)).sum()) // 4
    assert dropped_in_first > 0  # an untrained policy: some groups scored all 0 -- the case to handle

    out = sample_rollout(ctx, 0, prompts, sampling)
    assert len(out.prompts) == len(out.outputs) == 4 and all(len(o) == 4 for o in out.outputs)
    assert torch.equal(out.scores, ctx.reward.score(out.prompts, out.outputs))
    m = out.metrics
    assert m["dynamic_sampling/generated_prompts"] > 4 and m["dynamic_sampling/rounds"] >= 2
    assert m["dynamic_sampling/generated_samples"] == 4 * m["dynamic_sampling/generated_prompts"]
    if m["dynamic_sampling/filled_groups"] == 0:
        assert informative_groups(out.scores, n_samples_per_prompt=4).all()
    # the same step draws the same extra prompts (a resumed run sees the same batch)
    again = sample_rollout(ctx, 0, prompts, sampling)
    assert [p.prompt_ids for p in again.prompts] == [p.prompt_ids for p in out.prompts]
    assert torch.equal(again.scores, out.scores)


def test_cap_on_rounds_fills_with_dropped_groups_and_reports_it(engine):
    ctx, prompts, sampling = _ctx(engine, dynamic_filtering_max_rounds=0)
    out = sample_rollout(ctx, 1, prompts, sampling)
    m = out.metrics
    assert m["dynamic_sampling/rounds"] == 1 and m["dynamic_sampling/generated_prompts"] == 4
    kept = int(informative_groups(out.scores, n_samples_per_prompt=4).sum()) // 4
    assert m["dynamic_sampling/filled_groups"] == 4 - kept and len(out.prompts) == 4
    assert m["dynamic_sampling/pass_rate"] == pytest.approx(kept / 4)


def test_range_filter_drops_groups_by_mean_reward(engine):
    ctx, prompts, sampling = _ctx(engine, dynamic_filtering_reward_range=(0.3, 1.0), dynamic_filtering_max_rounds=20)
    out = sample_rollout(ctx, 2, prompts, sampling)
    if out.metrics["dynamic_sampling/filled_groups"] == 0:
        means = out.scores.view(4, 4).mean(-1)
        assert bool((means > 0.3).all()) and bool((means < 1.0).all())


def _out(n_tokens: int, reason: str) -> GenerationOutput:
    return GenerationOutput(prompt_token_ids=[1], token_ids=[5] * n_tokens, logprobs=None, finish_reason=reason)


def test_overlong_penalty_and_truncation_mask():
    outputs = [[_out(2, "stop"), _out(7, "stop")], [_out(8, "length"), _out(5, "stop")]]
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5])
    cfg = GRPOConfig(overlong_buffer_len=4, overlong_penalty_factor=1.0, mask_truncated_completions=True)
    shaped, sample_mask, metrics = shape_rewards(cfg.algorithm_settings(), outputs, scores, max_new_tokens=8)
    assert shaped.tolist() == pytest.approx([1.0, 1.0 - 3 / 4, 0.0 - 1.0, 0.5 - 1 / 4])
    assert sample_mask.tolist() == [True, True, False, True]
    assert metrics["rollout/truncated_frac"] == 0.25 and metrics["reward/overlong_penalty"] == pytest.approx(-0.5)
    plain, none, _ = shape_rewards(GRPOConfig().algorithm_settings(), outputs, scores, max_new_tokens=8)
    assert torch.equal(plain, scores) and none is None
