import math

import pytest
import torch
from algos_cases import FAST, garbage_under, masks, randn
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import (
    AdaptiveKLController,
    AlgoInputError,
    FixedKLController,
    kl_estimate,
    kl_penalty,
    kl_penalty_rewards,
    make_kl_controller,
)

F64 = torch.float64


def test_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    lr = [0.5, -1.0]  # log pi - log pi_ref
    assert kl_estimate(logp, ref, "k1")[0].tolist() == pytest.approx(lr)
    assert kl_estimate(logp, ref, "k2")[0].tolist() == pytest.approx([0.5 * x * x for x in lr])
    assert kl_estimate(logp, ref, "k3")[0].tolist() == pytest.approx([math.exp(-x) - 1 + x for x in lr])
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_estimate(logp, ref, alias), kl_estimate(logp, ref, name))


def test_k3_clamps():
    logp = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    ref = torch.tensor([[30.0, -30.0, -3.0]], dtype=F64)
    out = kl_estimate(logp, ref, "k3")
    assert out[0, :2].tolist() == [10.0, 10.0]  # result capped at 10 (log-ratio first clamped to +-20)
    assert out[0, 2].item() == pytest.approx(math.exp(-3) - 1 + 3)
    raw = kl_estimate(logp, ref, "k3", log_ratio_clamp=None, max_value=None)
    assert raw[0, 0].item() == pytest.approx(math.exp(30) - 1 - 30)


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_under_the_policy(name):
    # E_{y ~ pi}[k(y)] computed exactly over a small vocabulary equals KL(pi || pi_ref).
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(8, generator=g, dtype=F64), -1)
    ref = torch.log_softmax(torch.randn(8, generator=g, dtype=F64), -1)
    exact = sum(math.exp(a) * (a - b) for a, b in zip(logp.tolist(), ref.tolist()))
    k = kl_estimate(logp[None], ref[None], name, log_ratio_clamp=None, max_value=None)[0]
    assert (logp.exp() * k).sum().item() == pytest.approx(exact, rel=1e-9)


def test_k2_gradient_is_the_log_ratio():
    logp = torch.tensor([[-1.0, -0.2]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-0.5, -0.7]], dtype=F64)
    kl_estimate(logp, ref, "k2").sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, 0.5])


def test_penalty_and_rewards_by_hand():
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -2.0, 0.0]], dtype=F64)
    ref = torch.tensor([[-1.2, -0.8, -1.0], [-0.5, -1.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    pen = kl_penalty(logp, ref, mask, kl_coef=0.1, estimator="k1")
    assert torch.allclose(pen, torch.tensor([[-0.1 * 0.2, -0.1 * -0.2, 0.0], [0.0, -0.1 * -1.0, 0.0]], dtype=F64))
    rewards = kl_penalty_rewards(torch.tensor([1.0, 2.0]), logp, ref, mask, kl_coef=0.1)
    assert torch.allclose(rewards, torch.tensor([[-0.02, 0.02, 1.0], [0.0, 0.1 + 2.0, 0.0]], dtype=F64))
    assert not rewards.requires_grad


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), name=st.sampled_from(["k1", "k2", "k3"]))
def test_zero_when_equal_and_k2_k3_nonnegative(mask, seed, name):
    logp = randn(mask.shape, seed, 3.0)
    assert kl_estimate(logp, logp, name).abs().max().item() == 0.0
    other = randn(mask.shape, seed + 1, 3.0)
    if name != "k1":
        assert (kl_estimate(logp, other, name) >= 0).all()
        assert (kl_estimate(logp.float(), other.float(), name) >= 0).all()  # also after fp32 rounding


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), name=st.sampled_from(["k1", "k2", "k3"]))
def test_padding_never_changes_kl(mask, seed, name):
    logp, ref = randn(mask.shape, seed), randn(mask.shape, seed + 1)
    clean = kl_estimate(logp, ref, name, mask=mask)
    dirty = kl_estimate(garbage_under(logp, mask, seed + 2), garbage_under(ref, mask, seed + 3), name, mask=mask)
    assert torch.equal(clean, dirty) and not clean[~mask].any()


def test_bad_inputs_are_named():
    x = torch.zeros(2, 3)
    with pytest.raises(AlgoInputError) as e:
        kl_estimate(x, x, "k4")
    assert e.value.field == "kl_estimator" and "low_var_kl" in str(e.value)
    with pytest.raises(AlgoInputError) as e:
        kl_estimate(x, torch.zeros(2, 4))
    assert e.value.field == "ref_logprobs"
    with pytest.raises(AlgoInputError) as e:
        kl_penalty(torch.full((2, 3), float("nan")), x, torch.ones(2, 3), 0.1)
    assert e.value.field == "logprobs"
    with pytest.raises(AlgoInputError) as e:
        kl_penalty(x, x, torch.ones(2, 3), -0.1)
    assert e.value.field == "kl_coef"


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 64)
    assert ctl.value == 0.05
    assert isinstance(make_kl_controller(0.05), FixedKLController)


def test_adaptive_controller_by_hand():
    ctl = make_kl_controller(0.1, target=6.0, horizon=10000)
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(12.0, 64)  # error 12/6 - 1 = 1, clipped to 0.2
    expected = 0.1 * (1 + 0.2 * 64 / 10000)
    assert ctl.value == pytest.approx(expected)
    ctl.update(6.0, 64)  # on target: unchanged
    assert ctl.value == pytest.approx(expected)
    ctl.update(4.5, 100)  # error -0.25, clipped to -0.2
    expected *= 1 - 0.2 * 100 / 10000
    assert ctl.value == pytest.approx(expected)
    ctl.update(6.6, 10)  # error 0.1, inside the clip
    expected *= 1 + 0.1 * 10 / 10000
    assert ctl.value == pytest.approx(expected)


def test_adaptive_controller_state_round_trip_and_checks():
    a = AdaptiveKLController(0.1, 6.0, 1000)
    a.update(20.0, 50)
    b = AdaptiveKLController(0.3, 1.0, 10)
    b.load_state_dict(a.state_dict())
    a.update(1.0, 7), b.update(1.0, 7)
    assert a.value == b.value
    with pytest.raises(AlgoInputError, match="current_kl"):
        a.update(float("nan"), 1)
    with pytest.raises(AlgoInputError) as e:
        AdaptiveKLController(0.1, 0.0, 100)
    assert e.value.field == "kl_target"


def test_k3_keeps_its_gradient_when_the_policy_is_close_to_the_reference():
    # float32, a confident policy (log-probs near 0) a hair away from its reference: exp(-d) - 1 + d rounds to a tiny
    # negative value for about half of these tokens, and a clamp at 0 zeroed their gradient. The exact gradient of
    # k3 w.r.t. log pi is 1 - exp(-d): every token must get it, with its sign.
    gen = torch.Generator().manual_seed(0)
    ref = -torch.rand(4096, generator=gen) * 0.05
    logp = (ref + torch.randn(4096, generator=gen) * 1e-4).requires_grad_(True)
    kl = kl_estimate(logp, ref, "k3")
    kl.sum().backward()
    d = (logp.detach() - ref).double()  # the log-ratio as float32 sees it
    exact_value, exact_grad = torch.exp(-d) - 1 + d, 1 - torch.exp(-d)
    assert (kl >= 0).all()
    moved = d != 0
    assert torch.equal(torch.sign(logp.grad[moved]).double(), torch.sign(exact_grad[moved])), "gradients were lost"
    assert torch.allclose(logp.grad.double(), exact_grad, rtol=1e-3, atol=1e-12)
    assert torch.allclose(kl.detach().double(), exact_value, rtol=1e-3, atol=1e-12)


@pytest.mark.parametrize("spread", [1e-6, 1e-3, 5e-3, 2e-2, 0.5, 1.5])
def test_k3_agrees_with_float64_on_both_sides_of_its_series(spread):
    gen = torch.Generator().manual_seed(1)
    ref = -torch.rand(2048, generator=gen) * 4
    logp = (ref + torch.randn(2048, generator=gen) * spread).requires_grad_(True)
    kl_estimate(logp, ref, "k3", max_value=None).sum().backward()
    d = (logp.detach() - ref).double()
    assert torch.allclose(
        kl_estimate(logp.detach(), ref, "k3", max_value=None).double(), torch.exp(-d) - 1 + d, rtol=1e-4, atol=1e-12
    )
    assert torch.allclose(logp.grad.double(), 1 - torch.exp(-d), rtol=1e-4, atol=1e-9)
