"""One training step: the run's recipe's phases (:mod:`.recipe`, :mod:`.recipes`), in order, each run by its function
in :data:`PHASES`. PPO's step, as the hybrid engine runs it on shared GPUs:

    generate      the engines sample n completions per prompt (or n conversations with an environment: agents/)
    reward        a rule function on the driver, or the reward model
    reference     log-probs for the KL term (under LoRA: reference_base, the actor with its adapters off)
    teacher       the teacher's log-probs of the same tokens (on-policy distillation)
    critic_infer  values (PPO)
    actor_train   old log-probs (when needed) -> advantages -> PPO epochs
    sync          the actor's new weights stream into the engines
    critic_train  value updates (PPO)
    eval          held-out prompts through the engines, scored (only with --eval_dataset, at its steps)

Before each phase the residency owner (:class:`hybrid_core.residency.ResidencyOwner`, built by
:mod:`hybrid_algos.train.session_start`) makes the GPUs hold what the plan keeps there in that phase: it is the only
code that moves state on or off a GPU. Right after generating, the owner is told the next GPU phase at once, so what
leaves the GPUs then (the engines' KV cache, say) is released while the driver scores the rewards. Every phase's
seconds and bytes go into the step's timeline.

A phase function takes ``(ctx, state)`` -- the run's :class:`StepContext` and the step's :class:`StepState`, whose
rollout it reads and extends -- and is registered by name (``@phase("teacher_logprobs")``); a recipe's
``PhaseSpec.run`` names it. A phase that runs only at some steps says when (``@phase("eval", due=...)``): at the
other steps it is skipped, residency moves included.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybrid_core.stats import PhaseTimer

from .advantage_step import advantages_for
from .dynamic_sampling import sample_rollout, shape_rewards
from .experience import Rollout
from .rewards import RewardScorer
from .train_settings import TrainSettings


@dataclass
class StepContext:
    """Everything a step needs; built once by :mod:`hybrid_algos.train.session_start`."""

    settings: TrainSettings  # the run's sections (never the flat config)
    actor: Any  # hybrid_core.roles.RoleGroup of PolicyWorker
    engines: Any  # hybrid_engines EngineGroup
    weight_sync: Any  # hybrid_engines.weight_sync.WeightSync
    reward: RewardScorer
    residency: Any  # hybrid_core.residency.ResidencyOwner: every sleep and wake of the run goes through it
    pad_id: int
    recipe: Any  # recipe.Recipe: the phases the step runs, in order (prepare resolved it from the config)
    roles: dict[str, Any] = field(default_factory=dict)  # name -> RoleGroup: every worker role of the recipe
    kl_controller: Any | None = None
    on_phases: Callable[[int, list], Any] | None = None  # gets (step, [(phase, start, end), ...]): timeline.py
    prompt_pool: list | None = None  # every prompt: dynamic sampling (dynamic_sampling.py) draws extra ones here
    agent: Any | None = None  # agents.AgentRollout: samples are multi-turn conversations with an environment
    evaluation: Any | None = None  # evaluation.Evaluation: the held-out prompts and the steps they are generated on

    def __post_init__(self) -> None:
        first = self.recipe.phases[0] if self.recipe.phases else None
        if first is None or first.function != "generate":
            raise ValueError(
                f"recipe {self.recipe.name}: a step starts with its rollout (a phase that runs "
                f"'generate'), not {first.function if first else 'nothing'!r}"
            )
        unknown = [p.function for p in self.recipe.phases[1:] if p.function not in PHASES]
        if unknown:
            raise ValueError(
                f"recipe {self.recipe.name}: no phase function {', '.join(map(repr, unknown))} in "
                f"step.PHASES ({', '.join(PHASES)}); register it with @phase(name)"
            )

    def role(self, name: str) -> Any | None:
        """The role group ``name``, or None when this run has no such role."""
        return self.roles.get(name)

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


@dataclass
class StepState:
    """One step's data as its phases pass it on: the rollout each phase extends, and what the step reports."""

    step: int
    sampled: Any  # dynamic_sampling.Sampled: prompts, outputs, scores from the rollout (an environment's, or None)
    sampling: Any  # hybrid_engines SamplingParams of the step
    timer: PhaseTimer
    rollout: Rollout
    sync: Callable[[], Any] | None = None  # asynchronous training's weight update (None: the weight sync's own)
    kl_coef: float = 0.0
    raw_scores: torch.Tensor | None = None
    adv_stats: dict[str, float] = field(default_factory=dict)
    actor_stats: list[dict] = field(default_factory=list)
    critic_stats: list[dict] = field(default_factory=list)
    shaping: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # a phase's own metrics (added to the step's)
    extras: dict[str, Any] = field(default_factory=dict)  # what a phase leaves for a later one (beyond the rollout)


#: phase function name -> fn(ctx, state): what a recipe's PhaseSpec.run names
PHASES: dict[str, Callable[[StepContext, StepState], None]] = {}
#: phase function name -> due(ctx, step): whether it runs at (0-based) ``step``; a phase not named runs every step
DUE: dict[str, Callable[[StepContext, int], bool]] = {}


def phase(name: str, *, due: Callable[[StepContext, int], bool] | None = None) -> Callable:
    """Register a phase function under ``name`` (the ``run`` of the recipe phases that call it); ``due``: for a phase
    of some steps only, whether it runs at a step (the others skip it, and the residency moves into it)."""

    def register(fn: Callable[[StepContext, StepState], None]) -> Callable[[StepContext, StepState], None]:
        if name in PHASES and PHASES[name] is not fn:
            raise ValueError(f"a phase function {name!r} is registered already")
        PHASES[name] = fn
        if due is not None:
            DUE[name] = due
        return fn

    return register


def run_step(ctx: StepContext, step: int, prompts: list, sampling) -> tuple[dict[str, float], Rollout]:
    """Run one step on ``prompts`` (a list of ``Prompt``); returns its metrics and the scored rollout."""
    timer = PhaseTimer()
    t0 = time.perf_counter()

    # ---- rollout: the recipe's first phase -------------------------------------------------------------------
    ctx.enter(ctx.recipe.phases[0].name, timer)
    with timer.phase("generate"):
        sampled = sample_rollout(ctx, step, prompts, sampling)  # DAPO dynamic sampling: dynamic_sampling.py
    return train_on(ctx, step, sampled, sampling, timer, t0)


def train_on(
    ctx: StepContext, step: int, sampled, sampling, timer: PhaseTimer, t0: float, sync: Callable[[], Any] | None = None
) -> tuple[dict[str, float], Rollout]:
    """Every phase of the step after generation (rewards, inference, the update, the weight sync: the recipe's
    phases after its first, in order). Asynchronous training (:mod:`.async_rollout`) calls it on a batch generated
    earlier, with its own ``sync`` (the weight update at the boundary between batches)."""
    state = StepState(
        step,
        sampled,
        sampling,
        timer,
        sampled.rollout(ctx.pad_id),
        sync=sync,
        kl_coef=ctx.kl_controller.value if ctx.kl_controller is not None else 0.0,
    )
    # multi-turn samples: the environment's tokens are masked out of the rollout
    ctx.enter(ctx.after(ctx.recipe.phases[0].name), timer)  # what leaves the GPUs now goes while the driver scores
    for spec in ctx.recipe.phases[1:]:
        due = DUE.get(spec.function)
        if due is not None and not due(ctx, step):
            continue  # a phase of some steps only (the evaluation): not this one, so nothing moves for it either
        ctx.enter(spec.name, timer)  # the engines' weights come back (guarded) for the sync if the plan took them
        PHASES[spec.function](ctx, state)

    rollout = state.rollout
    metrics = _metrics(step, rollout, state.adv_stats, state.actor_stats, state.critic_stats, timer, state.kl_coef)
    metrics["actor/old_logprobs_recomputed"] = float(ctx.settings.needs_old_logprobs)
    if state.raw_scores is not None:
        metrics["reward"] = state.raw_scores.float().mean().item()
    metrics.update(sampled.metrics)  # with dynamic sampling, "reward" is over every sample generated, not only kept
    metrics.update(state.shaping)
    metrics.update(state.metrics)
    metrics["time/step"] = time.perf_counter() - t0
    if ctx.kl_controller is not None:
        ctx.kl_controller.update(metrics["kl_seq"], rollout.batch_size)
    if ctx.on_phases is not None:
        ctx.on_phases(step, timer.spans)
    return metrics, rollout


# ---- the phases ------------------------------------------------------------------------------------------------
@phase("reward")
def _reward(ctx: StepContext, s: StepState) -> None:
    """Scores: the rollout's own (an environment's), else the rule function on the driver, else the reward model;
    then DAPO's overlong shaping and the normalisation."""
    prompts, outputs = s.sampled.prompts, s.sampled.outputs
    rm = ctx.role("reward")
    with s.timer.phase("reward"):
        scores = s.sampled.scores
        if scores is None and rm is None:
            scores = ctx.reward.score(prompts, outputs)
    if rm is not None:
        with s.timer.phase("infer"):
            scores = torch.cat(rm.call_sharded("scores", s.rollout.split(rm.world_size)))
    s.raw_scores = scores
    algo = ctx.settings.algorithm
    scores, sample_mask, s.shaping = shape_rewards(algo, outputs, scores, s.sampling.max_new_tokens)
    s.rollout = s.rollout.with_(scores=ctx.reward.normalize(scores), sample_mask=sample_mask)


@phase("reference")
def _reference_logprobs(ctx: StepContext, s: StepState) -> None:
    """The reference model's log-probs of the rollout's tokens (the KL term's other side)."""
    ref = ctx.roles["reference"]  # the phase is in the step only with the role
    with s.timer.phase("infer"):
        logprobs = ref.call_sharded("logprobs", s.rollout.split(ref.world_size))
        s.rollout = s.rollout.with_(ref_logprobs=torch.cat(logprobs))


@phase("reference_base")
def _reference_from_base(ctx: StepContext, s: StepState) -> None:
    """Under LoRA: the reference's log-probs from the actor's frozen base (adapters off), no reference model."""
    with s.timer.phase("infer"):
        logprobs = ctx.actor.call_sharded("base_logprobs", s.rollout.split(ctx.actor.world_size))
        s.rollout = s.rollout.with_(ref_logprobs=torch.cat(logprobs))


@phase("teacher")
def _teacher_logprobs(ctx: StepContext, s: StepState) -> None:
    """The teacher's log-probs of the student's tokens, for the distillation term of the advantages."""
    teacher = ctx.roles["teacher"]  # the phase is in the step only with the role
    with s.timer.phase("infer"):
        logprobs = teacher.call_sharded("logprobs", s.rollout.split(teacher.world_size))
    s.extras["teacher_logprobs"] = torch.cat(logprobs)


@phase("critic_infer")
def _critic_values(ctx: StepContext, s: StepState) -> None:
    critic = ctx.roles["critic"]  # the phase is in the step only with the role
    with s.timer.phase("infer"):
        values = critic.call_sharded("values", s.rollout.split(critic.world_size))
        s.rollout = s.rollout.with_(values=torch.cat(values))


@phase("actor_train")
def _actor_train(ctx: StepContext, s: StepState) -> None:
    """Old log-probs (when the settings need them), advantages, the actor's update."""
    actor, settings = ctx.actor, ctx.settings
    if settings.needs_old_logprobs:  # else train uses its own pre-update log-probs (AlgorithmSettings says when)
        with s.timer.phase("infer"):
            old = actor.call_sharded("logprobs", s.rollout.split(actor.world_size))
            s.rollout = s.rollout.with_(old_logprobs=torch.cat(old))
    s.rollout, s.adv_stats = advantages_for(
        settings.algorithm,
        s.rollout,
        s.kl_coef,
        n_samples_per_prompt=settings.rollout.n_samples_per_prompt,
        teacher_logprobs=s.extras.get("teacher_logprobs"),
    )
    with s.timer.phase("train"):
        s.actor_stats = actor.call_sharded("train", s.rollout.split(actor.world_size), s.step, s.kl_coef)


@phase("sync")
def _sync(ctx: StepContext, s: StepState) -> None:
    """The actor's new weights into the engines (asynchronous training: its own update at the batch boundary)."""
    with s.timer.phase("sync"):
        sync_stats = ctx.weight_sync.sync(wake_engines=False) if s.sync is None else s.sync()
    s.timer.bytes["sync"] = s.timer.bytes.get("sync", 0) + sync_stats.bytes


@phase("eval", due=lambda ctx, step: ctx.evaluation is not None and ctx.evaluation.due(step))
def _evaluate(ctx: StepContext, s: StepState) -> None:
    """The held-out prompts with the weights just trained: generated, scored, summed up as ``eval/...`` metrics."""
    evaluation = ctx.evaluation
    assert evaluation is not None  # the phase is due only with an evaluation
    with s.timer.phase("eval"):
        s.metrics.update(evaluation.run(ctx.engines, ctx.reward, s.step))
    s.metrics["time/eval"] = s.timer.seconds.get("eval", 0.0)


@phase("critic_train")
def _critic_train(ctx: StepContext, s: StepState) -> None:
    critic = ctx.roles["critic"]  # the phase is in the step only with the role
    with s.timer.phase("train"):
        s.critic_stats = critic.call_sharded("train", s.rollout.split(critic.world_size), s.step)


def _mean_dicts(dicts: list[dict]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


def _metrics(
    step, rollout: Rollout, adv_stats, actor_stats, critic_stats, timer: PhaseTimer, kl_coef
) -> dict[str, float]:
    mask = rollout.action_mask
    metrics: dict[str, float] = {
        "step": step,
        "response_len": rollout.response_lengths.float().mean().item(),
        "kl_coef": kl_coef,
    }
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
