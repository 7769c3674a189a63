"""One training step, phase by phase, as the hybrid engine runs it on shared GPUs.

    rollout turn:   wake engines -> generate n samples per prompt -> sleep engines
    reward:         rule function on the driver, or the reward model's turn
    reference turn: log-probs for the KL term
    critic turn:    values (PPO)
    actor turn:     wake -> old log-probs -> advantages -> PPO epochs -> weight sync to the engines -> sleep
                    (old log-probs only when ``config.needs_old_logprobs``: an on-policy update takes its own)
    critic turn:    value updates (PPO)

A "turn" is only taken by roles that sleep (they share GPUs); the turnstile guarantees the previous holder of those
GPUs is asleep first. Every phase's seconds and bytes go into the step's timeline.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

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
    actor: Any  # RoleGroup of PolicyWorker
    engines: Any  # hybrid_engines EngineGroup
    weight_sync: Any  # WeightSync (train/weight_sync.py)
    reward: RewardScorer
    turnstile: Any | None
    pad_id: int
    critic: Any | None = None
    reference: Any | None = None
    reward_model: Any | None = None
    kl_controller: Any | None = None
    engine_gpus: list[int] = field(default_factory=list)
    engine_sleeps: bool = False
    engine_weights_awake: bool = True  # False while the engines' weights are offloaded (level 1) or discarded (level 2)
    memory: Any | None = None  # WakeGuard (memory_guard.py): room on the GPU is checked before each wake
    on_phases: Callable[[int, list], Any] | None = None  # gets (step, [(phase, start, end), ...]): timeline.py
    prompt_pool: list | None = None  # every prompt: dynamic sampling (dynamic_sampling.py) draws extra ones here


@contextlib.contextmanager
def turn(ctx: StepContext, role: str, gpus: list[int], sleeps: bool, timer: PhaseTimer,
         wake: Callable[[], Any], sleep: Callable[[], Any], wake_kind: str = "all") -> Iterator[None]:
    """Take the role's turn on its GPUs (if it sleeps), check there is room, wake it, run the block, sleep."""
    if not sleeps:
        yield
        return
    if ctx.turnstile is not None:
        ctx.turnstile.acquire(role, gpus, timeout_s=ctx.config.call_timeout_s)
    try:
        guarded_wake(ctx, role, wake_kind, lambda: _timed(timer, "wake", wake))
        yield
        slept = _timed(timer, "sleep", sleep)
        if ctx.memory is not None:
            ctx.memory.after_sleep(role, slept)
    except BaseException:
        if ctx.turnstile is not None:
            release_quietly(ctx.turnstile, role, gpus)  # the phase's own error is the one to report
        raise
    if ctx.turnstile is not None:
        ctx.turnstile.release(role, gpus)


def guarded_wake(ctx: StepContext, role: str, kind: str, wake: Callable[[], Any]) -> Any:
    """Wake ``role`` under the memory guard: room checked first, and a wake that still runs out of memory (another
    process took the memory after the check) raises the guard's error naming who holds the GPU."""
    if ctx.memory is None:
        return wake()
    before = ctx.memory.before_wake(role, kind)
    try:
        result = wake()
    except Exception as error:
        explained = ctx.memory.explain_wake_failure(role, kind, error)
        if explained is None:
            raise
        raise explained from error
    ctx.memory.after_wake(role, kind, before)
    return result


def release_quietly(turnstile: Any, role: str, gpus: list[int]) -> None:
    """Give a turn back after a failed phase; a failure here (the step's budget is spent) must not hide that one."""
    with contextlib.suppress(Exception):
        turnstile.release(role, gpus)


def _timed(timer: PhaseTimer, phase: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    timer.add(phase, time.perf_counter() - start, _bytes_of(result))
    return result


def _bytes_of(result: Any) -> int:
    if isinstance(result, dict):
        return int(result.get("bytes", 0))
    if isinstance(result, (list, tuple)):
        return sum(_bytes_of(r) for r in result)
    return int(getattr(result, "bytes", 0) or 0)


def run_step(ctx: StepContext, step: int, prompts: list, sampling) -> tuple[dict[str, float], Rollout]:
    """Run one step on ``prompts`` (a list of ``Prompt``); returns its metrics and the scored rollout."""
    cfg = ctx.config
    timer = PhaseTimer()
    t0 = time.perf_counter()

    # ---- rollout ---------------------------------------------------------------------------------------------------
    def engines_wake():  # after a weight sync the weights are already on the GPU: only the KV cache comes back
        return ctx.engines.wake_up(["kv_cache"] if ctx.engine_weights_awake else None)

    with turn(ctx, "rollout", ctx.engine_gpus, ctx.engine_sleeps, timer, engines_wake,
              lambda: ctx.engines.sleep(cfg.engine_sleep_level),
              wake_kind="kv_cache" if ctx.engine_weights_awake else "all"):
        with timer.phase("generate"):
            sampled = sample_rollout(ctx, step, prompts, sampling)  # DAPO dynamic sampling: dynamic_sampling.py
    prompts, outputs = sampled.prompts, sampled.outputs
    if ctx.engine_sleeps:
        ctx.engine_weights_awake = False
    rollout = Rollout.from_generations(
        [p.prompt_ids for p in prompts], [[o.token_ids for o in outs] for outs in outputs], ctx.pad_id,
        logprobs=[[o.logprobs or [0.0] * len(o.token_ids) for o in outs] for outs in outputs])

    # ---- rewards, reference, critic ------------------------------------------------------------------------------
    with timer.phase("reward"):
        scores = sampled.scores
        if scores is None and ctx.reward_model is None:
            scores = ctx.reward.score(prompts, outputs)
    if ctx.reward_model is not None:
        rm = ctx.reward_model
        with turn(ctx, "reward", rm.gpus, rm.sleeps, timer, lambda: rm.call("wake"), lambda: rm.call("sleep")):
            with timer.phase("infer"):
                scores = torch.cat(rm.call_sharded("scores", rollout.split(rm.world_size)))
    raw_scores = scores
    scores, sample_mask, shaping = shape_rewards(cfg, outputs, scores, sampling.max_new_tokens)  # DAPO overlong
    rollout = rollout.with_(scores=ctx.reward.normalize(scores), sample_mask=sample_mask)
    if ctx.reference is not None:
        ref = ctx.reference
        with turn(ctx, "reference", ref.gpus, ref.sleeps, timer, lambda: ref.call("wake"), lambda: ref.call("sleep")):
            with timer.phase("infer"):
                rollout = rollout.with_(ref_logprobs=torch.cat(ref.call_sharded("logprobs", rollout.split(ref.world_size))))
    if ctx.critic is not None:
        critic = ctx.critic
        with turn(ctx, "critic", critic.gpus, critic.sleeps, timer, lambda: critic.call("wake"), lambda: critic.call("sleep")):
            with timer.phase("infer"):
                rollout = rollout.with_(values=torch.cat(critic.call_sharded("values", rollout.split(critic.world_size))))

    # ---- actor: old log-probs, advantages, update, weight sync --------------------------------------------------
    actor = ctx.actor
    kl_coef = ctx.kl_controller.value if ctx.kl_controller is not None else 0.0
    recompute_old = cfg.needs_old_logprobs  # else train uses its own pre-update log-probs (see the config)
    with turn(ctx, "actor", actor.gpus, actor.sleeps, timer, lambda: actor.call("wake"), lambda: actor.call("sleep")):
        if recompute_old:
            with timer.phase("infer"):
                old = actor.call_sharded("logprobs", rollout.split(actor.world_size))
                rollout = rollout.with_(old_logprobs=torch.cat(old))
        rollout, adv_stats = advantages_for(cfg, rollout, kl_coef)
        with timer.phase("train"):
            actor_stats = actor.call_sharded("train", rollout.split(actor.world_size), step, kl_coef)
        with timer.phase("sync"):
            # The sync is the one moment two roles share a GPU: the actor's states and the engines' weights (no KV
            # cache). It happens inside the actor's turn; the engines' KV cache waits for the rollout turn.
            if not ctx.engine_weights_awake:  # the engines' weights come back first (guarded like any wake)
                guarded_wake(ctx, "rollout", "weights", lambda: ctx.engines.wake_up(["weights"]))
            sync_stats = ctx.weight_sync.sync(wake_engines=False)
        timer.bytes["sync"] = timer.bytes.get("sync", 0) + sync_stats.bytes
        ctx.engine_weights_awake = True  # (the guard counted the engines awake in guarded_wake)
    critic_stats: list[dict] = []
    if ctx.critic is not None:
        critic = ctx.critic
        if ctx.engine_sleeps and critic.sleeps:
            # The engines now hold fresh weights; they give the GPU back before the critic takes its turn.
            slept = _timed(timer, "sleep", lambda: ctx.engines.sleep(1))
            ctx.engine_weights_awake = False
            if ctx.memory is not None:
                ctx.memory.after_sleep("rollout", slept)
        with turn(ctx, "critic", critic.gpus, critic.sleeps, timer, lambda: critic.call("wake"), lambda: critic.call("sleep")):
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
