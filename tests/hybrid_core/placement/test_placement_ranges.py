"""GPU range strings: strict parsing, and formatting that parses back to the same GPUs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybrid_core.errors import PlacementError
from hybrid_core.placement import format_gpus, parse_gpu_range


@pytest.mark.parametrize(
    "text, gpus",
    [
        ("0-7", tuple(range(8))),
        ("4-7", (4, 5, 6, 7)),
        ("3", (3,)),
        (" 0 - 3 , 6,7 ", (0, 1, 2, 3, 6, 7)),
        ("6,0-1", (0, 1, 6)),
        (5, (5,)),
        ([2, 0, 1], (0, 1, 2)),
    ],
)
def test_parses_ranges_lists_and_single_gpus(text, gpus):
    assert parse_gpu_range(text, "placement.actor") == gpus


@pytest.mark.parametrize(
    "text, problem",
    [
        ("7-3", "runs backwards"),
        ("a-b", "cannot read 'a-b'"),
        ("0-", "cannot read '0-'"),
        ("-1", "cannot read '-1'"),
        ("", "empty"),
        ("0-3,2", "lists GPU 2 twice"),
        ([0, -1], "negative"),
        (True, "expected a GPU range"),
        (1.5, "expected a GPU range"),
        ([], "empty"),
    ],
)
def test_malformed_ranges_name_the_field_and_the_fix(text, problem):
    with pytest.raises(PlacementError) as err:
        parse_gpu_range(text, "placement.rollout")
    assert err.value.field == "placement.rollout"
    assert problem in str(err.value)
    assert err.value.fix  # every range error says how to write it


def test_reversed_range_fix_shows_the_corrected_range():
    with pytest.raises(PlacementError) as err:
        parse_gpu_range("7-3", "placement.actor")
    assert "'3-7'" in err.value.fix


@given(st.sets(st.integers(min_value=0, max_value=70), min_size=1))
def test_format_round_trips(gpus):
    text = format_gpus(gpus)
    assert parse_gpu_range(text, "x") == tuple(sorted(gpus))
    assert text.count(",") == sum(1 for g in gpus if g - 1 not in gpus) - 1  # one part per consecutive run
