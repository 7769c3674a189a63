"""One training step, phase by phase, as the hybrid engine runs it on shared GPUs.

    generate      the engines sample n completions per prompt (or n conversations with an environment: agents/)
    reward        a rule function on the driver, or the reward model
    reference     log-probs for the KL term
    critic_infer  values (PPO)
    actor_train   old log-probs (when needed) -> advantages -> PPO epochs
    sync          the actor's new weights stream into the engines
    critic_train  value updates (PPO)

Before each phase the residency owner (:class:`hybrid_core.residency.ResidencyOwner`, built by
:mod:`hybrid_algos.train.loop`) makes the GPUs hold what the plan keeps there in that phase: it is the only code
that moves state on or off a GPU. Right after generating, the owner is told the next GPU phase at once, so what
leaves the GPUs then (the engines' KV cache, say) is released while the driver scores the rewards. Every phase's
seconds and bytes go into the step's timeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybrid_core.stats import PhaseTimer

from .advantage_step import advantages_for
from .dynamic_sampling import sample_rollout, shape_rewards
from .experience import Rollout
from .rewards import RewardScorer


@dataclass
class StepContext:
    """Everything a step needs; built once by :mod:`hybrid_algos.train.loop`."""

    config: Any
    actor: Any  # hybrid_core.roles.RoleGroup of PolicyWorker
    engines: Any  # hybrid_engines EngineGroup
    weight_sync: Any  # WeightSync (train/weight_sync.py)
    reward: RewardScorer
    residency: Any  # hybrid_core.residency.ResidencyOwner: every sleep and wake of the run goes through it
    pad_id: int
    critic: Any | None = None
    reference: Any | None = None
    reward_model: Any | None = None
    kl_controller: Any | None = None
    on_phases: Callable[[int, list], Any] | None = None  # gets (step, [(phase, start, end), ...]): timeline.py
    prompt_pool: list | None = None  # every prompt: dynamic sampling (dynamic_sampling.py) draws extra ones here
    agent: Any | None = None  # agents.AgentRollout: samples are multi-turn conversations with an environment

    def enter(self, phase: str, timer: PhaseTimer) -> None:
        """Make the GPUs ready for ``phase`` (a phase of a role this run does not have is skipped)."""
        if phase in self.phase_names:
            self.residency.enter(phase, timer)

    @property
    def phase_names(self) -> list[str]:
        return [p.name for p in self.residency.plan.phases]

    def after(self, phase: str) -> str:
        names = self.phase_names
        return names[(names.index(phase) + 1) % len(names)]


def run_step(ctx: StepContext, step: int, prompts: list, sampling) -> tuple[dict[str, float], Rollout]:
    """Run one step on ``prompts`` (a list of ``Prompt``); returns its metrics and the scored rollout."""
    timer = PhaseTimer()
    t0 = time.perf_counter()

    # ---- rollout ---------------------------------------------------------------------------------------------------
    ctx.enter("generate", timer)
    with timer.phase("generate"):
        sampled = sample_rollout(ctx, step, prompts, sampling)  # DAPO dynamic sampling: dynamic_sampling.py
    return train_on(ctx, step, sampled, sampling, timer, t0)


def train_on(ctx: StepContext, step: int, sampled, sampling, timer: PhaseTimer, t0: float,
             sync: Callable[[], Any] | None = None) -> tuple[dict[str, float], Rollout]:
    """Everything of a step after generation: rewards, inference, the update and the weight sync. Asynchronous
    training (:mod:`.async_rollout`) calls it on a batch generated earlier, with its own ``sync`` (the weight update
    at the boundary between batches)."""
    cfg = ctx.config
    prompts, outputs = sampled.prompts, sampled.outputs
    rollout = sampled.rollout(ctx.pad_id)  # multi-turn samples: the environment's tokens are masked out
    ctx.enter(ctx.after("generate"), timer)  # what leaves the GPUs now goes while the driver scores

    # ---- rewards, reference, critic ------------------------------------------------------------------------------
    with timer.phase("reward"):
        scores = sampled.scores
        if scores is None and ctx.reward_model is None:
            scores = ctx.reward.score(prompts, outputs)
    if ctx.reward_model is not None:
        rm = ctx.reward_model
        ctx.enter("reward", timer)
        with timer.phase("infer"):
            scores = torch.cat(rm.call_sharded("scores", rollout.split(rm.world_size)))
    raw_scores = scores
    scores, sample_mask, shaping = shape_rewards(cfg, outputs, scores, sampling.max_new_tokens)  # DAPO overlong
    rollout = rollout.with_(scores=ctx.reward.normalize(scores), sample_mask=sample_mask)
    if ctx.reference is not None:
        ref = ctx.reference
        ctx.enter("reference", timer)
        with timer.phase("infer"):
            rollout = rollout.with_(ref_logprobs=torch.cat(ref.call_sharded("logprobs", rollout.split(ref.world_size))))
    if ctx.critic is not None:
        critic = ctx.critic
        ctx.enter("critic_infer", timer)
        with timer.phase("infer"):
            rollout = rollout.with_(values=torch.cat(critic.call_sharded("values", rollout.split(critic.world_size))))

    # ---- actor: old log-probs, advantages, update, weight sync --------------------------------------------------
    actor = ctx.actor
    kl_coef = ctx.kl_controller.value if ctx.kl_controller is not None else 0.0
    recompute_old = cfg.needs_old_logprobs  # else train uses its own pre-update log-probs (see the config)
    ctx.enter("actor_train", timer)
    if recompute_old:
        with timer.phase("infer"):
            old = actor.call_sharded("logprobs", rollout.split(actor.world_size))
            rollout = rollout.with_(old_logprobs=torch.cat(old))
    rollout, adv_stats = advantages_for(cfg, rollout, kl_coef)
    with timer.phase("train"):
        actor_stats = actor.call_sharded("train", rollout.split(actor.world_size), step, kl_coef)
    ctx.enter("sync", timer)  # the engines' weights come back (guarded) if the plan took them off
    with timer.phase("sync"):
        sync_stats = ctx.weight_sync.sync(wake_engines=False) if sync is None else sync()
    timer.bytes["sync"] = timer.bytes.get("sync", 0) + sync_stats.bytes
    critic_stats: list[dict] = []
    if ctx.critic is not None:
        critic = ctx.critic
        ctx.enter("critic_train", timer)
        with timer.phase("train"):
            critic_stats = critic.call_sharded("train", rollout.split(critic.world_size), step)

    metrics = _metrics(step, rollout, adv_stats, actor_stats, critic_stats, timer, kl_coef)
    metrics["actor/old_logprobs_recomputed"] = float(recompute_old)
    metrics["reward"] = raw_scores.float().mean().item()
    metrics.update(sampled.metrics)  # with dynamic sampling, "reward" is over every sample generated, not only kept
    metrics.update(shaping)
    metrics["time/step"] = time.perf_counter() - t0
    if ctx.kl_controller is not None:
        ctx.kl_controller.update(metrics["kl_seq"], rollout.batch_size)
    if ctx.on_phases is not None:
        ctx.on_phases(step, timer.spans)
    return metrics, rollout


def _mean_dicts(dicts: list[dict]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


def _metrics(step, rollout: Rollout, adv_stats, actor_stats, critic_stats, timer: PhaseTimer, kl_coef) -> dict[str, float]:
    mask = rollout.action_mask
    metrics: dict[str, float] = {"step": step, "response_len": rollout.response_lengths.float().mean().item(), "kl_coef": kl_coef}
    actor = _mean_dicts(actor_stats)
    if rollout.ref_logprobs is None:
        metrics["kl"] = metrics["kl_seq"] = 0.0
    elif rollout.old_logprobs is not None:  # k1 estimate of KL(actor || reference)
        kl_tokens = (rollout.old_logprobs - rollout.ref_logprobs) * mask
        metrics["kl"] = (kl_tokens.sum() / mask.sum().clamp(min=1)).item()
        metrics["kl_seq"] = kl_tokens.sum(-1).mean().item()  # per sequence, what the adaptive controller steers
    else:  # no old-logprob pass: train summed the same k1 terms from its own pre-update log-probs.
        # Every rank holds an equal shard, so the ratios of the ranks' means are the ratios of the totals.
        metrics["kl"] = actor["_kl_sum"] / actor["_kl_tokens"] if actor["_kl_tokens"] else 0.0
        metrics["kl_seq"] = actor["_kl_sum"] / actor["_kl_seqs"]
    if rollout.old_logprobs is not None and rollout.engine_logprobs is not None and rollout.engine_logprobs.any():
        # Engine vs trainer on the same tokens, same weights: numerics only (bf16, kernels). A large gap means the
        # weight sync loaded something else (a wrong shard or name mapping): worth watching on a new set-up.
        gap = (rollout.old_logprobs.float() - rollout.engine_logprobs.float()).abs() * mask
        metrics["rollout/logprob_gap"] = (gap.sum() / mask.sum().clamp(min=1)).item()
        metrics["rollout/logprob_gap_max"] = gap.max().item()
    metrics.update(adv_stats)
    metrics.update({k: v for k, v in actor.items() if not k.startswith("_")})  # "_..." are sums, not metrics
    if critic_stats:
        metrics.update(_mean_dicts(critic_stats))
    for phase in ("generate", "sleep", "wake", "reward", "infer", "train", "sync"):
        metrics[f"time/{phase}"] = timer.seconds.get(phase, 0.0)
        if timer.bytes.get(phase):
            metrics[f"bytes/{phase}"] = float(timer.bytes[phase])
    return metrics
