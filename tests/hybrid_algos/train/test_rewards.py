import math
import threading

import numpy as np
import pytest
import torch

from hybrid_algos.train.rewards import RewardError, RewardScorer, RewardTimeout, load_reward_fn
from hybrid_algos.train.tasks import Prompt
from hybrid_core.remote import deadline


class _Out:
    def __init__(self, ids):
        self.token_ids = ids


def test_reward_fn_from_file_gets_texts_ids_and_labels(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def reward(prompts, completions, *, prompt_ids, completion_ids, labels, **kw):\n"
        "    return [float(len(c) + l) for c, l in zip(completion_ids, labels)]\n"
    )
    fn = load_reward_fn(f"{path}:reward")
    scorer = RewardScorer(fn, decode=lambda ids: " ".join(map(str, ids)))
    prompts = [Prompt([1, 2], "p0", label=10), Prompt([3], "p1", label=20)]
    scores = scorer.score(prompts, [[_Out([5]), _Out([5, 6])], [_Out([7, 8, 9])]])
    assert scores.tolist() == [11.0, 12.0, 23.0]


def test_non_finite_reward_is_a_clear_error():
    scorer = RewardScorer(lambda *a, **k: [1.0, math.nan], decode=str)
    with pytest.raises(ValueError, match="non-finite scores at positions \\[1\\]"):
        scorer.score([Prompt([1], "p", None)], [[_Out([2]), _Out([3])]])


def test_running_normalisation_matches_batch_statistics():
    scorer = RewardScorer(None, decode=str, normalize=True, clip_range=(-100, 100))
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0])
    scorer.normalize(a)
    out = scorer.normalize(b)
    both = torch.cat([a, b])
    expected = (b - both.mean()) / (both.std() + 1e-8)
    assert torch.allclose(out, expected, atol=1e-5)


def _score(fn, n=2, **kwargs):
    scorer = RewardScorer(fn, decode=str, name="my_rewards.py:score", **kwargs)
    return scorer.score([Prompt([1], "p", None)], [[_Out([2 + i]) for i in range(n)]])


@pytest.mark.parametrize(
    "returned, says",
    [
        (None, "returned None"),
        ("0.5 1.0", "returned a str"),
        (0.5, "returned a float"),
        ([1.0], "returned 1 scores for 2 completions"),
        ([1.0, 2.0, 3.0], "returned 3 scores for 2 completions"),
        (["0.5", "1.0"], "not numbers at 2 position"),
        ([1.0, None], "not numbers at 1 position"),
        ([1.0, [0.5]], "not numbers at 1 position"),
        ([math.inf, 1.0], "non-finite scores at positions \\[0\\]"),
    ],
)
def test_a_reward_function_returning_the_wrong_thing_is_named(returned, says):
    with pytest.raises(RewardError, match=says) as info:
        _score(lambda *a, **k: returned)
    assert "my_rewards.py:score" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_numbers_in_any_container_are_fine():
    assert _score(lambda *a, **k: np.array([1, 0])).tolist() == [1.0, 0.0]
    assert _score(lambda *a, **k: torch.tensor([[0.5], [1.5]])).tolist() == [0.5, 1.5]
    assert _score(lambda *a, **k: (True, 2)).tolist() == [1.0, 2.0]


def test_a_reward_function_that_raises_is_named_with_its_line():
    def score(prompts, completions, **kwargs):
        total = 0
        return [1.0 / total] * len(completions)

    with pytest.raises(RewardError, match=r"raised ZeroDivisionError: .*division by zero") as info:
        _score(score)
    assert "test_rewards.py:" in str(info.value) and "in score" in str(info.value)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_a_reward_function_that_hangs_ends_within_the_step_budget():
    release = threading.Event()

    returned = threading.Event()

    def score(prompts, completions, **kwargs):
        release.wait(60)  # a hang (a lock, a server that never answers)
        returned.set()
        return [0.0] * len(completions)

    budget = "did not return within the 2 s budget of step 3"
    with pytest.raises(RewardTimeout, match=budget) as info, deadline(2.0, "step 3"):
        _score(score)
    assert not returned.is_set()  # the deadline ended the step while the function still hung
    assert "test_rewards.py" in str(info.value) and "in score" in str(info.value)  # where it hangs
    release.set()


def test_a_reward_file_that_cannot_be_imported_is_a_config_error(tmp_path):
    from hybrid_core.errors import ConfigError

    path = tmp_path / "r.py"
    path.write_text("import numpy\nimport no_such_module_for_hybrid\n\ndef score(p, c, **k):\n    return []\n")
    with pytest.raises(ConfigError, match="No module named 'no_such_module_for_hybrid'") as info:
        load_reward_fn(f"{path}:score")
    assert info.value.field == "reward_fn" and "r.py:2" in str(info.value) and "pip install" in str(info.value)
