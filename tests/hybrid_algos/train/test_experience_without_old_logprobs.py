"""A step that skips the old-logprob pass hands train a rollout without ``old_logprobs``: sharding, shuffling,
micro-batching and moving it must carry the None along instead of failing."""

import torch

from hybrid_algos.train.experience import Rollout


def test_rollout_without_old_logprobs_shards_and_micro_batches():
    r = Rollout.from_generations([[5, 6], [7]], [[[10, 2], [11]], [[12, 13, 2], [14]]], pad_id=0)
    r = r.with_(advantages=torch.ones(4, r.response_len), ref_logprobs=torch.zeros(4, r.response_len))
    assert r.old_logprobs is None
    shards = r.split(2)
    for shard in shards:
        for mb in shard.select(torch.tensor([1, 0])).micro_batches(1):
            mb = mb.to("cpu")
            assert mb.old_logprobs is None and mb.ref_logprobs.shape == mb.action_mask.shape
    assert Rollout.cat(shards).old_logprobs is None
