"""Rollout correction (TIS, IcePop, sequence-level TIS / MIS, OpenRLHF's seq-mask-tis) against a plain-Python
reference on random inputs with ragged masks and all-masked rows, and its statistics."""

from __future__ import annotations

import math

import pytest
import torch
from algos_cases import FAST, garbage_under, masks, randn
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import (
    AlgoInputError,
    compute_policy_loss,
    get_rollout_correction,
    list_rollout_corrections,
    register_rollout_correction,
    rollout_correction,
)
from hybrid_algos import mismatch as mismatch_module

F64 = torch.float64
METHODS = ["icepop", "seq-mask-tis", "seq-mis", "seq-tis", "tis"]


def ref_weights(method: str, old, eng, mask, low, high):
    """Per-token weights and the rejected tokens, written out row by row."""
    w = torch.zeros(old.shape, dtype=F64)
    rejected = torch.zeros(old.shape, dtype=torch.bool)
    for i in range(old.shape[0]):
        row = [t for t in range(old.shape[1]) if mask[i, t]]
        rho = {t: math.exp(float(old[i, t] - eng[i, t])) for t in row}
        seq = math.prod(rho.values()) if row else 1.0
        geo = seq ** (1 / len(row)) if row else 1.0
        lo = low if low is not None else 0.0
        for t in row:
            if method == "tis":
                w[i, t] = min(max(rho[t], lo), high)
            elif method == "icepop":
                ok = lo <= rho[t] <= high
                w[i, t], rejected[i, t] = (rho[t] if ok else 0.0), not ok
            elif method == "seq-tis":
                w[i, t] = min(max(seq, lo), high)
            elif method == "seq-mis":
                ok = lo <= seq <= high
                w[i, t], rejected[i, t] = (seq if ok else 0.0), not ok
            else:  # seq-mask-tis
                ok = lo <= geo <= high
                w[i, t], rejected[i, t] = (min(max(rho[t], lo), high) if ok else 0.0), not ok
    return w, rejected


@FAST
@given(
    mask=masks(),
    seed=st.integers(0, 2**16),
    method=st.sampled_from(METHODS),
    bounds=st.sampled_from([(None, None), (0.5, 2.0), (0.0, 5.0), (0.8, 1.25)]),
)
def test_weights_match_the_reference(mask, seed, method, bounds):
    old = randn(mask.shape, seed, 0.5) - 1.0
    eng = old + randn(mask.shape, seed + 1, 0.4)
    low, high = bounds
    out = rollout_correction(old, eng, mask, method, low=low, high=high)
    spec = get_rollout_correction(method)
    lo = spec.low if low is None else low
    hi = spec.high if high is None else high
    want, rejected = ref_weights(method, old, eng, mask, lo, hi)
    assert torch.allclose(out.weights.double(), want, rtol=1e-9, atol=1e-12)
    assert torch.equal(out.keep, mask & ~rejected)
    assert not out.weights[~mask].any()
    # statistics over the valid tokens
    rhos = [
        math.exp(float(old[i, t] - eng[i, t])) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]
    ]
    n = len(rhos)
    st_ = {k: v.item() for k, v in out.stats.items()}
    assert st_["tokens"] == n
    if n:
        assert st_["ratio_mean"] == pytest.approx(sum(rhos) / n)
        assert st_["ratio_min"] == pytest.approx(min(rhos)) and st_["ratio_max"] == pytest.approx(max(rhos))
        assert st_["masked_frac"] == pytest.approx(int(rejected.sum()) / n)
        assert st_["kl"] == pytest.approx(sum(-math.log(r) for r in rhos) / n)
        assert st_["k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rhos) / n)
        assert st_["weight_mean"] == pytest.approx(float(want.sum()) / n)
    else:
        assert st_["ratio_min"] == st_["ratio_max"] == 1.0 and st_["masked_frac"] == 0.0


@FAST
@given(mask=masks(), seed=st.integers(0, 2**16), method=st.sampled_from(METHODS))
def test_padding_never_changes_the_weights(mask, seed, method):
    old = randn(mask.shape, seed) - 1.0
    eng = old + randn(mask.shape, seed + 1, 0.3)
    a = rollout_correction(old, eng, mask, method)
    b = rollout_correction(garbage_under(old, mask, seed + 2), garbage_under(eng, mask, seed + 3), mask, method)
    assert torch.equal(a.weights, b.weights) and torch.equal(a.keep, b.keep)
    assert all(torch.equal(a.stats[k], b.stats[k]) for k in a.stats)


def test_matching_engine_gives_weight_one_and_no_gap():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    lp = randn((3, 3), 0) - 1
    for method in METHODS:
        out = rollout_correction(lp, lp.clone(), mask, method)
        assert torch.equal(out.weights, mask.to(out.weights.dtype)), method
        assert out.stats["kl"].item() == 0 and out.stats["masked_frac"].item() == 0


def test_tis_truncates_from_above_only_unless_a_lower_bound_is_given():
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.tensor([[-1.0, -1.0, -1.0 - math.log(10.0)]], dtype=F64)
    eng = torch.tensor([[-1.0 - math.log(10.0), -1.0, -1.0]], dtype=F64)  # rho = 10, 1, 0.1
    out = rollout_correction(old, eng, mask, "tis")
    assert out.weights[0].tolist() == pytest.approx([2.0, 1.0, 0.1])
    assert out.stats["clipped_frac"].item() == pytest.approx(1 / 3)
    out = rollout_correction(old, eng, mask, "tis", low=0.5, high=5.0)  # OpenRLHF's clamp
    assert out.weights[0].tolist() == pytest.approx([5.0, 1.0, 0.5])
    out = rollout_correction(old, eng, mask, "icepop")
    assert out.weights[0].tolist() == pytest.approx([0.0, 1.0, 0.0]) and out.keep[0].tolist() == [False, True, False]


def test_weights_plug_into_every_loss():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    old, adv = randn((2, 3), 0) - 1, randn((2, 3), 1)
    eng = old + randn((2, 3), 2, 0.5)
    corr = rollout_correction(old, eng, mask, "icepop", low=0.9, high=1.1)
    for name in ("ppo", "gspo", "cispo"):
        logp = old.clone().requires_grad_(True)
        loss, _ = compute_policy_loss(name, logp, old, adv, mask, is_weights=corr.weights)
        loss.backward()
        assert not logp.grad[~corr.keep].any(), name  # rejected tokens give no gradient


def test_register_a_correction_and_bad_inputs():
    saved = dict(mismatch_module._METHODS)
    try:
        register_rollout_correction(
            "geo-mis",
            "geometric-mean rejection only",
            weight_level=None,
            truncate=False,
            reject_level="geometric",
            low=0.9,
            high=1.1,
        )
        assert "geo-mis" in list_rollout_corrections()
        mask = torch.ones(2, 2, dtype=torch.bool)
        old = torch.zeros(2, 2, dtype=F64)
        eng = torch.tensor([[0.0, 0.0], [-0.5, -0.5]], dtype=F64)
        out = rollout_correction(old, eng, mask, "geo-mis")
        assert out.weights.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    finally:
        mismatch_module._METHODS.clear()
        mismatch_module._METHODS.update(saved)
    mask = torch.ones(1, 2, dtype=torch.bool)
    z = torch.zeros(1, 2)
    for kwargs, field in (
        ({"method": "nope"}, "vllm_is_correction_type"),
        ({"high": 0.0}, "high"),
        ({"low": 3.0, "high": 2.0}, "low"),
    ):
        with pytest.raises(AlgoInputError) as e:
            rollout_correction(z, z, mask, **kwargs)
        assert e.value.field == field
    with pytest.raises(AlgoInputError) as e:
        rollout_correction(z, torch.tensor([[0.0, float("nan")]]), mask)
    assert e.value.field == "engine_logprobs"
