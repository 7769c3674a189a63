"""The policy-loss registry and its built-in losses (ppo, gspo, cispo, dr_grpo), checked against plain-Python
references on random inputs: ragged masks with holes, all-masked rows, every aggregation mode, IS weights.

The references loop over Python floats and write each paper's objective out directly (GSPO's ratio is the
sequence-level one, a function of every token of the sequence), so they share no code with hybrid_algos.
"""

from __future__ import annotations

import math

import pytest
import torch
from algos_cases import FAST, garbage_under, masks, randn
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import (
    LOSS_AGG_MODES,
    AlgoInputError,
    PolicyLossInputs,
    compute_policy_loss,
    get_policy_loss,
    list_policy_losses,
    ppo_policy_loss,
    register_policy_loss,
)
from hybrid_algos import policy_loss as loss_module

F64 = torch.float64
NORM = 9.0  # norm_len of seq-mean-token-sum-norm


def _rows(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


def ref_aggregate(per_token: dict[tuple[int, int], float], mask, mode: str) -> float:
    """A scalar from {(row, t): loss} over valid tokens, written out per mode."""
    rows = [r for r in _rows(mask)]
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(per_token.values()) / max(n, 1)
    seqs = []
    for i, r in enumerate(rows):
        if not r:
            continue
        total = sum(per_token[(i, t)] for t in r)
        seqs.append(
            {
                "seq-mean-token-mean": total / len(r),
                "seq-mean-token-sum": total,
                "seq-mean-token-sum-norm": total / NORM,
            }[mode]
        )
    return sum(seqs) / max(len(seqs), 1)


def agg_weight(mask, mode: str, i: int) -> float:
    """d(aggregate) / d(per-token loss) for a valid token of row i."""
    rows = _rows(mask)
    if mode == "token-mean":
        return 1.0 / max(sum(len(r) for r in rows), 1)
    nseq = sum(1 for r in rows if r)
    return {
        "seq-mean-token-mean": 1.0 / len(rows[i]),
        "seq-mean-token-sum": 1.0,
        "seq-mean-token-sum-norm": 1.0 / NORM,
    }[mode] / nseq


def ref_ppo(r: float, a: float, low: float, high: float, dual: float | None) -> tuple[float, float]:
    """PPO per-token loss and d loss / d ratio."""
    unclipped, clipped = -a * r, -a * min(max(r, 1 - low), 1 + high)
    loss, grad = (unclipped, -a) if unclipped >= clipped else (clipped, 0.0)
    if dual is not None and a < 0 and loss > -a * dual:
        loss, grad = -a * dual, 0.0
    return loss, grad


def reference(name, logp, old, adv, mask, w, low, high, dual, mode):
    """(loss, d loss / d logp) of loss ``name``, token by token."""
    per_token, grads = {}, torch.zeros(logp.shape, dtype=F64)
    for i, row in enumerate(_rows(mask)):
        # GSPO: s = exp(mean_t (logp_t - old_t)) over the sequence; its GSPO-token form (the paper's eq. for
        # token-level advantages) has the value s on every token and the gradient s * A_t * grad log pi(y_t).
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in row) / len(row)) if row else 1.0
        for t in row:
            lr = float(logp[i, t] - old[i, t])
            a, wt = float(adv[i, t]), float(w[i, t])
            if name in ("ppo", "dr_grpo"):
                r = math.exp(lr)
                loss, dr = ref_ppo(r, a, low, high, dual)
                per_token[(i, t)] = wt * loss
                grads[i, t] = wt * dr * r  # d ratio / d logp = ratio
            elif name == "gspo":
                loss, dr = ref_ppo(s, a, low, high, None)
                per_token[(i, t)] = wt * loss
                grads[i, t] = wt * dr * s
            else:  # cispo: -sg(clip(r)) * A * logp
                c = min(max(math.exp(lr), 1 - low), 1 + high)
                per_token[(i, t)] = -wt * c * a * float(logp[i, t])
                grads[i, t] = -wt * c * a
            grads[i, t] *= agg_weight(mask, mode, i)
    return ref_aggregate(per_token, mask, mode), grads


@FAST
@given(
    mask=masks(),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(LOSS_AGG_MODES),
    name=st.sampled_from(["ppo", "gspo", "cispo", "dr_grpo"]),
    low=st.sampled_from([0.1, 0.2, 0.5]),
    high=st.sampled_from([0.2, 0.28, 1.0]),
    dual=st.sampled_from([None, 1.5, 3.0]),
    weighted=st.booleans(),
)
def test_losses_match_the_reference(mask, seed, mode, name, low, high, dual, weighted):
    if name in ("gspo", "cispo"):
        dual = None
    logp = randn(mask.shape, seed, 0.5) - 1.0
    old = logp + randn(mask.shape, seed + 1, 0.3)
    adv = randn(mask.shape, seed + 2)
    w = randn(mask.shape, seed + 3).abs() if weighted else torch.ones(mask.shape, dtype=F64)
    x = logp.clone().requires_grad_(True)
    loss, stats = compute_policy_loss(
        name,
        x,
        old,
        adv,
        mask,
        clip_low=low,
        clip_high=high,
        dual_clip=dual,
        agg_mode=mode,
        norm_len=NORM,
        is_weights=w if weighted else None,
    )
    loss.backward()
    want, want_grad = reference(name, logp, old, adv, mask, w, low, high, dual, mode)
    assert loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert torch.allclose(x.grad, want_grad, rtol=1e-7, atol=1e-12), (x.grad, want_grad)
    assert not x.grad[~mask].any()
    assert set(stats) >= {"clip_frac", "approx_kl", "ratio_mean", "ratio_max"}


def test_gspo_token_form_has_the_sequence_objective_gradient_with_token_mean():
    # token-mean weighs a sequence by its length: loss = sum_i L_i f(s_i) / N, d/dlogp_t = f'(s_i) s_i / N.
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.5, 0.0, 0.0, 0.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -0.7, 0.0], [-1.4, 0.0, 0.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0] * 4, [-2.0] * 4], dtype=F64)
    loss, _ = compute_policy_loss("gspo", logp, old, adv, mask, clip_low=0.5, clip_high=0.5, agg_mode="token-mean")
    loss.backward()
    s0 = math.exp((0.1 - 0.1 + 0.2) / 3)
    s1 = math.exp(-0.1)
    assert loss.item() == pytest.approx((3 * -1.0 * s0 + 1 * 2.0 * s1) / 4)
    assert logp.grad[0, :3].tolist() == pytest.approx([-s0 / 4] * 3)
    assert logp.grad[1, 0].item() == pytest.approx(2.0 * s1 / 4)


def test_gspo_clips_whole_sequences():
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = torch.zeros(2, 3, dtype=F64)
    logp = torch.tensor([[0.3, 0.3, 0.3], [0.01, 0.02, 0.0]], dtype=F64, requires_grad=True)
    adv = torch.ones(2, 3, dtype=F64)
    loss, stats = compute_policy_loss("gspo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert stats["clip_frac"].item() == pytest.approx(0.5)  # row 0: exp(0.3) > 1.2 on every token
    assert not logp.grad[0].any() and logp.grad[1].abs().min() > 0


def test_cispo_keeps_the_gradient_of_clipped_tokens_where_ppo_drops_it():
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.zeros(1, 2, dtype=F64)
    adv = torch.ones(1, 2, dtype=F64)
    for name, expect_zero in (("ppo", True), ("cispo", False)):
        logp = torch.tensor([[0.5, 0.0]], dtype=F64, requires_grad=True)  # token 0: ratio 1.65, clipped at 1.28
        loss, stats = compute_policy_loss(name, logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
        loss.backward()
        assert (logp.grad[0, 0].item() == 0.0) == expect_zero, name
        assert stats["clip_frac"].item() == pytest.approx(0.5)
    logp = torch.tensor([[0.5, 0.0]], dtype=F64, requires_grad=True)
    compute_policy_loss("cispo", logp, old, adv, mask, clip_low=0.2, clip_high=0.28)[0].backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.28 / 2, -1.0 / 2])
    # clip_low = 1: no lower bound (the paper's setting); the weight of a ratio near 0 is the ratio itself
    logp = torch.tensor([[-3.0, 0.0]], dtype=F64, requires_grad=True)
    compute_policy_loss("cispo", logp, old, adv, mask, clip_low=1.0, clip_high=0.28)[0].backward()
    assert logp.grad[0, 0].item() == pytest.approx(-math.exp(-3.0) / 2)


def test_default_aggregation_comes_from_the_registry():
    assert get_policy_loss("ppo").agg_mode == "token-mean"
    assert get_policy_loss("gspo").agg_mode == "seq-mean-token-mean"
    assert get_policy_loss("dr_grpo").agg_mode == "seq-mean-token-sum-norm"
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    logp, adv = randn((2, 4), 1), randn((2, 4), 2)
    a, _ = compute_policy_loss("dr_grpo", logp, logp, adv, mask, norm_len=8)
    b, _ = compute_policy_loss("ppo", logp, logp, adv, mask, agg_mode="seq-mean-token-sum-norm", norm_len=8)
    assert torch.equal(a, b)


@FAST
@given(
    mask=masks(),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(["ppo", "gspo", "cispo"]),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_padding_never_changes_any_loss(mask, seed, name, mode):
    logp, old, adv = randn(mask.shape, seed), randn(mask.shape, seed + 1, 0.1), randn(mask.shape, seed + 2)
    old = logp + old
    w = randn(mask.shape, seed + 6).abs()
    a_logp = logp.clone().requires_grad_(True)
    b_logp = garbage_under(logp, mask, seed + 3).requires_grad_(True)
    a, sa = compute_policy_loss(name, a_logp, old, adv, mask, agg_mode=mode, is_weights=w)
    b, sb = compute_policy_loss(
        name,
        b_logp,
        garbage_under(old, mask, seed + 4),
        garbage_under(adv, mask, seed + 5),
        mask,
        agg_mode=mode,
        is_weights=garbage_under(w, mask, seed + 7),
    )
    assert torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sa)
    a.backward(), b.backward()
    assert torch.equal(a_logp.grad, b_logp.grad) and not a_logp.grad[~mask].any()


def test_all_masked_batch_gives_zero_loss_and_gradient():
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for name in list_policy_losses(include_aliases=False):
        logp = randn((3, 4), 0).requires_grad_(True)
        loss, stats = compute_policy_loss(name, logp, randn((3, 4), 1), randn((3, 4), 2), mask)
        loss.backward()
        assert loss.item() == 0.0 and not logp.grad.any(), name
        assert all(torch.isfinite(v).all() for v in stats.values()), name


def test_is_weights_scale_the_per_token_loss():
    mask = torch.ones(2, 3, dtype=torch.bool)
    logp, old, adv = randn((2, 3), 0), randn((2, 3), 1), randn((2, 3), 2)
    w = torch.tensor([[0.0, 2.0, 1.0], [1.0, 1.0, 0.5]], dtype=F64)
    plain = torch.zeros(2, 3, dtype=F64)
    for i in range(2):
        for t in range(3):
            one = torch.zeros(2, 3, dtype=torch.bool)
            one[i, t] = True
            plain[i, t] = compute_policy_loss("ppo", logp, old, adv, one)[0]
    weighted, _ = compute_policy_loss("ppo", logp, old, adv, mask, is_weights=w)
    assert weighted.item() == pytest.approx((plain * w).sum().item() / 6)


def test_ppo_policy_loss_is_the_registered_ppo():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    logp, old, adv = randn((2, 3), 0), randn((2, 3), 1), randn((2, 3), 2)
    a, sa = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    b, sb = compute_policy_loss("ppo_clip", logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert torch.equal(a, b) and sa.keys() == sb.keys()


def test_register_a_loss_with_one_decorated_function(monkeypatch):
    monkeypatch.setattr(loss_module, "_REGISTRY", dict(loss_module._REGISTRY))
    monkeypatch.setattr(loss_module, "_ALIASES", dict(loss_module._ALIASES))

    @register_policy_loss("reinforce_is", aliases=("vanilla_pg",), agg_mode="seq-mean-token-sum", uses=())
    def reinforce_is(inputs: PolicyLossInputs):
        """Plain policy gradient with an importance ratio (no clip)."""
        return -inputs.advantages * inputs.ratio(), {}

    assert "reinforce_is" in list_policy_losses() and "vanilla_pg" in list_policy_losses()
    entry = get_policy_loss("vanilla_pg")
    assert entry.summary == "Plain policy gradient with an importance ratio (no clip)."
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = compute_policy_loss("vanilla_pg", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mask)
    assert loss.item() == pytest.approx(-2.0) and "approx_kl" in stats
    with pytest.raises(AlgoInputError) as e:  # a setting the loss does not read is refused, not ignored
        compute_policy_loss("vanilla_pg", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mask, dual_clip=3.0)
    assert e.value.field == "dual_clip"
    with pytest.raises(AlgoInputError) as e:
        register_policy_loss("ppo")(reinforce_is)
    assert e.value.field == "name"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"name": "nope"}, "policy_loss_type"),
        ({"name": "gspo", "dual_clip": 2.0}, "dual_clip"),
        ({"name": "cispo", "clip_low": 1.5}, "clip_low"),
        ({"name": "ppo", "clip_low": 1.0}, "clip_low"),
        ({"name": "ppo", "agg_mode": "sum"}, "loss_agg_mode"),
    ],
)
def test_bad_settings_are_named(kwargs, field):
    kwargs = dict(kwargs)
    name = kwargs.pop("name")
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(AlgoInputError) as e:
        compute_policy_loss(name, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mask, **kwargs)
    assert e.value.field == field


def test_bad_is_weights_are_named():
    mask = torch.ones(1, 2, dtype=torch.bool)
    for w in (torch.ones(1, 3), torch.tensor([[1.0, float("nan")]])):
        with pytest.raises(AlgoInputError) as e:
            compute_policy_loss("ppo", torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mask, is_weights=w)
        assert e.value.field == "is_weights"


def test_each_loss_clips_at_its_papers_range_when_the_user_sets_none():
    """GSPO's sequence ratios stay near 1: PPO's 0.2 would almost never clip them, so with no clip given GSPO uses
    its paper's (3e-4, 4e-4); CISPO has no lower bound (clip_low 1); PPO keeps 0.2. A given clip still wins."""
    from hybrid_algos import get_policy_loss

    assert get_policy_loss("ppo").default_clip == (0.2, 0.2)
    assert get_policy_loss("gspo").default_clip == (3e-4, 4e-4)
    assert get_policy_loss("cispo").default_clip[0] == 1.0
    mask = torch.ones(2, 6, dtype=torch.bool)
    old = torch.zeros(2, 6)
    logp = torch.full((2, 6), 0.01, requires_grad=True)  # sequence ratio exp(0.01): inside 0.2, outside 4e-4
    adv = torch.ones(2, 6)
    _, default = compute_policy_loss("gspo", logp, old, adv, mask)
    _, wide = compute_policy_loss("gspo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert default["clip_frac"].item() == 1.0 and wide["clip_frac"].item() == 0.0
    weights = torch.full((2, 6), -3.0)  # ratio e^-3 ~ 0.05: CISPO's default keeps it (no lower bound), 0.2 lifts it
    _, cispo = compute_policy_loss("cispo", weights.requires_grad_(), old, adv, mask)
    assert cispo["clip_frac"].item() == 0.0


def test_the_run_config_takes_the_losses_clip_and_says_so():
    from hybrid_algos.train.config import GRPOConfig

    gspo = GRPOConfig(policy_loss_type="gspo")
    assert gspo.clip_range == (3e-4, 4e-4)
    assert "GSPO's paper" in gspo.clip_note()
    assert GRPOConfig(policy_loss_type="gspo", eps_clip=0.1).clip_range == (0.1, 0.1)
    assert GRPOConfig(policy_loss_type="gspo", eps_clip=0.1).clip_note() is None
    assert GRPOConfig().clip_range == (0.2, 0.2) and GRPOConfig().clip_note() is None
