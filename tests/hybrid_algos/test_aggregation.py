import pytest
import torch
from algos_cases import FAST, garbage_under, masks, randn
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import LOSS_AGG_MODES, AlgoInputError, aggregate_loss

F64 = torch.float64
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # lengths 3, 1 and an all-padding row


def test_modes_by_hand():
    # valid: row 0 -> 1, 2, 3 (sum 6, len 3); row 1 -> 5 (sum 5, len 1); row 2 ignored
    assert aggregate_loss(LOSS, MASK, "token-mean").item() == pytest.approx(11 / 4)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 5 / 1) / 2)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 5) / 2)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 4 + 5 / 4) / 2)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(
        (6 / 10 + 5 / 10) / 2
    )


def test_gradients_by_hand():
    loss = LOSS.clone().requires_grad_(True)
    aggregate_loss(loss, MASK, "seq-mean-token-mean").backward()
    expected = torch.tensor([[1 / 6] * 3 + [0.0], [1 / 2, 0, 0, 0], [0.0] * 4], dtype=F64)
    assert torch.allclose(loss.grad, expected)


def test_no_valid_token_gives_zero():
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def test_bad_inputs_are_named():
    with pytest.raises(AlgoInputError) as e:
        aggregate_loss(LOSS, MASK, "sum")
    assert e.value.field == "loss_agg_mode" and "seq-mean-token-sum-norm" in str(e.value)
    with pytest.raises(AlgoInputError) as e:
        aggregate_loss(LOSS, MASK[:, :3])
    assert e.value.field == "mask"
    with pytest.raises(AlgoInputError) as e:
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=0)
    assert e.value.field == "norm_len"


@FAST
@given(batch=st.integers(1, 5), length=st.integers(1, 6), width=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_modes_agree_when_all_lengths_are_equal(batch, length, width, seed):
    loss = randn((batch, length + width), seed)
    mask = torch.zeros(batch, length + width, dtype=torch.bool)
    mask[:, :length] = True
    token_mean = aggregate_loss(loss, mask, "token-mean")
    assert torch.allclose(aggregate_loss(loss, mask, "seq-mean-token-mean"), token_mean)
    assert torch.allclose(aggregate_loss(loss, mask, "seq-mean-token-sum"), token_mean * length)
    assert torch.allclose(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=length), token_mean)


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), mode=st.sampled_from(LOSS_AGG_MODES))
def test_padding_never_changes_the_loss_or_its_gradient(mask, seed, mode):
    x = randn(mask.shape, seed).requires_grad_(True)
    dirty = garbage_under(x.detach(), mask, seed + 1).requires_grad_(True)
    a, b = aggregate_loss(x, mask, mode), aggregate_loss(dirty, mask, mode)
    assert torch.equal(a, b)
    a.backward(), b.backward()
    assert torch.equal(x.grad, dirty.grad) and not x.grad[~mask].any()


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16))
def test_matches_python_loops(mask, seed):
    x = randn(mask.shape, seed)
    rows = [[float(x[i, t]) for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    rows = [r for r in rows if r]
    tokens = [v for r in rows for v in r]
    n = max(len(rows), 1)
    expected = {
        "token-mean": sum(tokens) / len(tokens) if tokens else 0.0,
        "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / n,
        "seq-mean-token-sum": sum(sum(r) for r in rows) / n,
        "seq-mean-token-sum-norm": sum(sum(r) / 16 for r in rows) / n,
    }
    for mode, value in expected.items():
        assert aggregate_loss(x, mask, mode, norm_len=16).item() == pytest.approx(value, abs=1e-12)
