import math

import pytest
import torch
from algos_cases import FAST, garbage_under, masks, randn
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import AlgoInputError, masked_mean, masked_sum, masked_var, masked_whiten
from hybrid_algos.masked import last_valid_index

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
M = torch.tensor([[1, 1, 0], [0, 1, 1]])


def test_sum_and_mean_by_hand():
    assert masked_sum(X, M).item() == 1 + 2 + 5 + 6
    assert masked_mean(X, M).item() == 14 / 4
    assert masked_mean(X, M, dim=-1).tolist() == [1.5, 5.5]
    assert masked_mean(X, M, dim=0).tolist() == [1.0, 3.5, 6.0]
    assert masked_sum(X, M, dim=1, keepdim=True).tolist() == [[3.0], [11.0]]


def test_var_by_hand():
    # valid: 1, 2, 5, 6 -> mean 3.5, squared deviations sum to 17
    assert masked_var(X, M).item() == pytest.approx(17 / 3)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(17 / 4)


def test_whiten_by_hand():
    out = masked_whiten(X, M, eps=0.0)
    std = math.sqrt(17 / 3)
    expected = [[(1 - 3.5) / std, (2 - 3.5) / std, 0.0], [0.0, (5 - 3.5) / std, (6 - 3.5) / std]]
    assert torch.allclose(out, torch.tensor(expected, dtype=torch.float64))
    kept = masked_whiten(X, M, shift_mean=False, eps=0.0)
    assert kept[0, 0].item() == pytest.approx((1 - 3.5) / std + 3.5)
    assert kept[0, 2].item() == 0.0  # masked stays 0


def test_no_valid_entry_gives_zero_not_nan():
    none = torch.zeros_like(M)
    assert masked_mean(X, none).item() == 0.0
    assert masked_var(X, none).item() == 0.0
    assert torch.equal(masked_whiten(X, none), torch.zeros_like(X))
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    assert masked_var(X, one).item() == 0.0  # unbiased variance of one value is undefined -> 0
    assert masked_whiten(X, one).abs().sum().item() == 0.0


def test_mask_dtypes_agree():
    for m in (M.bool(), M.float(), M.to(torch.int8)):
        assert masked_mean(X, m).item() == 3.5


def test_mask_shape_mismatch_names_mask():
    with pytest.raises(AlgoInputError) as e:
        masked_mean(X, M[:, :2])
    assert e.value.field == "mask"


def test_last_valid_index():
    m = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]])
    last, has = last_valid_index(m)
    assert last.tolist() == [1, 0, 2, 3]
    assert has.tolist() == [True, False, True, True]


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16))
def test_padding_never_changes_results(mask, seed):
    x = randn(mask.shape, seed)
    dirty = garbage_under(x, mask, seed + 1)
    assert torch.equal(masked_sum(x, mask), masked_sum(dirty, mask))
    assert torch.equal(masked_mean(x, mask, dim=-1), masked_mean(dirty, mask, dim=-1))
    assert torch.equal(masked_var(x, mask), masked_var(dirty, mask))
    assert torch.equal(masked_whiten(x, mask), masked_whiten(dirty, mask))


@FAST
@given(mask=masks(min_valid=1, min_batch=2), seed=st.integers(0, 2**16), scale=st.floats(0.1, 100.0))
def test_whiten_gives_mean_zero_var_one(mask, seed, scale):
    x = randn(mask.shape, seed, scale) + 3.0
    if masked_var(x, mask).item() < 1e-3:
        return  # (near-)constant values: eps dominates and var 1 is not expected
    out = masked_whiten(x, mask, eps=1e-12)
    assert masked_mean(out, mask).item() == pytest.approx(0.0, abs=1e-9)
    assert masked_var(out, mask).item() == pytest.approx(1.0, rel=1e-6)
    assert masked_var(out, mask, unbiased=False).item() < 1.0


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16))
def test_mean_matches_python_loop(mask, seed):
    x = randn(mask.shape, seed)
    for i in range(mask.shape[0]):
        vals = [float(x[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
        expected = sum(vals) / len(vals) if vals else 0.0
        assert masked_mean(x, mask, dim=-1)[i].item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1.1, -0.37, 1e6 / 3])
@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_of_equal_float32_values_is_exactly_zero(value, shift_mean):
    # 0.7 is not a float32: the mean of 64 copies is off by an ulp, and the residue was scaled by 1/sqrt(eps) (~0.4).
    values = torch.full((8, 8), value, dtype=torch.float32)
    values[0, 0] = float("nan")  # under the mask: must not matter
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[0, 0] = False
    out = masked_whiten(values, mask, shift_mean=shift_mean)
    expected = torch.where(mask, values, 0.0) if not shift_mean else torch.zeros_like(values)
    assert torch.equal(out, expected)
