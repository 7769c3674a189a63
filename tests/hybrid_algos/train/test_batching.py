"""Token-budget micro-batches (--use_dynamic_batch): every sample exactly once, the budget kept, the count agreed
across ranks honoured, and the micro-batches' weighted losses adding up to the loss over the whole update."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_algos import LOSS_AGG_MODES, compute_policy_loss
from hybrid_algos.train.batching import SampleShape, bin_cost, token_bins
from hybrid_algos.train.config import GRPOConfig
from hybrid_algos.train.experience import Rollout
from hybrid_algos.train.workers.policy import train_micro_batches

shapes_st = st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=24)


@settings(max_examples=80, deadline=None)
@given(raw=shapes_st, budget=st.integers(1, 80), packed=st.booleans(), extra=st.integers(0, 5))
def test_bins_cover_every_sample_once_within_the_budget(raw, budget, packed, extra):
    shapes = [SampleShape(p, r) for p, r in raw]
    bins = token_bins(shapes, budget, packed=packed)
    assert sorted(i for b in bins for i in b) == list(range(len(shapes)))
    for b in bins:  # over the budget only when one sample alone is
        assert bin_cost([shapes[i] for i in b], packed) <= budget or len(b) == 1
    count = min(len(bins) + extra, len(shapes))
    forced = token_bins(shapes, budget, packed=packed, count=count)  # what the other ranks agreed on
    assert len(forced) == count and sorted(i for b in forced for i in b) == list(range(len(shapes)))
    assert all(bin_cost([shapes[i] for i in b], packed) <= budget or len(b) == 1 for b in forced)


def test_packed_cost_counts_real_tokens_and_padded_cost_the_rectangle():
    shapes = [SampleShape(2, 10), SampleShape(8, 1)]
    assert bin_cost(shapes, packed=True) == 21
    assert bin_cost(shapes, packed=False) == 2 * (8 + 10)
    assert len(token_bins(shapes, 21, packed=True)) == 1 and len(token_bins(shapes, 21, packed=False)) == 2
    with pytest.raises(ValueError):
        token_bins(shapes, 21, packed=True, count=3)


def _rollout(seed: int) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for _ in range(6):
        prompts.append([1] + torch.randint(4, 12, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist())
        completions.append([torch.randint(4, 12, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
                            for _ in range(2)])
    ro = Rollout.from_generations(prompts, completions, 0)
    old = -torch.rand(ro.action_mask.shape, generator=g) * 3
    adv = torch.randn(ro.action_mask.shape, generator=g)
    return ro.with_(old_logprobs=old, advantages=adv, sample_mask=torch.rand(12, generator=g) > 0.2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_weighted_micro_batch_losses_add_up_to_the_update_loss(mode, packed):
    ro = _rollout(3)
    cfg = GRPOConfig(n_samples_per_prompt=2, rollout_batch_size=6, train_batch_size=12, micro_train_batch_size=12,
                     use_dynamic_batch=True, train_max_tokens_per_gpu=14, packing_samples=packed, loss_agg_mode=mode)

    def loss(r: Rollout) -> torch.Tensor:
        return compute_policy_loss("ppo", r.old_logprobs + 0.1, r.old_logprobs, r.advantages, r.loss_mask,
                                   agg_mode=mode, norm_len=8)[0]

    plan = train_micro_batches(ro, cfg, torch.device("cpu"))
    assert len(plan) > 2 and all(w is not None for _, w in plan)
    assert sum(w * loss(mb) for mb, w in plan).item() == pytest.approx(loss(ro).item(), rel=1e-5, abs=1e-7)
    cfg_fixed = cfg.replace(use_dynamic_batch=False, train_max_tokens_per_gpu=None, micro_train_batch_size=4)
    assert [w for _, w in train_micro_batches(ro, cfg_fixed, torch.device("cpu"))] == [None] * 3
