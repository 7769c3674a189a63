#!/usr/bin/env python3
"""hybrid-algos in a plain PyTorch training step: no Ray, no inference engine, no transformers.

What a project with its own model, sampler and trainer takes from hybrid-algos (``pip install torch hybrid-algos``):
the advantage estimators, the clipped PPO policy loss, the critic's clipped value loss, the KL estimators and the
loss aggregation. Everything else here -- the toy policy, sampling, rewards -- stands in for the project's own code.

    python examples/algos_only.py            # GRPO, RLOO, REINFORCE++ and PPO (GAE + critic), a few seconds on CPU

The toy task: the prompt is one symbol; the right response is that symbol, then the stop token (reward 1; the right
symbol without the stop scores 0.5). Responses end at the first stop token: the response mask covers it and nothing
after it, exactly as with an LLM's right-padded responses.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from hybrid_algos import (
    AdvantageInputs,
    aggregate_loss,
    clipped_value_loss,
    compute_advantages,
    kl_estimate,
    kl_penalty,
    logprobs_from_logits,
    ppo_policy_loss,
)

VOCAB, STOP, MAX_NEW = 10, 0, 3  # token 0 stops a response; symbols are 1..9
PROMPTS, SAMPLES = 16, 8  # per step: 16 prompts x 8 samples (the GRPO / RLOO group)


class ToyPolicy(nn.Module):
    """A tiny autoregressive model: next-token logits (and a value) from the prompt, the previous token, the step."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.prompt, self.prev, self.pos = (
            nn.Embedding(VOCAB, hidden),
            nn.Embedding(VOCAB + 1, hidden),
            nn.Embedding(MAX_NEW, hidden),
        )
        self.body = nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.lm_head, self.value_head = nn.Linear(hidden, VOCAB), nn.Linear(hidden, 1)

    def forward(self, prompts: torch.Tensor, responses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: ``[B]``, ``[B, T]`` -> logits ``[B, T, VOCAB]`` predicting each response token, values."""
        prev = torch.cat([torch.full_like(responses[:, :1], VOCAB), responses[:, :-1]], dim=1)  # VOCAB = "start"
        h = self.body(self.prompt(prompts)[:, None] + self.prev(prev) + self.pos.weight[: responses.shape[1]])
        return self.lm_head(h), self.value_head(h).squeeze(-1)


@torch.no_grad()
def sample(policy: ToyPolicy, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``MAX_NEW`` tokens per prompt; the mask keeps each response up to and including its first stop."""
    responses = prompts.new_zeros(len(prompts), MAX_NEW)
    for t in range(MAX_NEW):
        logits, _ = policy(prompts, responses)
        responses[:, t] = torch.distributions.Categorical(logits=logits[:, t]).sample()
    stops = (responses == STOP).long()
    return responses, (stops.cumsum(1) - stops) == 0


def reward(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    right_symbol = responses[:, 0] == prompts
    return right_symbol.float() * (0.5 + 0.5 * (responses[:, 1] == STOP).float())


def train(estimator: str, steps: int, seed: int = 0) -> list[float]:
    """Train a fresh policy with ``estimator``'s advantages; returns the mean reward of every step."""
    torch.manual_seed(seed)
    policy = ToyPolicy()
    reference = copy.deepcopy(policy).requires_grad_(False)  # the KL anchor
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    rewards = []
    for _ in range(steps):
        prompts = torch.randint(1, VOCAB, (PROMPTS,)).repeat_interleave(SAMPLES)  # prompt-major groups
        responses, mask = sample(policy, prompts)
        scores = reward(prompts, responses)
        rewards.append(scores.mean().item())
        with torch.no_grad():
            logits, old_values = policy(prompts, responses)
            old_logprobs = logprobs_from_logits(logits, responses)
            ref_logprobs = logprobs_from_logits(reference(prompts, responses)[0], responses)
        if estimator == "gae":  # PPO: the KL penalty is part of the reward; a critic gives the baseline
            inputs = AdvantageInputs(
                mask,
                scores,
                token_rewards=kl_penalty(old_logprobs, ref_logprobs, mask, 0.01),
                values=old_values,
                gamma=1.0,
                lam=0.95,
            )
        elif estimator == "reinforce_plus_plus":  # no critic: whitened reward-to-go, KL in the reward
            inputs = AdvantageInputs(mask, scores, token_rewards=kl_penalty(old_logprobs, ref_logprobs, mask, 0.01))
        else:  # grpo / rloo: compare the samples of each prompt; KL goes into the loss instead
            inputs = AdvantageInputs(mask, scores, n_samples_per_prompt=SAMPLES)
        advantages, returns = compute_advantages(estimator, inputs)

        for _ in range(2):  # PPO epochs over the batch
            logits, values = policy(prompts, responses)
            logprobs = logprobs_from_logits(logits, responses)
            loss, _ = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.28)
            if estimator == "gae":
                value_loss, _ = clipped_value_loss(values, old_values, returns, mask, clip=0.2)
                loss = loss + 0.5 * value_loss
            if estimator in ("grpo", "rloo"):
                loss = loss + 0.01 * aggregate_loss(kl_estimate(logprobs, ref_logprobs, "k3", mask=mask), mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return rewards


def main() -> int:
    torch.set_num_threads(1)  # tensors this small run fastest on one thread
    failed = []
    for estimator in ("grpo", "rloo", "reinforce_plus_plus", "gae"):
        rewards = train(estimator, steps=60)
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        print(f"{estimator:20s} reward {first:.2f} -> {last:.2f}")
        if last < first + 0.3:
            failed.append(estimator)
    print("FAILED: " + ", ".join(failed) if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
