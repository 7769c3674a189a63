"""Token choice for the built-in engine: greedy, temperature / top-k / top-p sampling, reproducible per row.

Randomness is keyed per completion, not per batch: the row for sample ``j`` of a prompt draws its uniforms from a
generator seeded with ``hash(seed, prompt token ids, j, k)`` (``k`` counts earlier identical prompts in the same
call, so repeated prompts still get different samples). The same prompt with the same seed therefore yields the same
samples whatever else is in the batch, however the engine chunks it and however many engines share the call (up to
floating-point ties, since padding changes the order of additions in the forward pass).

A sampled token is found by inverse-CDF with one uniform per row and step: cheaper than a Gumbel draw over the whole
vocabulary, and it never picks a token whose filtered probability is zero.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Sequence

import torch

from .protocol import SamplingParams


def row_seeds(seed: int, prompts: Sequence[Sequence[int]], n: int) -> list[int]:
    """One 63-bit seed per output row, rows ordered prompt-major (prompt i, samples 0..n-1)."""
    seen: Counter = Counter()
    seeds = []
    for prompt in prompts:
        key = tuple(prompt)
        k = seen[key]
        seen[key] += 1
        h = hashlib.blake2b(struct.pack("<qq", seed, k), digest_size=8)
        h.update(struct.pack(f"<{len(key)}q", *key))
        base = h.digest()
        for j in range(n):
            row = hashlib.blake2b(base + struct.pack("<q", j), digest_size=8).digest()
            seeds.append(int.from_bytes(row, "little") >> 1)
    return seeds


def row_uniforms(seeds: Sequence[int], steps: int, device: torch.device) -> torch.Tensor:
    """``[rows, steps]`` uniforms in [0, 1): row ``r`` is the stream of ``seeds[r]`` (drawn once per call, on CPU)."""
    out = torch.empty(len(seeds), steps, dtype=torch.float32)
    gen = torch.Generator()
    for r, s in enumerate(seeds):  # once per call, not per token
        gen.manual_seed(s)
        torch.rand(steps, generator=gen, out=out[r])
    return out.to(device)


def choose_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    uniforms: torch.Tensor | None,
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token per row from float32 ``logits [rows, vocab]``.

    ``banned`` (token ids) get probability 0: stop tokens before ``min_new_tokens`` is reached. ``uniforms [rows]``
    drive sampling; greedy ignores them (ties go to the lowest id, as ``argmax`` does).
    """
    if banned is not None and banned.numel():
        logits = logits.index_fill(1, banned, float("-inf"))
    if params.greedy:
        return logits.argmax(dim=-1)
    assert uniforms is not None
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    order = None
    if 0 < params.top_k < vocab:
        logits, order = logits.topk(params.top_k, dim=-1)  # sorted, largest first
    elif params.top_p < 1.0:
        logits, order = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is below top_p.
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # First index whose cdf exceeds the target: an interval of zero width (probability 0) is never chosen. If
    # rounding puts the target on the total, fall back to the last token with non-zero probability.
    pick = torch.searchsorted(cdf, uniforms.unsqueeze(-1) * total, right=True)
    last = (cdf < total).sum(dim=-1, keepdim=True)
    pick = torch.minimum(pick, last)
    return pick.squeeze(-1) if order is None else order.gather(-1, pick).squeeze(-1)
