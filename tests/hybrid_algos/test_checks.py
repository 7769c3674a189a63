"""Bad input to any math function ends in AlgoInputError naming an argument -- never a torch error deep inside.

The functions that take rewards, log-probs, values or advantages also refuse NaN/inf at valid positions, so what they
accept gives a finite result. The generic reductions (aggregate_loss, masked_*) check shapes only: NaN in, NaN out.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_algos as ha
from hybrid_algos import AdvantageInputs, AlgoInputError, set_value_checks

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.long, torch.bool])
fills = st.sampled_from([0.0, 1.0, 0.5, float("nan"), float("inf"), -float("inf")])


@st.composite
def tensors(draw):
    shape, dtype, fill = draw(shapes), draw(dtypes), draw(fills)
    if (dtype in (torch.long, torch.bool) and fill != fill) or abs(fill) == float("inf"):
        dtype = torch.float32
    return torch.full(shape, fill, dtype=dtype) if dtype != torch.bool else torch.full(shape, bool(fill))


CALLS = {
    "ppo_policy_loss": lambda a, b, c, d: ha.ppo_policy_loss(a, b, c, d),
    "clipped_value_loss": lambda a, b, c, d: ha.clipped_value_loss(a, b, c, d),
    "kl_penalty": lambda a, b, c, d: ha.kl_penalty(a, b, c, 0.1, "k3"),
    "discounted_returns": lambda a, b, c, d: ha.discounted_returns(a, b, 0.9),
    "generalized_advantages": lambda a, b, c, d: ha.generalized_advantages(a, b, c, 0.9, 0.9),
    "grpo": lambda a, b, c, d: ha.compute_advantages("grpo", AdvantageInputs(d, scores=a, n_samples_per_prompt=2)),
    "gae": lambda a, b, c, d: ha.compute_advantages("gae", AdvantageInputs(d, token_rewards=a, values=b)),
}
REDUCTIONS = {
    "masked_whiten": lambda a, b, c, d: ha.masked_whiten(a, b),
    "aggregate_loss": lambda a, b, c, d: ha.aggregate_loss(a, b, "seq-mean-token-mean"),
}


@settings(max_examples=int(os.environ.get("HYBRID_ALGOS_FUZZ_EXAMPLES", "300")), deadline=None)
@given(name=st.sampled_from(sorted(CALLS) + sorted(REDUCTIONS)), a=tensors(), b=tensors(), c=tensors(), d=tensors())
def test_garbage_in_gives_named_error_or_finite_result(name, a, b, c, d):
    try:
        out = {**CALLS, **REDUCTIONS}[name](a, b, c, d)
    except AlgoInputError as e:
        assert e.field and str(e).startswith(e.field)
        return
    if name in REDUCTIONS:
        return
    # accepted inputs were valid: the result holds no NaN/inf
    for t in out if isinstance(out, tuple) else (out,):
        if isinstance(t, torch.Tensor):
            assert torch.isfinite(t.float()).all(), name


def test_value_checks_can_be_turned_off_for_hot_loops():
    mask = torch.ones(2, 3, dtype=torch.bool)
    bad = torch.full((2, 3), float("nan"))
    with pytest.raises(AlgoInputError):
        ha.ppo_policy_loss(bad, bad, bad, mask)
    previous = set_value_checks(False)
    try:
        loss, _ = ha.ppo_policy_loss(bad, bad, bad, mask)  # no host sync, no check: NaN flows through
        assert torch.isnan(loss)
        with pytest.raises(AlgoInputError):  # shape checks stay on (they are free)
            ha.ppo_policy_loss(bad, bad[:, :2], bad, mask)
    finally:
        set_value_checks(previous)
    assert previous is True
