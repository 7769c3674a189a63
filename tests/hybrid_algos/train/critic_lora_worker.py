"""Run by test_critic_lora.py through fsdp2_launch.py, one process per rank (gloo, CPU): ``<backend> <dir>``.

``<dir>`` holds a tiny policy folder. Each rank builds PPO's critic exactly as the training loop does
(``CriticWorker.setup`` under ``--lora_rank``, its own rendezvous) under the given trainer backend, trains it on a
fixed rollout towards returns of 1, saves a checkpoint, trains on, and loads the checkpoint back. Each rank prints
one ``RESULT {json}`` line: what trains, what moved, the values before / after / restored, and (rank 0) the saved
``adapter/`` folder applied by PEFT over a freshly loaded critic.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid_algos.train.config import PPOConfig
from hybrid_algos.train.experience import Rollout
from hybrid_algos.train.workers.critic import CriticWorker

STEPS = 4


class Critic(CriticWorker):
    def where(self):  # the worker's Ray identity (node ip, GPU ids): there is no Ray in this process
        return {"role": self.role, "rank": self.rank}


def rollout() -> Rollout:
    """The same 8 samples on every rank, returns 1 on every response token (the old values: 0)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 10, (5,), generator=g).tolist() for _ in range(4)]
    completions = [[torch.randint(3, 10, (4,), generator=g).tolist() for _ in range(2)] for _ in range(4)]
    r = Rollout.from_generations(prompts, completions, pad_id=0)
    r.values = torch.zeros_like(r.action_mask)
    r.returns = r.action_mask.clone()
    return r


def full_params(worker) -> dict[str, torch.Tensor]:
    """Every parameter full, by the PEFT model's own names (collective under either backend)."""
    return {n: t.detach().clone() for n, t in worker.engine.full_weights(1 << 30, merged=False)}


def run(backend: str, folder: str) -> dict:
    from peft import PeftModel

    from hybrid_algos.train.models import load_critic, response_values

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    cfg = PPOConfig(
        trainer=backend,
        zero_stage=3 if backend == "deepspeed" else 2,
        bf16=False,
        lora_rank=4,
        lora_alpha=8,
        lora_target_modules="q_proj,v_proj",
        critic_learning_rate=2e-2,
        rollout_batch_size=4,
        n_samples_per_prompt=2,
        train_batch_size=8,
        micro_train_batch_size=2,
        micro_rollout_batch_size=4,
        max_epochs=1,
        value_clip=100.0,  # the plain squared error (old values 0)
    )
    settings = cfg.settings()
    worker = Critic("critic", rank, world, settings, os.path.join(folder, "logs"))
    worker.setup(os.path.join(folder, "policy"), "127.0.0.1", port, STEPS + 2)
    module = worker.engine.module
    # the sharded parameters by name, before any forward: FSDP2 then puts the root's unsharded ones in their place
    # until the next backward reshards them (the optimizer holds these)
    sharded = {id(p): n for n, p in module.named_parameters()}
    batch = rollout()
    trainable = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    before, values_before = full_params(worker), worker.values(batch)
    losses = [worker.train(batch, step)["critic/value_loss"] for step in range(STEPS)]
    after, values_after = full_params(worker), worker.values(batch)
    out: dict = {
        "peft_class": type(module).__name__,
        "trainable": trainable,
        "losses": losses,
        "changed": sorted(n for n in after if not torch.equal(after[n], before[n])),
        "frozen_identical": all(torch.equal(after[n], before[n]) for n in after if n not in trainable),
        "values_moved": float((values_after - values_before).abs().max()),
        "trained_params": sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for n, p in module.named_parameters() if p.requires_grad
        ),
    }
    if backend == "fsdp2":
        out["optimizer_params"] = sorted(sharded[id(p)] for p in worker.engine.optimizer.state)
    # a checkpoint, more training, then the checkpoint back: the saved values again
    ckpt = os.path.join(folder, "ckpt", "critic")
    worker.save_checkpoint(ckpt, "state")
    dist.barrier()
    worker.train(batch, STEPS)
    moved_on = worker.values(batch)
    worker.load_checkpoint(ckpt, "state")
    restored = worker.values(batch)
    out["moved_after_save"] = float((moved_on - values_after).abs().max())
    out["restored_gap"] = float((restored - values_after).abs().max())
    out["restored_params_identical"] = all(torch.equal(t, after[n]) for n, t in full_params(worker).items())
    if rank == 0:  # the adapter folder: PEFT's format, over the critic's base as load_critic builds it
        adapter = os.path.join(ckpt, "adapter")
        out["adapter_files"] = sorted(os.listdir(adapter))
        base = load_critic(os.path.join(folder, "policy"), dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, adapter).eval()
        with torch.no_grad():
            v = response_values(peft, batch.sequences, batch.attention_mask, batch.response_len)
        out["adapter_values_gap"] = float((v - values_after).abs().max())
    return out


def main() -> None:
    backend, folder = sys.argv[1], sys.argv[2]
    result = {"rank": int(os.environ["RANK"]), **run(backend, folder)}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # no rank tears its group down while a peer is still in a collective
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort at interpreter exit (see fsdp2_worker.main)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
