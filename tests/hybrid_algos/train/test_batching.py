"""Micro-batches of an update: token-budget ones (--use_dynamic_batch) hold every sample exactly once within the
budget, honour the count agreed across ranks, and in every batching mode (fixed or token-budget, one rank or several)
the micro-batches' weighted losses add up to the loss over the whole update (DAPO's token-level mean is over all of
the update's tokens, not a mean of per-micro-batch means)."""

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
        prompts.append([1, *torch.randint(4, 12, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()])
        completions.append(
            [
                torch.randint(4, 12, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()
                for _ in range(2)
            ]
        )
    ro = Rollout.from_generations(prompts, completions, 0)
    old = -torch.rand(ro.action_mask.shape, generator=g) * 3
    adv = torch.randn(ro.action_mask.shape, generator=g)
    return ro.with_(old_logprobs=old, advantages=adv, sample_mask=torch.rand(12, generator=g) > 0.2)


def _plan(update: Rollout, cfg: GRPOConfig) -> list[tuple[Rollout, float]]:
    """The actor's micro-batches of one update and their loss weights, as ``PolicyWorker.train`` plans them."""
    by_tokens = cfg.policy_agg_mode == "token-mean"
    return train_micro_batches(
        update, cfg.trainer_settings(), cfg.micro_train_batch_size, torch.device("cpu"), by_tokens=by_tokens
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_weighted_micro_batch_losses_add_up_to_the_update_loss(mode, packed):
    ro = _rollout(3)
    cfg = GRPOConfig(
        n_samples_per_prompt=2,
        rollout_batch_size=6,
        train_batch_size=12,
        micro_train_batch_size=12,
        use_dynamic_batch=True,
        train_max_tokens_per_gpu=14,
        packing_samples=packed,
        loss_agg_mode=mode,
    )

    def loss(r: Rollout) -> torch.Tensor:
        return compute_policy_loss(
            "ppo", r.old_logprobs + 0.1, r.old_logprobs, r.advantages, r.loss_mask, agg_mode=mode, norm_len=8
        )[0]

    plan = _plan(ro, cfg)
    assert len(plan) > 2 and all(w is not None for _, w in plan)
    assert sum(w * loss(mb) for mb, w in plan).item() == pytest.approx(loss(ro).item(), rel=1e-5, abs=1e-7)
    cfg_fixed = cfg.replace(use_dynamic_batch=False, train_max_tokens_per_gpu=None, micro_train_batch_size=4)
    fixed = _plan(ro, cfg_fixed)
    assert len(fixed) == 3
    assert sum(w * loss(mb) for mb, w in fixed).item() == pytest.approx(loss(ro).item(), rel=1e-5, abs=1e-7)


def test_fixed_micro_batches_token_mean_is_over_the_update_not_a_mean_of_means():
    """The issue's example: two micro-batches whose token means differ and whose token counts differ; the update's
    loss is the mean over all its tokens (0.889 there), not the mean of the two means (0.500 there)."""
    ro = _rollout(5)
    cfg = GRPOConfig(
        n_samples_per_prompt=2,
        rollout_batch_size=6,
        train_batch_size=12,
        micro_train_batch_size=6,
        loss_agg_mode="token-mean",
    )
    per_token = torch.arange(ro.action_mask.numel(), dtype=torch.float32).reshape(ro.action_mask.shape) % 7

    def loss(r: Rollout, rows) -> torch.Tensor:
        m = r.loss_mask.bool()
        return (per_token[rows, : r.response_len] * m).sum() / m.sum().clamp(min=1)

    plan = _plan(ro, cfg)
    rows = [torch.arange(0, 6), torch.arange(6, 12)]
    got = sum(w * loss(mb, r) for (mb, w), r in zip(plan, rows))
    whole = loss(ro, torch.arange(12))
    mean_of_means = sum(loss(mb, r) for (mb, _), r in zip(plan, rows)) / 2
    assert got.item() == pytest.approx(whole.item(), rel=1e-6)
    assert abs(mean_of_means.item() - whole.item()) > 1e-3  # the rollout is one where the two differ


def _two_rank_weights(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ro = _rollout(11 + rank)  # the ranks' shards have different token counts
        cfg = GRPOConfig(
            n_samples_per_prompt=2,
            rollout_batch_size=6,
            train_batch_size=24,
            micro_train_batch_size=4,
            loss_agg_mode="token-mean",
        )
        plan = _plan(ro, cfg)
        out.put((rank, [(float(mb.loss_mask.sum()), w) for mb, w in plan], float(ro.loss_mask.sum())))
    finally:
        dist.destroy_process_group()


def test_token_mean_weights_count_every_data_parallel_rank():
    """Two real gloo ranks with different token counts: each rank's weighted micro-batch sums, averaged over the
    ranks as DeepSpeed averages gradients, weigh every token of the update alike (the global token mean)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_two_rank_weights, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (plan, total)) for r, plan, total in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    all_tokens = got[0][1] + got[1][1]
    assert got[0][1] != got[1][1]
    for rank in (0, 1):
        for tokens, weight in got[rank][0]:
            # a micro-batch's token-mean loss times its weight, halved by the ranks' average: tokens / all tokens
            assert weight / 2 == pytest.approx(tokens / all_tokens)
