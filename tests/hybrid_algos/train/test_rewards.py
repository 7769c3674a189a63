import math

import pytest
import torch

from hybrid_algos.train.rewards import RewardScorer, load_reward_fn
from hybrid_algos.train.tasks import Prompt


class _Out:
    def __init__(self, ids):
        self.token_ids = ids


def test_reward_fn_from_file_gets_texts_ids_and_labels(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def reward(prompts, completions, *, prompt_ids, completion_ids, labels, **kw):\n"
                    "    return [float(len(c) + l) for c, l in zip(completion_ids, labels)]\n")
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
