import torch

from hybrid_algos.train.experience import Rollout


def _rollout():
    prompts = [[5, 6], [7, 8, 9]]
    completions = [[[10, 11, 2], [12]], [[13, 14], [15, 16, 17, 2]]]
    logprobs = [[[-0.1, -0.2, -0.3], [-0.4]], [[-0.5, -0.6], [-0.7, -0.8, -0.9, -1.0]]]
    return Rollout.from_generations(prompts, completions, pad_id=0, logprobs=logprobs)


def test_layout_left_padded_prompts_right_padded_responses():
    r = _rollout()
    assert r.batch_size == 4 and r.response_len == 4
    assert r.sequences.tolist() == [
        [0, 5, 6, 10, 11, 2, 0],
        [0, 5, 6, 12, 0, 0, 0],
        [7, 8, 9, 13, 14, 0, 0],
        [7, 8, 9, 15, 16, 17, 2],
    ]
    assert r.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0], [1] * 7]
    assert r.action_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert r.group.tolist() == [0, 0, 1, 1]
    assert torch.allclose(r.engine_logprobs[3], torch.tensor([-0.7, -0.8, -0.9, -1.0]))
    assert r.engine_logprobs[1, 1:].abs().sum() == 0


def test_split_and_cat_round_trip():
    r = _rollout().with_(scores=torch.arange(4.0))
    parts = r.split(2)
    assert [p.batch_size for p in parts] == [2, 2]
    back = Rollout.cat(parts)
    assert torch.equal(back.sequences, r.sequences) and torch.equal(back.scores, r.scores)


def test_micro_batches_trim_padding_only():
    r = _rollout()
    first, second = r.micro_batches(2)
    # rows 0-1: the prompt starts at column 1 and the longest response has 3 tokens
    assert first.sequences.tolist() == [[5, 6, 10, 11, 2], [5, 6, 12, 0, 0]]
    assert first.action_mask.size(1) == 3
    assert second.sequences.size(1) == 7  # nothing to trim there
    # trimming keeps the prompt/response boundary: the last response_len columns are the response
    assert torch.equal(first.sequences[:, -first.response_len :], r.sequences[:2, 3:6])
