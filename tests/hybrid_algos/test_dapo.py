"""DAPO's dynamic-sampling filter and overlong penalty against plain-Python references (groups of one, ragged
groups given by ids, reward ranges)."""

from __future__ import annotations

import pytest
import torch
from algos_cases import FAST
from hypothesis import given
from hypothesis import strategies as st

from hybrid_algos import AdvantageInputs, AlgoInputError, compute_advantages, informative_groups, overlong_penalty


def ref_keep(scores: list[float], ids: list[int], reward_range=None) -> list[bool]:
    out = []
    for g in ids:
        members = [s for s, h in zip(scores, ids) if h == g]
        keep = max(members) != min(members)
        if reward_range is not None:
            mean = sum(members) / len(members)
            keep = keep and reward_range[0] < mean < reward_range[1]
        out.append(keep)
    return out


@FAST
@given(
    ids=st.lists(st.integers(0, 4), min_size=1, max_size=16),
    seed=st.integers(0, 2**16),
    levels=st.sampled_from([2, 3, 5]),
    reward_range=st.sampled_from([None, (0.0, 1.0), (0.2, 0.6)]),
)
def test_informative_groups_match_the_reference(ids, seed, levels, reward_range):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (len(ids),), generator=g).float() / (levels - 1)
    keep = informative_groups(scores, group_ids=torch.tensor(ids), reward_range=reward_range)
    assert keep.tolist() == ref_keep(scores.tolist(), ids, reward_range)


def test_blocks_and_groups_of_one():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.7, 0.7])
    assert informative_groups(scores, n_samples_per_prompt=2).tolist() == [False, False, True, True, False, False]
    assert not informative_groups(scores, n_samples_per_prompt=1).any()  # nothing to compare within a group of one


def test_dropped_groups_are_exactly_those_with_zero_advantage():
    # 0.1 is not representable in float32: the filter compares exactly, so it agrees with "carries no signal".
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.1, 1.0, 1.0])
    keep = informative_groups(scores, n_samples_per_prompt=4)
    assert keep.tolist() == [False] * 4 + [True] * 4
    adv, _ = compute_advantages(
        "dr_grpo", AdvantageInputs(torch.ones(8, 2, dtype=torch.bool), scores, n_samples_per_prompt=4)
    )
    assert not adv[:4].any() and adv[4:].abs().sum() > 0


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([0, 10, 12, 14, 16, 20])
    pen = overlong_penalty(lengths, max_len=16, buffer_len=4, penalty_factor=2.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, 0.0, -1.0, -2.0, -2.0])
    assert overlong_penalty(lengths, 16, 16).tolist() == pytest.approx([0.0, -10 / 16, -12 / 16, -14 / 16, -1.0, -1.0])


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: informative_groups(torch.ones(3), n_samples_per_prompt=2), "n_samples_per_prompt"),
        (lambda: informative_groups(torch.ones(3)), "group_ids"),
        (
            lambda: informative_groups(torch.ones(2), n_samples_per_prompt=2, reward_range=(1.0, 0.0)),
            "dynamic_filtering_reward_range",
        ),
        (lambda: informative_groups(torch.tensor([1.0, float("nan")]), n_samples_per_prompt=2), "scores"),
        (lambda: overlong_penalty(torch.ones(2), 8, 9), "overlong_buffer_len"),
        (lambda: overlong_penalty(torch.ones(2), 8, 0), "overlong_buffer_len"),
        (lambda: overlong_penalty(torch.ones(2), 8, 4, -1.0), "overlong_penalty_factor"),
    ],
)
def test_bad_input_is_named(call, field):
    with pytest.raises(AlgoInputError) as e:
        call()
    assert e.value.field == field
