import math

import pytest
import torch
from algos_cases import FAST, randn
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import AlgoInputError, entropy_from_logits, logprobs_from_logits

F64 = torch.float64


def test_entropy_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [math.log(1.0), math.log(3.0)], [5.0, 5.0]]], dtype=F64)
    out = entropy_from_logits(logits)
    assert out[0].tolist() == pytest.approx(
        [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2)]
    )


def test_logprobs_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]], dtype=F64)
    out = logprobs_from_logits(logits, torch.tensor([[2, 0]]))
    z = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert out[0].tolist() == pytest.approx([3 - z, -math.log(3)])


@FAST
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 4),
    vocab=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    scale=st.floats(0.0, 30.0),
)
def test_entropy_bounds_and_logprobs_agree_with_log_softmax(batch, length, vocab, seed, scale):
    logits = randn((batch, length, vocab), seed, scale)
    h = entropy_from_logits(logits)
    assert (h >= -1e-12).all() and (h <= math.log(vocab) + 1e-9).all()
    tokens = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(logprobs_from_logits(logits, tokens), expected)


def test_mask_zeroes_padding_and_keeps_gradients_finite():
    logits = torch.randn(2, 3, 5, dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    dirty = logits.clone()
    dirty[~mask] = float("nan")
    dirty.requires_grad_(True)
    h = entropy_from_logits(dirty, mask)
    assert torch.equal(h, entropy_from_logits(logits, mask)) and not h[~mask].any()
    h.sum().backward()
    assert torch.isfinite(dirty.grad).all() and not dirty.grad[~mask].any()


def test_low_precision_logits_are_computed_in_float32():
    logits = torch.randn(2, 3, 50).to(torch.bfloat16)
    assert entropy_from_logits(logits).dtype == torch.float32
    assert logprobs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float32


def test_bad_inputs_are_named():
    with pytest.raises(AlgoInputError) as e:
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    assert e.value.field == "tokens"
    with pytest.raises(AlgoInputError) as e:
        entropy_from_logits(torch.zeros(2, 3, 5), torch.ones(2, 4))
    assert e.value.field == "mask"
    with pytest.raises(AlgoInputError) as e:
        entropy_from_logits(torch.zeros(2, 3, 5, dtype=torch.long))
    assert e.value.field == "logits"
