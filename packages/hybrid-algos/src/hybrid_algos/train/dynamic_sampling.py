"""The rollout phase's DAPO pieces (Yu et al. 2025, arXiv:2503.14476), called from :mod:`.step`.

:func:`sample_rollout` generates the step's completions. With ``--dynamic_filtering`` it scores each round with
the rule reward, drops the groups whose (shaped) rewards are all equal -- they have zero advantage, so they would
only dilute the batch -- and generates for more prompts until ``rollout_batch_size`` groups are kept, for at most
``--dynamic_filtering_max_rounds`` extra rounds (the engines stay awake: it all happens in the rollout turn). If
the cap is reached first, dropped groups fill the batch (they still cost nothing to the policy gradient), and the
step's metrics say how many. The step's ``reward`` is then the mean over every sample generated (how good the
policy is), ``reward/batch`` the one of the batch trained on. Extra prompts are drawn from the whole prompt set with
a seed of (seed, step, round), so a resumed run draws the same ones.

With an environment (``ctx.agent``: :mod:`.agents`) each round's samples are multi-turn conversations and their raw
scores the environment's rewards (each sample's sum over its turns); dynamic sampling filters them the same way.

:func:`shape_rewards` applies DAPO's soft overlong penalty (``--overlong_buffer_len``) and marks the completions cut
at the length limit, which ``--mask_truncated_completions`` leaves out of the policy loss.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import informative_groups, overlong_penalty
from ..settings import AlgorithmSettings
from .experience import Rollout


@dataclass
class Sampled:
    """The step's prompts and completions (``outputs[i]`` = the samples of ``prompts[i]``), and the raw scores
    when dynamic sampling or the environments already computed them (else None: the step scores them)."""

    prompts: list
    outputs: list
    scores: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def rollout(self, pad_id: int) -> Rollout:
        """The trainer's batch. Multi-turn samples (``extra["action_mask"]``) start from their own prompt ids (an
        environment may rewrite the prompt) and mask the environment's tokens out."""
        multi_turn = any("action_mask" in o.extra for outs in self.outputs for o in outs)
        asked = any(o.logprobs is not None for outs in self.outputs for o in outs)  # else the engines were not asked
        return Rollout.from_generations(
            [p.prompt_ids for p in self.prompts],
            [[o.token_ids for o in outs] for outs in self.outputs],
            pad_id,
            logprobs=[[o.logprobs or [0.0] * len(o.token_ids) for o in outs] for outs in self.outputs]
            if asked
            else None,
            action_masks=[[o.extra.get("action_mask") for o in outs] for outs in self.outputs] if multi_turn else None,
            sample_prompts=[[o.prompt_token_ids for o in outs] for outs in self.outputs] if multi_turn else None,
            images=prompt_images(self.prompts),
        )


def _generate(ctx: Any, step: int, prompts: Sequence[Any], sampling: Any, *, score: bool):
    """One round: ``(outputs, raw scores or None, agent batch or None)``. With an environment (``ctx.agent``,
    :mod:`.agents`) the samples are conversations and their scores the environment's rewards."""
    agent = getattr(ctx, "agent", None)
    if agent is not None:
        batch = agent.run(ctx.engines, prompts, sampling, step)
        return batch.outputs, batch.rewards, batch
    images = prompt_images(prompts)
    if images is None:
        outputs = ctx.engines.generate([p.prompt_ids for p in prompts], sampling)
    else:  # each prompt's images go with its token ids (hybrid_engines.multimodal)
        outputs = ctx.engines.generate([p.prompt_ids for p in prompts], sampling, multimodal=images)
    return outputs, ctx.reward.score(prompts, outputs) if score else None, None


def prompt_images(prompts: Sequence[Any]) -> list[Any] | None:
    """Each prompt's images (``Prompt.images``), or None when no prompt has any (a text-only call)."""
    images = [getattr(p, "images", None) for p in prompts]
    return images if any(m is not None for m in images) else None


def _agent_metrics(batches: list) -> dict[str, float]:
    from .agents import summarize

    return summarize([b for b in batches if b is not None])


def sample_rollout(ctx: Any, step: int, prompts: Sequence[Any], sampling: Any) -> Sampled:
    """Generate the step's rollout (inside the rollout turn), with DAPO's dynamic sampling when configured."""
    algo = ctx.settings.algorithm
    prompts = list(prompts)
    if not algo.dynamic_filtering:
        outputs, scores, batch = _generate(ctx, step, prompts, sampling, score=False)
        return Sampled(prompts, outputs, scores, _agent_metrics([batch]) if batch is not None else {})

    target, n = len(prompts), ctx.settings.rollout.n_samples_per_prompt
    kept: list[tuple[Any, Any, torch.Tensor]] = []
    dropped: list[tuple[Any, Any, torch.Tensor]] = []
    generated, rounds, reward_s = 0, 0, 0.0
    batch = prompts
    agent_batches: list = []
    while True:
        params = sampling if rounds == 0 else dataclasses.replace(sampling, seed=_round_seed(sampling.seed, rounds))
        t0 = time.perf_counter()
        outputs, raw, agent_batch = _generate(ctx, step, batch, params, score=True)
        if agent_batch is None:
            reward_s += time.perf_counter() - t0
        agent_batches.append(agent_batch)
        generated += len(batch)
        shaped, _, _ = shape_rewards(algo, outputs, raw, sampling.max_new_tokens)
        keep = informative_groups(shaped, n_samples_per_prompt=n, reward_range=algo.filter_reward_range)
        for g, (prompt, outs) in enumerate(zip(batch, outputs)):
            (kept if bool(keep[g * n]) else dropped).append((prompt, outs, raw[g * n : (g + 1) * n]))
        if len(kept) >= target or rounds >= algo.filter_max_rounds:
            break
        rounds += 1
        deficit = target - len(kept)
        pass_rate = max(len(kept) / generated, 1 / 8)  # ask for what the pass rate so far says is needed
        batch = extra_prompts(
            ctx, ctx.settings.rollout.seed, step, rounds, min(math.ceil(deficit / pass_rate), 4 * target), prompts
        )

    filled = max(0, target - len(kept))
    chosen = kept[:target] + dropped[:filled]
    scores = torch.cat([c[2] for c in chosen])
    everything = torch.cat([g[2] for g in kept + dropped])
    metrics = {
        "reward": everything.float().mean().item(),
        "reward/batch": scores.float().mean().item(),
        "dynamic_sampling/rounds": float(rounds + 1),
        "dynamic_sampling/generated_prompts": float(generated),
        "dynamic_sampling/generated_samples": float(generated * n),
        "dynamic_sampling/pass_rate": len(kept) / generated,
        "dynamic_sampling/filled_groups": float(filled),
        "dynamic_sampling/reward_s": reward_s,
    }
    if any(b is not None for b in agent_batches):
        metrics.update(_agent_metrics(agent_batches))
    return Sampled([c[0] for c in chosen], [c[1] for c in chosen], scores, metrics)


def _round_seed(seed: int | None, round_: int) -> int | None:
    return None if seed is None else seed + 7919 * round_


def extra_prompts(ctx: Any, seed: int, step: int, round_: int, count: int, fallback: Sequence[Any]) -> list:
    """``count`` prompts for an extra round: drawn from the whole prompt set (``ctx.prompt_pool``) under a seed of
    (seed, step, round); the step's own prompts when no pool is given."""
    pool = list(getattr(ctx, "prompt_pool", None) or fallback)
    rng = random.Random(f"{seed}:{step}:{round_}")
    if count <= len(pool):
        return [pool[i] for i in rng.sample(range(len(pool)), count)]
    return [pool[rng.randrange(len(pool))] for _ in range(count)]


def shape_rewards(
    algo: AlgorithmSettings, outputs: Sequence[Sequence[Any]], scores: torch.Tensor, max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """``(scores with the overlong penalty, sample_mask or None, metrics)`` for prompt-major ``outputs``.

    The penalty's length limit is the step's real one (``max_new_tokens``: built-in tasks stop earlier than
    ``--generate_max_len``), its buffer at most that limit."""
    flat = [o for outs in outputs for o in outs]
    truncated = torch.tensor([o.finish_reason == "length" for o in flat], dtype=torch.bool)
    failed = torch.tensor([bool(o.extra.get("agent_failed")) for o in flat], dtype=torch.bool)
    metrics = {"rollout/truncated_frac": truncated.float().mean().item() if len(flat) else 0.0}
    if algo.overlong_buffer_len is not None:
        lengths = torch.tensor([len(o.token_ids) for o in flat])
        penalty = overlong_penalty(
            lengths, max_new_tokens, min(algo.overlong_buffer_len, max_new_tokens), algo.overlong_penalty_factor
        )
        scores = scores + penalty.to(scores.dtype)
        metrics["reward/overlong_penalty"] = penalty.mean().item()
    sample_mask = ~truncated if algo.mask_truncated_completions else None
    if failed.any():  # an environment failed (--agent_on_error end_sample): not the policy's doing
        sample_mask = ~failed if sample_mask is None else sample_mask & ~failed
    return scores, sample_mask, metrics
