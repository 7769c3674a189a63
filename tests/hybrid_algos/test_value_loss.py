import pytest
import torch
from algos_cases import FAST, garbage_under, masks, randn
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import LOSS_AGG_MODES, AlgoInputError, clipped_value_loss

F64 = torch.float64
V = [1.0, 0.0, 2.0, 0.5]
OLD = [0.5, 0.5, 0.5, 0.5]
R = [2.0, 1.0, 0.0, 0.6]


def ref_token_loss(v: float, old: float, ret: float, clip: float | None) -> float:
    unclipped = (v - ret) ** 2
    if clip is None:
        return 0.5 * unclipped
    v_clipped = old + min(max(v - old, -clip), clip)
    return 0.5 * max(unclipped, (v_clipped - ret) ** 2)


@pytest.mark.parametrize("clip", [0.2, 1.0, None])
def test_loss_and_gradient_by_hand(clip):
    v = torch.tensor([V], dtype=F64, requires_grad=True)
    loss, stats = clipped_value_loss(
        v, torch.tensor([OLD], dtype=F64), torch.tensor([R], dtype=F64), torch.ones(1, 4), clip=clip
    )
    per_token = [ref_token_loss(*x, clip) for x in zip(V, OLD, R)]
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    loss.backward()
    grads = []
    for x, old, ret in zip(V, OLD, R):
        unclipped = (x - ret) ** 2
        clipped_wins = clip is not None and (old + min(max(x - old, -clip), clip) - ret) ** 2 > unclipped
        inside = clip is None or abs(x - old) <= clip
        grads.append(0.0 if clipped_wins and not inside else (x - ret) / 4)
    assert v.grad[0].tolist() == pytest.approx(grads)
    n_clipped = (
        sum((old + min(max(x - old, -clip), clip) - ret) ** 2 > (x - ret) ** 2 for x, old, ret in zip(V, OLD, R))
        if clip is not None
        else 0
    )
    assert stats["clip_frac"].item() == pytest.approx(n_clipped / 4)


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    _, perfect = clipped_value_loss(ret, ret, ret, torch.ones(1, 4))
    assert perfect["explained_variance"].item() == pytest.approx(1.0)
    mean = torch.full_like(ret, 2.5)
    _, constant = clipped_value_loss(mean, mean, ret, torch.ones(1, 4))
    assert constant["explained_variance"].item() == pytest.approx(0.0)


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), mode=st.sampled_from(LOSS_AGG_MODES))
def test_padding_never_changes_the_loss_or_its_gradient(mask, seed, mode):
    v, old, ret = randn(mask.shape, seed), randn(mask.shape, seed + 1), randn(mask.shape, seed + 2)
    a_v = v.clone().requires_grad_(True)
    b_v = garbage_under(v, mask, seed + 3).requires_grad_(True)
    a, _ = clipped_value_loss(a_v, old, ret, mask, agg_mode=mode)
    b, _ = clipped_value_loss(
        b_v, garbage_under(old, mask, seed + 4), garbage_under(ret, mask, seed + 5), mask, agg_mode=mode
    )
    assert torch.equal(a, b)
    a.backward(), b.backward()
    assert torch.equal(a_v.grad, b_v.grad) and not a_v.grad[~mask].any()


def test_bad_inputs_are_named():
    x = torch.zeros(2, 3)
    for kwargs, args, field in (
        ({"clip": -1.0}, (x, x, x, torch.ones(2, 3)), "value_clip"),
        ({}, (x, x[:, :2], x, torch.ones(2, 3)), "old_values"),
        ({}, (x, x, torch.full((2, 3), float("inf")), torch.ones(2, 3)), "returns"),
        ({"agg_mode": "x"}, (x, x, x, torch.ones(2, 3)), "loss_agg_mode"),
    ):
        with pytest.raises(AlgoInputError) as e:
            clipped_value_loss(*args, **kwargs)
        assert e.value.field == field
