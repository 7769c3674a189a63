import pytest
import torch
from algos_cases import FAST, garbage_under, masks, per_row, randn, ref_gae, ref_rtg
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import AlgoInputError, discounted_returns, generalized_advantages, scores_to_token_rewards

F64 = torch.float64


def test_discounted_returns_by_hand():
    r = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64)
    out = discounted_returns(r, torch.ones(1, 3), gamma=0.5)
    # G2 = 3, G1 = 2 + 0.5 * 3, G0 = 1 + 0.5 * 3.5
    assert out.tolist() == [[2.75, 3.5, 3.0]]


def test_masked_token_is_skipped_not_a_zero_reward_step():
    r = torch.tensor([[1.0, 100.0, 3.0, 7.0]], dtype=F64)
    m = torch.tensor([[1, 0, 1, 0]])
    # compacted sequence [1, 3]: G = [1 + 0.5 * 3, 3]; masked positions give 0
    assert discounted_returns(r, m, gamma=0.5).tolist() == [[2.5, 0.0, 3.0, 0.0]]


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    v = torch.tensor([[0.5, 0.2, 0.8]], dtype=F64)
    adv, ret = generalized_advantages(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    a2 = 1.0 - 0.8  # delta_2 (no value after the end)
    a1 = (0.9 * 0.8 - 0.2) + 0.9 * 0.8 * a2  # delta_1 + gamma * lam * A_2
    a0 = (0.9 * 0.2 - 0.5) + 0.9 * 0.8 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2])
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.2, a2 + 0.8])


def test_gae_lambda_zero_is_td_error():
    r = torch.tensor([[0.3, -1.0, 2.0, 0.0]], dtype=F64)
    v = torch.tensor([[1.0, 0.5, -0.5, 9.0]], dtype=F64)
    m = torch.tensor([[1, 1, 1, 0]])
    adv, _ = generalized_advantages(r, v, m, gamma=0.9, lam=0.0)
    assert adv[0].tolist() == pytest.approx([0.3 + 0.9 * 0.5 - 1.0, -1.0 + 0.9 * -0.5 - 0.5, 2.0 + 0.5, 0.0])


def test_scores_to_token_rewards():
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    out = scores_to_token_rewards(torch.tensor([2.0, 5.0, -1.0]), m)
    assert out.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -1.0]]
    assert scores_to_token_rewards(torch.tensor([1, 0, 1]), m).dtype == torch.float32  # ints are promoted


def test_bad_inputs_are_named():
    r = torch.zeros(2, 3)
    with pytest.raises(AlgoInputError, match="gamma"):
        discounted_returns(r, torch.ones(2, 3), gamma=1.5)
    with pytest.raises(AlgoInputError) as e:
        generalized_advantages(r, torch.zeros(2, 4), torch.ones(2, 3))
    assert e.value.field == "values"
    with pytest.raises(AlgoInputError) as e:
        discounted_returns(r, torch.ones(3, 3))
    assert e.value.field == "mask"
    with pytest.raises(AlgoInputError) as e:
        scores_to_token_rewards(torch.zeros(3), torch.ones(2, 3))
    assert e.value.field == "scores"


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
def test_match_python_reference_on_compacted_rows(mask, seed, gamma, lam):
    r, v = randn(mask.shape, seed), randn(mask.shape, seed + 1)
    assert torch.allclose(discounted_returns(r, mask, gamma), per_row(lambda x: ref_rtg(x, gamma), r, mask))
    adv, ret = generalized_advantages(r, v, mask, gamma, lam)
    expected = per_row(lambda x, y: ref_gae(x, y, gamma, lam), r, mask, v)
    assert torch.allclose(adv, expected)
    assert torch.allclose(ret, torch.where(mask, expected + v, 0.0))


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), gamma=st.floats(0.0, 1.0))
def test_gae_with_lambda_one_gives_discounted_returns(mask, seed, gamma):
    r, v = randn(mask.shape, seed), randn(mask.shape, seed + 1)
    adv, ret = generalized_advantages(r, v, mask, gamma=gamma, lam=1.0)
    rtg = discounted_returns(r, mask, gamma)
    assert torch.allclose(ret, rtg)
    if gamma == 1.0:
        assert torch.allclose(adv, torch.where(mask, rtg - v, 0.0))  # A = returns - values


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), gamma=st.floats(0.0, 1.0))
def test_padding_never_changes_results(mask, seed, gamma):
    r, v = randn(mask.shape, seed), randn(mask.shape, seed + 1)
    dr, dv = garbage_under(r, mask, seed + 2), garbage_under(v, mask, seed + 3)
    assert torch.equal(discounted_returns(r, mask, gamma), discounted_returns(dr, mask, gamma))
    a, b = generalized_advantages(r, v, mask, gamma, 0.9), generalized_advantages(dr, dv, mask, gamma, 0.9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
