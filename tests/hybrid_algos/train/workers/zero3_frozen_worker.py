"""Run by test_zero3_frozen.py, once per rank, in fresh processes (a real gloo group of two ranks, DeepSpeed ZeRO-3).

Argv: rank, world size, port, policy folder, reward folder. Each rank builds the reference and the reward worker under
``--zero_stage 3`` exactly as the training loop does (``setup`` with the role's rendezvous), scores its own rollout
shard, compares with the whole model in this process, sleeps and wakes the shards; one JSON line says what happened.
"""

import json
import sys

import torch

from hybrid_algos.train.config import PPOConfig
from hybrid_algos.train.experience import Rollout
from hybrid_algos.train.models import load_causal_lm, load_reward_model, response_logprobs, sequence_scores
from hybrid_algos.train.workers.frozen import ReferenceWorker, RewardModelWorker


class _NoRay:
    def where(self):  # the worker's Ray identity (node ip, GPU ids): there is no Ray in this process
        return {"role": self.role, "rank": self.rank}


class Reference(_NoRay, ReferenceWorker):
    pass


class Reward(_NoRay, RewardModelWorker):
    pass


def rollout(rank: int) -> Rollout:
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(3, 10, (5,), generator=g).tolist() for _ in range(2)]
    completions = [[torch.randint(3, 10, (4,), generator=g).tolist() for _ in range(2)] for _ in range(2)]
    return Rollout.from_generations(prompts, completions, pad_id=0)


def main() -> None:
    rank, world, port, policy, reward = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    cfg = PPOConfig(zero_stage=3, bf16=True, micro_rollout_batch_size=2, reward_pretrain=reward)
    settings = cfg.settings()
    ref = Reference("reference", rank, world, settings, sys.argv[6])
    rm = Reward("reward", rank, world, settings, sys.argv[6])
    ref.setup(policy, "127.0.0.1", port)
    rm.setup(reward, "127.0.0.1", port)  # the same group (one per process): the loop gives each role its own
    batch = rollout(rank)
    lp, scores = ref.logprobs(batch), rm.scores(batch)
    whole = load_causal_lm(policy, dtype=torch.bfloat16).eval()
    whole_rm = load_reward_model(reward, dtype=torch.bfloat16)
    with torch.no_grad():
        lp_whole = response_logprobs(whole, batch.sequences, batch.attention_mask, batch.response_len)
        scores_whole = sequence_scores(whole_rm, batch.sequences, batch.attention_mask)
    moved = ref.offload(["params"])
    try:
        ref.logprobs(batch)
        refused = None
    except Exception as e:  # noqa: BLE001 -- the test checks which
        refused = type(e).__name__
    ref.reload(["params"])
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": rank,
                "sharded": [ref.sharded, rm.sharded],
                "held": [ref.held_params(), rm.held_params()],
                "total": [sum(p.numel() for p in whole.parameters()), sum(p.numel() for p in whole_rm.parameters())],
                "logprob_gap": (lp - lp_whole).abs().max().item(),
                "score_gap": (scores - scores_whole).abs().max().item(),
                "offloaded_bytes": moved["bytes"],
                "refused_asleep": refused,
                "after_wake_gap": (ref.logprobs(batch) - lp).abs().max().item(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
