import math

import pytest
import torch
from algos_cases import FAST, garbage_under, masks, randn
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import LOSS_AGG_MODES, AlgoInputError, aggregate_loss, ppo_policy_loss

F64 = torch.float64


def ref_token_loss(ratio: float, adv: float, low: float, high: float, dual: float | None) -> float:
    """PPO's per-token loss written out for one token."""
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(unclipped, clipped)
    if dual is not None and adv < 0:
        loss = min(loss, -adv * dual)
    return loss


RATIOS = [0.5, 1.0, 1.5, 2.0, 0.7, 1.25]
ADVS = [1.0, -1.0, 1.0, -1.0, -2.0, 1.0]


def _case(dtype=F64):
    ratio = torch.tensor([RATIOS], dtype=dtype)
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -3.0, -0.1]], dtype=dtype)
    logp = (old + ratio.log()).requires_grad_(True)
    return logp, old, torch.tensor([ADVS], dtype=dtype), torch.ones(1, 6, dtype=torch.bool)


@pytest.mark.parametrize("low,high,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.2, 1.5), (0.1, 0.3, 3.0)])
def test_loss_by_hand(low, high, dual):
    logp, old, adv, mask = _case()
    loss, stats = ppo_policy_loss(logp, old, adv, mask, clip_low=low, clip_high=high, dual_clip=dual)
    per_token = [ref_token_loss(r, a, low, high, dual) for r, a in zip(RATIOS, ADVS)]
    assert loss.item() == pytest.approx(sum(per_token) / 6)
    clipped = [-a * min(max(r, 1 - low), 1 + high) > -a * r for r, a in zip(RATIOS, ADVS)]
    assert stats["clip_frac"].item() == pytest.approx(sum(clipped) / 6)
    assert stats["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in RATIOS) / 6)
    assert stats["ratio_max"].item() == pytest.approx(2.0)


def test_clip_higher_leaves_room_above():
    logp, old, adv, mask = _case()
    # A = 1: token 5 (ratio 1.25) is clipped at 1.2 with eps 0.2, free with eps_high 0.28; token 2 (ratio 1.5) is
    # clipped at 1.2 vs 1.28. Tokens with A < 0 (clipped from below) do not change.
    sym, _ = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2)
    asym, _ = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert (sym - asym).item() == pytest.approx(((-1.2 + 1.25) + (-1.2 + 1.28)) / 6)


def test_gradient_by_hand():
    logp, old, adv, mask = _case()
    loss, stats = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, dual_clip=1.5)
    loss.backward()
    # d(-A * ratio)/d logp = -A * ratio where the unclipped term is active; 0 where clipped or dual-clipped
    expected = []
    for r, a in zip(RATIOS, ADVS):
        active = -a * r >= -a * min(max(r, 0.8), 1.2) and not (a < 0 and -a * r > -a * 1.5)
        expected.append(-a * r / 6 if active else 0.0)
    assert logp.grad[0].tolist() == pytest.approx(expected)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 6)  # ratio 2, A = -1


def test_float32_and_bfloat16_inputs_give_a_float32_loss():
    for dtype in (torch.float32, torch.bfloat16):
        logp, old, adv, mask = _case(dtype)
        loss, _ = ppo_policy_loss(logp, old, adv, mask)
        assert loss.dtype == torch.float32 and torch.isfinite(loss)


@FAST
@given(
    mask=masks(),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(LOSS_AGG_MODES),
    low=st.floats(0.0, 0.5),
    high=st.floats(0.0, 1.0),
    dual=st.sampled_from([None, 1.5, 3.0]),
)
def test_clip_inactive_at_ratio_one(mask, seed, mode, low, high, dual):
    logp = randn(mask.shape, seed).requires_grad_(True)
    adv = randn(mask.shape, seed + 1)
    loss, stats = ppo_policy_loss(
        logp, logp.detach(), adv, mask, clip_low=low, clip_high=high, dual_clip=dual, agg_mode=mode
    )
    assert torch.allclose(loss, aggregate_loss(-adv, mask, mode))
    assert stats["clip_frac"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    loss.backward()
    weights = torch.zeros_like(adv, requires_grad=True)
    aggregate_loss(weights, mask, mode).backward()  # d loss / d per-token loss
    assert torch.allclose(logp.grad, -adv * weights.grad)  # d(-A * ratio)/d logp = -A at ratio 1


@FAST
@given(log_ratio=st.floats(-25.0, 25.0), adv=st.floats(-100.0, -1e-3), dual=st.floats(1.01, 10.0))
def test_dual_clip_bounds_the_loss_for_negative_advantages(log_ratio, adv, dual):
    lr = torch.tensor([[log_ratio]], dtype=F64)
    loss, _ = ppo_policy_loss(
        lr, torch.zeros(1, 1, dtype=F64), torch.tensor([[adv]], dtype=F64), torch.ones(1, 1), dual_clip=dual
    )
    assert loss.item() <= -adv * dual * (1 + 1e-12)
    plain, _ = ppo_policy_loss(lr, torch.zeros(1, 1, dtype=F64), torch.tensor([[adv]], dtype=F64), torch.ones(1, 1))
    assert loss.item() == pytest.approx(min(plain.item(), -adv * dual))


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), mode=st.sampled_from(LOSS_AGG_MODES))
def test_padding_never_changes_the_loss_or_its_gradient(mask, seed, mode):
    logp, old, adv = randn(mask.shape, seed), randn(mask.shape, seed + 1, 0.1), randn(mask.shape, seed + 2)
    old = logp + old
    a_logp = logp.clone().requires_grad_(True)
    b_logp = garbage_under(logp, mask, seed + 3).requires_grad_(True)
    a, sa = ppo_policy_loss(a_logp, old, adv, mask, dual_clip=3.0, agg_mode=mode)
    b, sb = ppo_policy_loss(
        b_logp,
        garbage_under(old, mask, seed + 4),
        garbage_under(adv, mask, seed + 5),
        mask,
        dual_clip=3.0,
        agg_mode=mode,
    )
    assert torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sa)
    a.backward(), b.backward()
    assert torch.equal(a_logp.grad, b_logp.grad) and not a_logp.grad[~mask].any()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"agg_mode": "mean"}, "loss_agg_mode"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ],
)
def test_bad_settings_are_named(kwargs, field):
    logp, old, adv, mask = _case()
    with pytest.raises(AlgoInputError) as e:
        ppo_policy_loss(logp, old, adv, mask, **kwargs)
    assert e.value.field == field


def test_bad_tensors_are_named():
    logp, old, adv, mask = _case()
    for args, field in (
        ((logp, old[:, :5], adv, mask), "old_logprobs"),
        ((logp, old, adv[0], mask), "advantages"),
        ((logp, old, torch.full_like(adv, float("nan")), mask), "advantages"),
        ((logp, old, adv, mask.float() * 3), "mask"),
        ((logp, old, adv, mask[:, :5]), "mask"),
        ((logp.detach().long(), old, adv, mask), "logprobs"),
    ):
        with pytest.raises(AlgoInputError) as e:
            ppo_policy_loss(*args)
        assert e.value.field == field
