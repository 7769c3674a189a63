import math
import statistics

import pytest
import torch
from algos_cases import FAST, garbage_under, masks, per_row, randn, ref_gae, ref_rtg, ref_whiten
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import (
    AdvantageInputs,
    AlgoInputError,
    compute_advantages,
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage_estimator,
)
from hybrid_algos import advantages as adv_module

F64 = torch.float64
CANONICAL = ["dr_grpo", "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"]
OPENRLHF = {
    "gae": "gae",
    "reinforce": "reinforce_plus_plus",
    "reinforce_baseline": "reinforce_plus_plus_baseline",
    "rloo": "rloo",
    "group_norm": "grpo",
    "dr_grpo": "dr_grpo",
}
# 2 prompts x 3 samples, right-padded responses of lengths 3, 2, 3 | 1, 3, 2
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
SCORES = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 0.0], dtype=F64)


def _broadcast(per_seq: list[float], mask: torch.Tensor = MASK) -> torch.Tensor:
    return torch.tensor(
        [[per_seq[i] if mask[i, t] else 0.0 for t in range(mask.shape[1])] for i in range(mask.shape[0])], dtype=F64
    )


# ---- registry ---------------------------------------------------------------------------------------------------


def test_builtin_names_and_openrlhf_aliases():
    assert list_advantage_estimators(include_aliases=False) == CANONICAL
    assert set(OPENRLHF) <= set(list_advantage_estimators())
    for alias, canonical in OPENRLHF.items():
        assert get_advantage_estimator(alias) is get_advantage_estimator(canonical)
    assert get_advantage_estimator("gae").requires == ("values",)
    assert "groups" in get_advantage_estimator("group_norm").requires


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(AlgoInputError) as e:
        get_advantage_estimator("ppo_magic")
    assert e.value.field == "advantage_estimator"
    assert "ppo_magic" in str(e.value) and "grpo" in str(e.value) and "reinforce_baseline" in str(e.value)


@pytest.fixture
def clean_registry():
    before_reg, before_alias = dict(adv_module._REGISTRY), dict(adv_module._ALIASES)
    yield
    adv_module._REGISTRY.clear(), adv_module._REGISTRY.update(before_reg)
    adv_module._ALIASES.clear(), adv_module._ALIASES.update(before_alias)


def test_users_can_register_and_replace_estimators(clean_registry):
    @register_advantage_estimator("raw_score", aliases=("raw",), requires=("scores",))
    def raw(inputs):
        a = torch.where(inputs.response_mask, inputs.scores[:, None], 0.0)
        return a, a

    inputs = AdvantageInputs(MASK, scores=SCORES)
    adv, _ = compute_advantages("raw", inputs)
    assert torch.equal(adv, _broadcast(SCORES.tolist()))
    assert "raw_score" in list_advantage_estimators() and "raw" in list_advantage_estimators()
    with pytest.raises(AlgoInputError, match="already registered"):
        register_advantage_estimator("grpo")(raw)
    register_advantage_estimator("grpo", replace=True)(raw)
    assert torch.equal(compute_advantages("grpo", inputs)[0], adv)


def test_registered_estimator_returning_wrong_shape_is_caught(clean_registry):
    register_advantage_estimator("broken")(lambda inputs: (inputs.scores, inputs.scores))
    with pytest.raises(AlgoInputError) as e:
        compute_advantages("broken", AdvantageInputs(MASK, scores=SCORES))
    assert e.value.field == "advantages"


@pytest.mark.parametrize(
    "name,kwargs,field",
    [
        ("gae", {"scores": SCORES}, "values"),
        ("grpo", {"scores": SCORES}, "group_ids"),
        ("rloo", {"token_rewards": torch.zeros(6, 3), "n_samples_per_prompt": 3}, "scores"),
    ],
)
def test_missing_requirement_is_named(name, kwargs, field):
    with pytest.raises(AlgoInputError) as e:
        compute_advantages(name, AdvantageInputs(MASK, **kwargs))
    assert e.value.field == field


# ---- hand-computed cases ----------------------------------------------------------------------------------------


def test_grpo_by_hand():
    adv, ret = compute_advantages("group_norm", AdvantageInputs(MASK, scores=SCORES, n_samples_per_prompt=3))
    expected = []
    for group in (SCORES[:3].tolist(), SCORES[3:].tolist()):
        mean, std = statistics.fmean(group), statistics.stdev(group)  # unbiased, as in GRPO's implementations
        expected += [(s - mean) / (std + 1e-6) for s in group]
    assert torch.allclose(adv, _broadcast(expected))
    assert torch.equal(adv, ret)
    assert adv[0, 0].item() == pytest.approx((2 / 3) / math.sqrt(1 / 3), rel=1e-5)


def test_dr_grpo_and_rloo_by_hand():
    dr, _ = compute_advantages("dr_grpo", AdvantageInputs(MASK, scores=SCORES, n_samples_per_prompt=3))
    rl, _ = compute_advantages("rloo", AdvantageInputs(MASK, scores=SCORES, n_samples_per_prompt=3))
    s = SCORES.tolist()
    dr_expected, rl_expected = [], []
    for g in range(2):
        group = s[3 * g : 3 * g + 3]
        for i, x in enumerate(group):
            others = group[:i] + group[i + 1 :]
            dr_expected.append(x - sum(group) / 3)
            rl_expected.append(x - sum(others) / 2)
    assert torch.allclose(dr, _broadcast(dr_expected))
    assert torch.allclose(rl, _broadcast(rl_expected))


def test_reinforce_plus_plus_by_hand():
    kl = torch.tensor(
        [[-0.1, 0.2, -0.3], [0.1, 0.0, 9.0], [0.0, 0.0, 0.1], [0.5, 9.0, 9.0], [0.0, -0.2, 0.0], [0.3, 0.1, 9.0]],
        dtype=F64,
    )
    gamma = 0.9
    adv, ret = compute_advantages("reinforce", AdvantageInputs(MASK, scores=SCORES, token_rewards=kl, gamma=gamma))
    rewards = per_row(lambda x: x, kl, MASK)
    for i in range(6):
        rewards[i, int(MASK[i].sum()) - 1] += SCORES[i]  # score on the last valid token
    expected_ret = per_row(lambda x: ref_rtg(x, gamma), rewards, MASK)
    assert torch.allclose(ret, expected_ret)
    assert torch.allclose(adv, ref_whiten(expected_ret, MASK))


def test_reinforce_baseline_by_hand():
    adv, ret = compute_advantages("reinforce_baseline", AdvantageInputs(MASK, scores=SCORES, n_samples_per_prompt=3))
    s = SCORES.tolist()
    shaped = [x - sum(s[3 * (i // 3) : 3 * (i // 3) + 3]) / 3 for i, x in enumerate(s)]
    expected_ret = _broadcast(shaped)  # gamma = 1, no dense reward: the shaped score at every valid token
    assert torch.allclose(ret, expected_ret)
    assert torch.allclose(adv, ref_whiten(expected_ret, MASK))


def test_gae_by_hand():
    values = randn(MASK.shape, 0)
    gamma, lam = 0.95, 0.9
    adv, ret = compute_advantages("gae", AdvantageInputs(MASK, scores=SCORES, values=values, gamma=gamma, lam=lam))
    rewards = torch.zeros(MASK.shape, dtype=F64)
    for i in range(6):
        rewards[i, int(MASK[i].sum()) - 1] = SCORES[i]
    raw = per_row(lambda r, v: ref_gae(r, v, gamma, lam), rewards, MASK, values)
    assert torch.allclose(ret, torch.where(MASK, raw + values, 0.0))
    assert torch.allclose(adv, ref_whiten(raw, MASK))


def test_group_ids_in_any_order_match_consecutive_blocks():
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    blocks, _ = compute_advantages("grpo", AdvantageInputs(MASK, scores=SCORES, n_samples_per_prompt=3))
    prompt_of = ["b", "a", "b", "a", "a", "b"]  # prompt of perm[i]: rows 0-2 are "a", 3-5 are "b"
    for ids in (prompt_of, torch.tensor([7 if p == "b" else -3 for p in prompt_of])):
        shuffled, _ = compute_advantages("grpo", AdvantageInputs(MASK[perm], scores=SCORES[perm], group_ids=ids))
        assert torch.allclose(shuffled, blocks[perm])


def test_dense_rewards_add_their_reward_to_go_in_group_estimators():
    dense = torch.tensor([[0.0, 0.0, -0.2]] * 6, dtype=F64)
    plain, _ = compute_advantages("grpo", AdvantageInputs(MASK, scores=SCORES, n_samples_per_prompt=3))
    both, _ = compute_advantages(
        "grpo", AdvantageInputs(MASK, scores=SCORES, token_rewards=dense, n_samples_per_prompt=3)
    )
    assert torch.allclose(both - plain, per_row(lambda x: ref_rtg(x, 1.0), dense, MASK))


def test_singleton_groups():
    one = AdvantageInputs(MASK[:2], scores=SCORES[:2], n_samples_per_prompt=1)
    assert compute_advantages("grpo", one)[0].abs().sum().item() == 0.0  # nothing to compare with
    with pytest.raises(AlgoInputError, match="at least 2"):
        compute_advantages("rloo", one)


# ---- invariants --------------------------------------------------------------------------------------------------


@st.composite
def grouped(draw):
    groups = draw(st.integers(1, 4))
    sizes = [draw(st.integers(2, 5)) for _ in range(groups)]
    length = draw(st.integers(1, 6))
    lengths = [draw(st.integers(0, length)) for _ in range(sum(sizes))]
    mask = torch.tensor([[t < n for t in range(length)] for n in lengths])
    ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    scores = torch.tensor(
        draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, -1.0, 3.5]), min_size=len(ids), max_size=len(ids))), dtype=F64
    )
    return mask, scores, ids


@FAST
@given(case=grouped(), name=st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_group_advantages_sum_to_zero_per_group(case, name):
    _, scores, ids = case
    mask = torch.ones(len(ids), 4, dtype=torch.bool)  # equal masks
    adv, _ = compute_advantages(name, AdvantageInputs(mask, scores=scores, group_ids=ids))
    for g in set(ids):
        rows = [i for i, x in enumerate(ids) if x == g]
        assert adv[rows].sum().item() == pytest.approx(0.0, abs=1e-9)


@FAST
@given(
    case=grouped(),
    name=st.sampled_from(CANONICAL),
    seed=st.integers(0, 2**16),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_padding_never_changes_advantages(case, name, seed, gamma, lam):
    mask, scores, ids = case
    dense, values = randn(mask.shape, seed, 0.1), randn(mask.shape, seed + 1)
    clean = AdvantageInputs(
        mask, scores=scores, token_rewards=dense, values=values, group_ids=ids, gamma=gamma, lam=lam
    )
    dirty = AdvantageInputs(
        mask,
        scores=scores,
        token_rewards=garbage_under(dense, mask, seed + 2),
        values=garbage_under(values, mask, seed + 3),
        group_ids=ids,
        gamma=gamma,
        lam=lam,
    )
    a, b = compute_advantages(name, clean), compute_advantages(name, dirty)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not a[0][~mask].any() and not a[1][~mask].any()  # 0 at padding


@FAST
@given(mask=masks(right_padded=True), seed=st.integers(0, 2**16))
def test_gae_lambda_one_gamma_one_returns_minus_values(mask, seed):
    rewards, values = randn(mask.shape, seed), randn(mask.shape, seed + 1)
    _, ret = compute_advantages("gae", AdvantageInputs(mask, token_rewards=rewards, values=values))
    rtg = per_row(lambda x: ref_rtg(x, 1.0), rewards, mask)
    assert torch.allclose(ret, rtg)  # returns are the reward-to-go, so A (before whitening) = returns - values
    raw = ret - torch.where(mask, values, 0.0)
    assert torch.allclose(
        compute_advantages("gae", AdvantageInputs(mask, token_rewards=rewards, values=values))[0], ref_whiten(raw, mask)
    )


# ---- input checks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"scores": torch.tensor([1.0, float("nan"), 0, 0, 0, 0])}, "scores"),
        ({"scores": torch.tensor([1.0, float("inf"), 0, 0, 0, 0])}, "scores"),
        ({"token_rewards": torch.full((6, 3), float("nan"))}, "token_rewards"),
        ({"scores": SCORES, "values": torch.zeros(6, 3).index_fill_(1, torch.tensor([0]), float("inf"))}, "values"),
        ({"scores": SCORES[:5]}, "scores"),
        ({"scores": SCORES[:, None]}, "scores"),
        ({"token_rewards": torch.zeros(6, 4)}, "token_rewards"),
        ({"token_rewards": torch.zeros(6, 3, dtype=torch.long)}, "token_rewards"),
        ({}, "scores"),
        ({"scores": SCORES, "n_samples_per_prompt": 4}, "n_samples_per_prompt"),
        ({"scores": SCORES, "n_samples_per_prompt": 3, "group_ids": [0] * 6}, "group_ids"),
        ({"scores": SCORES, "group_ids": [0] * 5}, "group_ids"),
        ({"scores": SCORES, "group_ids": torch.zeros(6)}, "group_ids"),
        ({"scores": SCORES, "group_ids": torch.tensor(3)}, "group_ids"),
        ({"scores": SCORES, "group_ids": 3}, "group_ids"),
        ({"scores": SCORES, "group_ids": "abcdef"}, "group_ids"),
        ({"scores": SCORES, "gamma": 1.5}, "gamma"),
        ({"scores": SCORES, "eps": 0.0}, "eps"),
    ],
)
def test_bad_inputs_are_named(kwargs, field):
    with pytest.raises(AlgoInputError) as e:
        AdvantageInputs(MASK, **kwargs)
    assert e.value.field == field
    assert e.value.fix or e.value.problem


@pytest.mark.parametrize("mask", [MASK[0], MASK.float() * 2, MASK.float() * 0.5, MASK[None]])
def test_bad_masks_are_named(mask):
    with pytest.raises(AlgoInputError) as e:
        AdvantageInputs(mask, scores=SCORES)
    assert e.value.field == "response_mask"


def test_nan_under_padding_and_integer_scores_are_fine():
    rewards = garbage_under(torch.zeros(MASK.shape, dtype=F64), MASK, 0)
    inputs = AdvantageInputs(
        MASK.long(), scores=torch.tensor([1, 0, 0, 1, 1, 0]), token_rewards=rewards, n_samples_per_prompt=3
    )
    assert inputs.response_mask.dtype == torch.bool and inputs.scores.dtype == torch.float32
    assert torch.isfinite(compute_advantages("grpo", inputs)[0]).all()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
@pytest.mark.parametrize("normalised", [False, True], ids=["raw", "running-normalised"])
def test_a_group_whose_samples_all_scored_the_same_gets_exactly_zero(name, normalised):
    # Scores that float32 cannot hold exactly: the group mean is off by an ulp, and GRPO's / (std + eps) made that
    # residue an advantage of ~0.1 for a group that carries no signal. The loop's running normalisation
    # ((s - mean) / std) turns even all-0 groups into such values.
    n = 16
    groups = [[0.7] * n, [0.3] * n, [0.0] * n, [1.0] * 4 + [0.0] * 12, [-1.1] * n, [0.1 * k for k in range(n)]]
    scores = torch.tensor([s for g in groups for s in g], dtype=torch.float32)
    if normalised:
        scores = (scores - 0.4321) / (0.3123 + 1e-8)
    mask = torch.ones(len(scores), 5, dtype=torch.bool)
    mask[::3, 3:] = False
    adv, ret = compute_advantages(name, AdvantageInputs(mask, scores=scores, n_samples_per_prompt=n))
    out = ret if name == "reinforce_baseline" else adv  # its advantages are whitened over the whole batch
    for g in (0, 1, 2, 4):
        assert torch.equal(out[g * n : (g + 1) * n], torch.zeros(n, 5)), (g, out[g * n : (g + 1) * n].abs().max())
    for g in (3, 5):  # groups with a signal keep it
        assert out[g * n : (g + 1) * n].abs().max() > 0.1
