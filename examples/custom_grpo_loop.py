#!/usr/bin/env python3
"""A GRPO loop written by hand from hybrid's building blocks: hybrid-core placement, residency (planner + owner,
with its turnstile), offload and weight sync, a hybrid-engines engine and the hybrid-algos math, with no training
framework in between.

One GPU is shared by a trainer (plain torch + AdamW, in a Ray actor) and an inference engine. A residency plan, made
from the sizes the two roles report, says what each keeps on the GPU in each phase (``--residency all-sleep``: each
moves its memory off while the other works; ``auto``: only what does not fit moves); one owner carries the plan out,
so the loop below only names the phases. After every update the trainer streams its new weights into the engine in
flat shared buckets (CUDA IPC on a GPU, shared memory on CPU).

    python examples/custom_grpo_loop.py --steps 20                  # CPU: the built-in engine, one declared GPU
    python examples/custom_grpo_loop.py --steps 20 --backend vllm   # GPU: pip install "hybrid-engines[vllm]"

The task is the built-in copy task: prompt ``<bos> s_k <sep>``, reward 1 for answering ``s_k``. A random policy
scores ~1/12; the reward passes 0.8 in about 20 steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import ray
import torch

from hybrid_algos import (
    AdvantageInputs,
    aggregate_loss,
    compute_advantages,
    kl_estimate,
    logprobs_from_logits,
    ppo_policy_loss,
)
from hybrid_algos.train.tasks import EOS, SyntheticTask
from hybrid_algos.train.tiny import save_tiny_model
from hybrid_core.cluster import connect
from hybrid_core.errors import ConfigError
from hybrid_core.offload import StateOffloader
from hybrid_core.placement import PlacementSpec, place
from hybrid_core.remote import get_with_timeout
from hybrid_core.residency import GpuShare, Phase, ResidencyOwner, RoleSize, plan_residency
from hybrid_core.runtime_env import worker_runtime_env
from hybrid_core.turnstile import Turnstile
from hybrid_core.weight_sync import IpcBucketSender
from hybrid_engines import SamplingParams, engine_class, launch_engines

TIMEOUT_S = 300.0  # every remote call has a deadline
QUIET = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # no weight-loading progress bars from the actors


class Trainer:
    """The policy and a frozen reference copy (for the KL term) on the trainer's GPU, with AdamW."""

    def __init__(self, model_path: str, lr: float, kl_coef: float, epochs: int, minibatch: int, seed: int):
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Ray made our GPU cuda:0
        load = AutoModelForCausalLM.from_pretrained
        self.policy = load(model_path, dtype=torch.float32).to(self.device)
        self.ref = load(model_path, dtype=torch.float32).to(self.device).requires_grad_(False)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=lr)
        self.kl_coef, self.epochs, self.minibatch = kl_coef, epochs, minibatch
        self.gen = torch.Generator().manual_seed(seed)
        self.offloader = StateOffloader(torch.nn.ModuleList([self.policy, self.ref]), self.opt)
        self.sender = IpcBucketSender(bucket_bytes=64 << 20, device=self.device)

    def state_bytes(self) -> int:
        return self.offloader.device_bytes()

    def offload(self, states):  # policy, reference and AdamW state leave together: one piece for the plan
        return self.offloader.sleep()

    def reload(self, states):
        return self.offloader.wake()

    @staticmethod
    def response_logprobs(model, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
        # Every prompt has the same length and responses are right-padded, so no attention mask is needed.
        logits = model(input_ids=seqs).logits[:, prompt_len - 1 : -1]
        return logprobs_from_logits(logits, seqs[:, prompt_len:])

    def train(self, seqs, mask, advantages, engine_logprobs, prompt_len: int) -> dict:
        seqs, mask, advantages = seqs.to(self.device), mask.to(self.device), advantages.to(self.device)
        with torch.no_grad():
            old = self.response_logprobs(self.policy, seqs, prompt_len)
            ref = self.response_logprobs(self.ref, seqs, prompt_len)
        # The engine sampled with the weights the trainer holds now: their log-probs must agree.
        gap = (old.cpu() - engine_logprobs).abs().masked_fill(~mask.cpu(), 0).max().item()
        for _ in range(self.epochs):
            for idx in torch.randperm(len(seqs), generator=self.gen).split(self.minibatch):
                logp = self.response_logprobs(self.policy, seqs[idx], prompt_len)
                pg_loss, info = ppo_policy_loss(logp, old[idx], advantages[idx], mask[idx], clip_low=0.2)
                kl = aggregate_loss(kl_estimate(logp, ref[idx], "k3", mask=mask[idx]), mask[idx])
                (pg_loss + self.kl_coef * kl).backward()
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)  # no gradients left to offload while asleep
        return {"pg_loss": pg_loss.item(), "kl": kl.item(), "clip_frac": info["clip_frac"].item(), "gap": gap}

    def push_weights(self, engine) -> object:
        """Pack the weights into shared buckets and have the engine (a Ray actor on this GPU) load each one."""
        return self.sender.send(
            self.policy.named_parameters(),
            deliver=engine.update_weights_from_ipc.remote,
            wait=lambda ref: get_with_timeout(ref, TIMEOUT_S, "engine: update_weights_from_ipc"),
        )


class TrainerHandle:
    """What the residency owner needs to move the trainer: its GPUs, and calls it starts without waiting."""

    role = "actor"

    def __init__(self, actor, gpus):
        self.actor, self.gpus = actor, gpus

    def offload(self, states, moves):
        return [("trainer: offload", self.actor.offload.remote(list(states)))]

    def reload(self, states):
        return [("trainer: reload", self.actor.reload.remote(list(states)))]


def to_batch(task: SyntheticTask, prompts, outputs, max_new: int):
    """Prompt-major rows ``[prompt | response | pad]``, the response mask, engine log-probs and rewards."""
    seqs, mask, logprobs, scores = [], [], [], []
    for prompt, samples in zip(prompts, outputs):
        for out in samples:
            pad = max_new - len(out.token_ids)
            seqs.append(prompt.prompt_ids + out.token_ids + [0] * pad)
            mask.append([True] * len(out.token_ids) + [False] * pad)
            logprobs.append(out.logprobs + [0.0] * pad)
            scores.append(task.score(out.token_ids, prompt.label))
    return torch.tensor(seqs), torch.tensor(mask), torch.tensor(logprobs), torch.tensor(scores)


def engine_kwargs(backend: str, model_path: str, seed: int, dtype: str = "float32") -> dict:
    if backend == "vllm":
        return {
            "model": model_path,
            "dtype": dtype,
            "gpu_memory_utilization": 0.3,
            "enforce_eager": True,
            "max_model_len": 64,
            "seed": seed,
        }
    return {"model": model_path, "dtype": dtype, "seed": seed}


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engine-dtype", default="float32", help="float32: engine and trainer agree to ~1e-6")
    p.add_argument("--residency", default="all-sleep", choices=["all-sleep", "auto"])
    p.add_argument("--gpu-gib", type=float, default=80.0, help="the GPU memory the residency plan may use")
    args = p.parse_args(argv)
    try:
        engine_class(args.backend)  # a missing backend library fails here, naming the extra, before Ray starts
    except ConfigError as e:
        p.error(str(e))

    os.environ.update(QUIET)
    task = SyntheticTask("copy", num_symbols=8, prompt_symbols=1)
    model_path = save_tiny_model(os.path.join(tempfile.mkdtemp(prefix="grpo-"), "tiny"), seed=args.seed)
    connect(num_gpus=None if torch.cuda.is_available() else 1)  # on CPU, declare one (fake) GPU to Ray

    plan = PlacementSpec.from_ranges({"actor": "0", "rollout": "0"}).plan()
    print(plan.render())
    gpus = list(plan.roles["actor"].gpus)
    placed = place(plan, timeout_s=60)
    turnstile = Turnstile.create(f"grpo-{os.getpid()}", timeout_s=TIMEOUT_S)
    trainer_options = {**placed.actor_options("actor", 0), "runtime_env": worker_runtime_env(QUIET)}
    trainer = (
        ray.remote(Trainer)
        .options(**trainer_options)
        .remote(model_path, lr=args.lr, kl_coef=1e-3, epochs=2, minibatch=32, seed=args.seed)
    )
    call = lambda ref, what: get_with_timeout(ref, TIMEOUT_S, what)  # noqa: E731
    # The residency plan, from what the trainer holds (policy + reference + AdamW state, one piece) and the engine.
    trainer_bytes = call(trainer.state_bytes.remote(), "trainer: state_bytes")
    engine_bytes = trainer_bytes // 4  # the policy alone, without the reference and the optimizer state
    layout = {
        0: (
            GpuShare(RoleSize("actor", "trainer", {"params": trainer_bytes, "grads": 0, "optimizer": 0})),
            GpuShare(RoleSize("rollout", "engine", {"weights": engine_bytes, "kv_cache": 0})),
        )
    }
    step = (
        Phase("generate", "rollout", {"rollout": ("weights", "kv_cache")}, work=("generate",)),
        Phase("actor_train", "actor", {"actor": ("params", "grads", "optimizer")}, work=("train",)),
        Phase(
            "sync",
            "actor",
            {"actor": ("params",), "rollout": ("weights",)},
            work=("sync",),
            holds={("rollout", "weights"): "generate"},
        ),
    )  # the step: synced weights stay until generated with
    residency = plan_residency(layout, args.gpu_gib * 2**30, phases=step, mode=args.residency, engine_sleep_level=2)
    print(residency.render())
    owner = ResidencyOwner(residency, {"actor": TrainerHandle(trainer, gpus)}, turnstile=turnstile, timeout_s=TIMEOUT_S)
    owner.tag = 0
    owner.to_phase_state("generate")  # the engine's phase comes first: the trainer leaves before it starts
    engines = launch_engines(
        placed,
        "rollout",
        backend=args.backend,
        timeout_s=TIMEOUT_S,
        env_vars=QUIET,
        engine_kwargs=engine_kwargs(args.backend, model_path, args.seed, args.engine_dtype),
    )
    owner.add_role("rollout", engines)
    rewards = []
    try:
        for step in range(args.steps):
            prompts = task.prompts(args.prompts, seed=args.seed * 100_000 + step)
            params = SamplingParams(
                temperature=1.0, max_new_tokens=task.answer_len + 1, n=args.samples, stop_token_ids=(EOS,), seed=step
            )
            owner.tag = step
            owner.enter("generate")  # the engine's KV cache (and its weights, after a level-2 sleep) come back
            outputs = engines.generate([q.prompt_ids for q in prompts], params)
            seqs, mask, engine_lp, scores = to_batch(task, prompts, outputs, params.max_new_tokens)
            advantages, _ = compute_advantages("grpo", AdvantageInputs(mask, scores, n_samples_per_prompt=args.samples))
            owner.enter(
                "actor_train"
            )  # the engine sleeps (its weights dropped: the sync refills them), the trainer wakes
            stats = call(
                trainer.train.remote(seqs, mask, advantages, engine_lp, len(prompts[0].prompt_ids)), "trainer: train"
            )
            owner.enter("sync")  # the one moment both share the GPU: the engine's weights only, no KV cache
            synced = call(trainer.push_weights.remote(engines.actors[0]), "trainer: push_weights")
            rewards.append(scores.mean().item())
            moved = {
                (e["role"], e["direction"]): e["bytes"]
                for e in owner.log
                if e.get("tag") == step and e["event"] == "move"
            }
            print(
                f"step {step:3d} | reward {rewards[-1]:.3f} | pg_loss {stats['pg_loss']:+.4f} | kl {stats['kl']:.2e}"
                f" | engine/trainer logprob gap {stats['gap']:.1e} | trainer sleep "
                f"{moved.get(('actor', 'off'), 0) / 1e6:.1f} MB wake {moved.get(('actor', 'on'), 0) / 1e6:.1f} MB"
                f" | sync {synced.bytes / 1e6:.1f} MB {synced.seconds * 1e3:.0f} ms",
                flush=True,
            )
        owner.finish()
    finally:
        engines.shutdown()
        ray.kill(trainer)
        turnstile.kill()
        placed.remove()
        ray.shutdown()
    k = min(3, len(rewards))
    print(
        f"reward: first {k} steps {statistics.mean(rewards[:k]):.3f} -> last {k} steps "
        f"{statistics.mean(rewards[-k:]):.3f}"
    )
    return rewards


if __name__ == "__main__":
    main()
