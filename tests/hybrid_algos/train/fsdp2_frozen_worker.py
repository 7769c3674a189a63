"""Run by test_fsdp2_frozen.py through fsdp2_launch.py, one process per rank (gloo, CPU): ``run <dir>``.

``<dir>`` holds a tiny policy and reward model. Under ``--trainer fsdp2``, in fp32 and in bf16, each rank builds the
reference and the reward worker exactly as the training loop does (``setup`` with the role's rendezvous), scores its
own rollout shard, compares with the whole model in this process, then sleeps and wakes the shards through the
workers' ``offload`` / ``reload`` (what the residency owner calls). Each rank prints one ``RESULT {json}`` line.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

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
    prompts = [torch.randint(3, 10, (5,), generator=g).tolist() for _ in range(4)]
    completions = [[torch.randint(3, 10, (4,), generator=g).tolist() for _ in range(2)] for _ in range(4)]
    return Rollout.from_generations(prompts, completions, pad_id=0)


def shard_bytes(module: torch.nn.Module) -> list[bytes]:
    from torch.distributed.tensor import DTensor

    def raw(t):  # a copy: numpy holding the storage itself would make it unfreeable in place
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.detach().clone().contiguous().view(torch.uint8).numpy().tobytes()

    return [raw(p) for p in module.parameters()] + [raw(b) for b in module.buffers()]


def sleep_and_wake(worker, score) -> dict:
    """The residency owner's moves of a frozen role (``params``), around a pass that must be refused while away."""
    before_bytes, before = shard_bytes(worker.model), score()
    moved = worker.offload(["params"])
    left = worker.offloader.device_bytes()
    try:
        score()
        refused = None
    except Exception as e:  # noqa: BLE001 -- the test checks which
        refused = type(e).__name__
    back = worker.reload(["params"])
    return {
        "moved": moved["bytes"],
        "reloaded": back["bytes"],
        "left_on_device": left,
        "refused_asleep": refused,
        "identical_shards": shard_bytes(worker.model) == before_bytes,
        "after_wake_gap": float((score() - before).abs().max()),
    }


def one_precision(bf16: bool, folder: str, port: int) -> dict:
    from torch.distributed.tensor import DTensor

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    policy, reward = os.path.join(folder, "policy"), os.path.join(folder, "reward")
    cfg = PPOConfig(trainer="fsdp2", bf16=bf16, micro_rollout_batch_size=2, reward_pretrain=reward)
    settings = cfg.settings()
    logs = os.path.join(folder, "logs")
    ref, rm = Reference("reference", rank, world, settings, logs), Reward("reward", rank, world, settings, logs)
    ref.setup(policy, "127.0.0.1", port)  # the loop gives each role its own group; here one serves both
    rm.setup(reward, "127.0.0.1", port)
    batch = rollout(rank)
    lp, scores = ref.logprobs(batch), rm.scores(batch)
    dtype = torch.bfloat16 if bf16 else torch.float32
    whole, whole_rm = load_causal_lm(policy, dtype=dtype).eval(), load_reward_model(reward, dtype=dtype)
    with torch.no_grad():
        lp_whole = response_logprobs(whole, batch.sequences, batch.attention_mask, batch.response_len)
        scores_whole = sequence_scores(whole_rm, batch.sequences, batch.attention_mask)
    return {
        "sharded": [ref.sharded, rm.sharded],
        "held": [ref.held_params(), rm.held_params()],
        "total": [sum(p.numel() for p in whole.parameters()), sum(p.numel() for p in whole_rm.parameters())],
        "shard_dtypes": sorted({str(p.to_local().dtype) for m in (ref.model, rm.model) for p in m.parameters()}),
        # every unit, the root too, frees its gathered weights after the forward: only shards stay between passes
        "only_shards_after_forward": all(isinstance(p, DTensor) for m in (ref.model, rm.model) for p in m.parameters()),
        "logprob_gap": float((lp - lp_whole).abs().max()),
        "score_gap": float((scores - scores_whole).abs().max()),
        "reference_sleep": sleep_and_wake(ref, lambda: ref.logprobs(batch)),
        "reward_sleep": sleep_and_wake(rm, lambda: rm.scores(batch)),
    }


def main() -> None:
    folder = sys.argv[2]
    port = int(os.environ["MASTER_PORT"])
    # the workers' setup makes the group (init_distributed, its own store on this port) the first time
    out = {"fp32": one_precision(False, folder, port), "bf16": one_precision(True, folder, port)}
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), **out}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # no rank tears its group down while a peer is still in a collective
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort at interpreter exit (see fsdp2_worker.main)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
