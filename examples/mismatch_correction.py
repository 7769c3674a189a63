#!/usr/bin/env python3
"""The engine samples from a perturbed model: what the rollout correction changes (hybrid-algos only, CPU, minutes).

In a real run the inference engine (vLLM, SGLang, bf16 kernels) and the trainer compute slightly different
distributions from the same weights. Here a toy policy is trained with GRPO and PPO's clipped loss while its
"engine" samples from a perturbed copy and reports the log-probs of what it sampled, exactly what an engine
hands the loop. The trainer computes its own log-probs of those tokens, as the training loop does.

Perturbations (``--scenario``):

- ``exact``: the engine is the trainer (the correction must change nothing).
- ``glitch``: at every token, with probability 0.1 the engine emits a uniformly random token (a kernel glitch;
  the engine keeps sampling tokens the trainer has ruled out).
- ``hot_token``: the engine adds +3 to one wrong symbol's logit (a systematic numerical outlier).
- ``noise``: zero-mean noise of standard deviation 0.5 on every logit, drawn afresh at every call.

Corrections (``--corrections``): ``none``, or a :func:`hybrid_algos.rollout_correction` method (``tis``,
``icepop``, ...); ``tis_low`` is ``tis`` with OpenRLHF's lower bound 0.5 (``--vllm_is_truncated_threshold 0.5 5``).

Printed per run: the reward of the engine's samples at the end, the reward of the *trained policy* sampled
without any perturbation (what is deployed), the engine-vs-trainer KL of the last batch (k1 of KL(engine ||
trainer), the ``mismatch/kl`` metric) and the trainer's lowest log-prob of a sampled token.

    python examples/mismatch_correction.py                     # the README table (3 seeds, a few minutes)
    python examples/mismatch_correction.py --scenario glitch --corrections none tis --seeds 0 --steps 150
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algos_only import MAX_NEW, PROMPTS, SAMPLES, STOP, VOCAB, ToyPolicy, reward

from hybrid_algos import (
    AdvantageInputs,
    compute_advantages,
    compute_policy_loss,
    logprobs_from_logits,
    rollout_correction,
)

SCENARIOS = ("exact", "glitch", "hot_token", "noise")
HOT = 5  # the symbol the hot_token engine favours (wrong for 8 of the 9 prompts)


def engine_probs(logits: torch.Tensor, scenario: str, gen: torch.Generator) -> torch.Tensor:
    """The engine's next-token distribution from the trainer's logits ``[B, V]`` under a perturbation."""
    if scenario == "hot_token":
        logits = logits + 3.0 * torch.nn.functional.one_hot(torch.tensor(HOT), VOCAB)
    elif scenario == "noise":
        logits = logits + 0.5 * torch.randn(logits.shape, generator=gen)
    p = torch.softmax(logits, dim=-1)
    if scenario == "glitch":
        p = 0.9 * p + 0.1 / VOCAB
    return p


@torch.no_grad()
def sample(policy: ToyPolicy, prompts: torch.Tensor, scenario: str, gen: torch.Generator):
    """Responses sampled by the engine, their mask (up to the first stop) and the engine's log-probs."""
    responses = prompts.new_zeros(len(prompts), MAX_NEW)
    engine_logprobs = torch.zeros(len(prompts), MAX_NEW)
    for t in range(MAX_NEW):
        logits, _ = policy(prompts, responses)
        p = engine_probs(logits[:, t], scenario, gen)
        tokens = torch.multinomial(p, 1, generator=gen).squeeze(1)
        responses[:, t] = tokens
        engine_logprobs[:, t] = p.gather(1, tokens[:, None]).squeeze(1).log()
    stops = (responses == STOP).long()
    return responses, (stops.cumsum(1) - stops) == 0, engine_logprobs


def run(scenario: str, correction: str, seed: int, steps: int = 200) -> dict[str, float]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    policy = ToyPolicy()
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    rewards = []
    for _ in range(steps):
        prompts = torch.randint(1, VOCAB, (PROMPTS,), generator=gen).repeat_interleave(SAMPLES)
        responses, mask, engine_lp = sample(policy, prompts, scenario, gen)
        scores = reward(prompts, responses)
        rewards.append(scores.mean().item())
        with torch.no_grad():
            old = logprobs_from_logits(policy(prompts, responses)[0], responses)
        advantages, _ = compute_advantages("grpo", AdvantageInputs(mask, scores, n_samples_per_prompt=SAMPLES))
        method, low = ("tis", 0.5) if correction == "tis_low" else (correction, None)
        corr = rollout_correction(
            old,
            engine_lp,
            mask,
            "tis" if method == "none" else method,
            low=low,
            high=5.0 if correction == "tis_low" else None,
        )
        weights = None if correction == "none" else corr.weights
        for _ in range(2):  # two PPO epochs over the batch
            logprobs = logprobs_from_logits(policy(prompts, responses)[0], responses)
            loss, _ = compute_policy_loss(
                "ppo", logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28, is_weights=weights
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    # The trained policy, sampled without perturbation: what a correct engine would serve after training.
    eval_gen = torch.Generator().manual_seed(99)
    prompts = torch.randint(1, VOCAB, (512,), generator=eval_gen)
    responses, _, _ = sample(policy, prompts, "exact", eval_gen)
    return {
        "engine_reward": statistics.mean(rewards[-10:]),
        "policy_reward": reward(prompts, responses).mean().item(),
        "mismatch_kl": corr.stats["kl"].item(),
        "min_logprob": old[mask].min().item(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--corrections", nargs="+", default=["none", "tis", "icepop", "tis_low"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tensors this small run fastest on one thread
    print(
        "| engine | correction | engine reward | trained policy reward | engine-trainer KL | lowest trainer log-prob |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for scenario in args.scenario:
        for correction in args.corrections:
            runs = [run(scenario, correction, seed, args.steps) for seed in args.seeds]
            cell = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
            print(
                f"| {scenario} | {correction} | {cell['engine_reward']:.2f} | {cell['policy_reward']:.2f} | "
                f"{cell['mismatch_kl']:.2f} | {cell['min_logprob']:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
